"""Benchmark: seconds per round of the vectorized engine vs a plain per-client loop on the same cached tensors, and
vs the official-FedPCL pattern that re-runs three frozen ResNet18s (64x64) on every batch, prototype pass and test
batch. Prints one JSON object. Run: `.venv/bin/python bench/train.py [--clients 20] [--rounds 5] [--repeats 3]`.
The engine and the plain loop are timed alternately, `repeats` times each; the medians are compared.

The plain loop is featcache.testing.plain_loop (one Python iteration per client and minibatch, torch.optim). The official
pattern's round time = (images it pushes through the backbones per round) / (measured images/s of three ResNet18s on
real 64x64 batches in this run) + the head's own time; backbone throughput is measured here, not assumed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import featcache.cli  # noqa: E402, F401  (before torch: the CLI's allocator setting, as `featcache` runs)
import torch  # noqa: E402

from featcache.algorithms import create  # noqa: E402
from featcache.config import resolve  # noqa: E402
from featcache.engine import Engine  # noqa: E402
from featcache.testing import plain_loop  # noqa: E402
from tests.synthetic import synthetic_clients  # noqa: E402


def backbone_images_per_second(batch: int = 32, size: int = 64, repeats: int = 3) -> float:
    """Three frozen ResNet18s (random weights: same FLOPs as SUR's) on one batch of 64x64 images, eval mode."""
    import timm

    nets = [timm.create_model("resnet18", num_classes=0).eval() for _ in range(3)]
    x = torch.randn(batch, 3, size, size)
    with torch.inference_mode():
        for n in nets:
            n(x)  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            for n in nets:
                n(x)
    return batch * repeats / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dim", type=int, default=1536, help="feature size (3 x ResNet18 = 1536)")
    ap.add_argument("--algo", default="fedpcl")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (engine and plain loop alike)")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    train = synthetic_clients(C=args.clients, n=(100, 100), D=args.dim, K=10, seed=0)  # FedPCL: 100 train / client
    test = synthetic_clients(C=args.clients, n=(200, 200), D=args.dim, K=10, seed=1)
    algo = create(args.algo)
    cfg = resolve(algo, {"rounds": args.rounds})

    dev = args.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    train, test = train.to(dev), test.to(dev)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) / args.rounds

    Engine(algo, [resolve(algo, {"rounds": 1})], train, test, dev).run()  # warm-up: first-call dispatch, allocator
    runs = {"vectorized": [], "plain_loop": []}
    for _ in range(args.repeats):  # interleaved, so a noisy neighbour slows both alike; the median of each
        # logs=False: test accuracy per round, as the plain loop computes (no train accuracy, loss or global model)
        runs["vectorized"].append(timed(lambda: Engine(algo, [cfg], train, test, dev).run(logs=False)))
        runs["plain_loop"].append(timed(lambda: plain_loop(create(args.algo), cfg, train, test, dev)))
    vec, loop = statistics.median(runs["vectorized"]), statistics.median(runs["plain_loop"])

    ips = backbone_images_per_second()
    n_train, n_test = int(train.counts.sum()), int(test.counts.sum())
    images_per_round = n_train * cfg["local_epochs"] + n_train + n_test  # batches + prototype pass + test batches
    official = images_per_round / ips + loop
    print(json.dumps({
        "algo": args.algo, "device": dev, "clients": args.clients, "feature_dim": args.dim, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "repeats": args.repeats,
        "all_seconds_per_round": {k: [round(t, 4) for t in v] for k, v in runs.items()},
        "seconds_per_round": {"vectorized": round(vec, 5), "plain_loop": round(loop, 5),
                              "official_pattern": round(official, 3)},
        "backbone_images_per_second_3xresnet18_64px": round(ips, 1),
        "official_images_per_round": images_per_round,
        "ratio_plain_over_vectorized": round(loop / vec, 2), "target_plain_over_vectorized": 5,
        "ratio_official_over_cache": round(official / vec, 1), "target_official_over_cache": 200,
    }, indent=1))


if __name__ == "__main__":
    main()
