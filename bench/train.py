"""Benchmark: seconds per round of the vectorized engine vs a plain per-client loop on the same cached tensors, and
vs the official-FedPCL pattern that re-runs three frozen ResNet18s (64x64) on every batch, prototype pass and test
batch. Prints one JSON object. Run: `.venv/bin/python bench/train.py [--clients 20] [--rounds 5] [--repeats 3]`;
`make bench` adds the demo's `train` (`--demo-cache`, `--demo-train`): its wall time and the share spent outside its
rounds.
The engine and the plain loop are timed alternately, `repeats` times each, each timed run right after an untimed one
of the same contender (a run that follows the other contender would pay for faulting in the pages that one
freed); the medians are compared. On a GPU
(`--device cuda`) the engine also runs with its local steps eager instead of captured as CUDA graphs, and a profiled
run gives the share of the round the GPU is busy.

The plain loop is featcache.testing.plain_loop (one Python iteration per client and minibatch, torch.optim). The
official pattern's round time = (images it pushes through the backbones per round) / (measured images/s of three
ResNet18s on real 64x64 batches in this run) + the head's own time; backbone throughput is measured here, not assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import featcache.cli  # noqa: F401  (the CLI's thread setting, as `featcache` runs)
import torch

from featcache.algorithms import create
from featcache.memory import keep_freed_memory
from featcache.training.config import resolve
from featcache.training.engine import Engine
from featcache.testing import plain_loop, synthetic_clients

keep_freed_memory()  # the training commands' allocator setting, as `featcache train` runs


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
    ap.add_argument("--demo-cache", default=None, help="also time `featcache train --cache DEMO_CACHE DEMO_TRAIN`")
    ap.add_argument("--demo-train", default="", help="the demo's train arguments (the Makefile's DEMO_TRAIN)")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    train = synthetic_clients(C=args.clients, n=(100, 100), D=args.dim, K=10, seed=0)  # FedPCL: 100 train / client
    test = synthetic_clients(C=args.clients, n=(200, 200), D=args.dim, K=10, seed=1)
    algo = create(args.algo)
    cfg = resolve(algo, {"rounds": args.rounds})

    dev = args.device
    cuda = dev.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    train, test = train.to(dev), test.to(dev)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) / args.rounds

    Engine(algo, [resolve(algo, {"rounds": 1})], train, test, dev).run()  # warm-up: first-call dispatch, allocator
    # logs=False: test accuracy per round, as the plain loop computes (no train accuracy, loss or global model)
    contenders = {
        "vectorized": lambda: Engine(algo, [cfg], train, test, dev).run(logs=False),
        "plain_loop": lambda: plain_loop(create(args.algo), cfg, train, test, dev),
    }
    if cuda:  # the same engine with its local steps run eagerly, not replayed from CUDA graphs
        contenders["vectorized_eager"] = lambda: Engine(algo, [cfg], train, test, dev, capture="off").run(logs=False)
    runs = {k: [] for k in contenders}
    for _ in range(args.repeats):  # interleaved, so a noisy neighbour slows all alike; the median of each
        for k, fn in contenders.items():
            fn()  # untimed, right before: neither contender pays for the memory the other one left behind
            runs[k].append(timed(fn))
    vec, loop = statistics.median(runs["vectorized"]), statistics.median(runs["plain_loop"])

    ips = backbone_images_per_second()
    n_train, n_test = int(train.counts.sum()), int(test.counts.sum())
    images_per_round = n_train * cfg["local_epochs"] + n_train + n_test  # batches + prototype pass + test batches
    official = images_per_round / ips + loop
    print(
        json.dumps(
            {
                "algo": args.algo,
                "device": dev,
                "clients": args.clients,
                "feature_dim": args.dim,
                "rounds": args.rounds,
                "threads": torch.get_num_threads(),
                "repeats": args.repeats,
                "all_seconds_per_round": {k: [round(t, 4) for t in v] for k, v in runs.items()},
                "seconds_per_round": {
                    "vectorized": round(vec, 5),
                    "plain_loop": round(loop, 5),
                    "official_pattern": round(official, 3),
                },
                "backbone_images_per_second_3xresnet18_64px": round(ips, 1),
                "official_images_per_round": images_per_round,
                "ratio_plain_over_vectorized": round(loop / vec, 2),
                "target_plain_over_vectorized": 5,
                "ratio_official_over_cache": round(official / vec, 1),
                "target_official_over_cache": 200,
            }
            | (
                gpu_figures(runs, lambda: Engine(algo, [cfg], train, test, dev).run(logs=False), args.rounds)
                if cuda
                else {}
            )
            | ({"demo_train": outside_the_rounds(args.demo_cache, args.demo_train)} if args.demo_cache else {}),
            indent=1,
        )
    )


# `featcache train` itself, Engine.run (its rounds, each with its evaluation) timed from inside the process
INSIDE = """
import atexit, json, os, sys, time
import featcache.cli
from featcache.training.engine import Engine
inside, run = [], Engine.run
def timed(self, *a, **k):
    t0 = time.perf_counter()
    try:
        return run(self, *a, **k)
    finally:
        inside.append(time.perf_counter() - t0)
Engine.run = timed
atexit.register(lambda: open(os.environ["FEATCACHE_BENCH_OUT"], "w").write(json.dumps(sum(inside))))
sys.argv = ["featcache", *sys.argv[1:]]
featcache.cli.main()
"""


def outside_the_rounds(cache: str, train_args: str) -> dict:
    """The demo's `train` as the command runs (a fresh process, a fresh --out): its wall time, the time inside its
    rounds and the share outside them (interpreter start, imports, cache load, checks, memory estimate, result
    files), with the load before and after."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out, figure = os.path.join(tmp, "runs"), os.path.join(tmp, "inside.json")
        argv = ["train", "--cache", cache, *shlex.split(train_args), "--out", out]
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", INSIDE, *argv],
            check=True,
            capture_output=True,
            env=os.environ | {"FEATCACHE_BENCH_OUT": figure},
        )
        wall = time.perf_counter() - t0
        with open(figure) as f:
            inside = json.load(f)
    return {
        "command": shlex.join(["featcache", *argv[:-2]]),
        "wall_seconds": round(wall, 2),
        "inside_rounds_seconds": round(inside, 2),
        "outside_share": round(1 - inside / wall, 3),
        "target_outside_share": 0.10,
        "load_before_after": [round(load, 1), round(os.getloadavg()[0], 1)],
    }


def gpu_figures(runs: dict, run, rounds: int) -> dict:
    """On a GPU: round time against its 5 ms target, captured vs eager local steps, and the share of a profiled run's
    wall time the GPU spent executing kernels (summed kernel time / wall time; the profiler's own overhead and the
    fresh engine's capture in its first round lower it, so the figure errs low)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6  # seconds
    vec, eager = statistics.median(runs["vectorized"]), statistics.median(runs["vectorized_eager"])
    return {
        "round_ms": round(vec * 1e3, 3),
        "target_round_ms": 5,
        "round_ms_eager": round(eager * 1e3, 3),
        "ratio_eager_over_captured": round(eager / vec, 2),
        "kernels_per_round": len(kernels) // rounds,
        "gpu_busy_fraction": round(busy / wall, 3),
        "target_gpu_busy_fraction": 0.5,
    }


if __name__ == "__main__":
    main()
