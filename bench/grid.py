"""Benchmark: a hyperparameter grid of H configurations trained batched vs the same configurations one after
another, and the achieved GFLOP/s of batched head training next to torch.mm's GFLOP/s on this machine.
Prints one JSON object. Run: `.venv/bin/python bench/grid.py [--sizes 16,64] [--rounds 5]`.

Setting: FedPCL's feature-shift shape (5 clients x 100 training images, 3 x ResNet18 = 1536-d features, projection
256, 10 classes), FedAvg head, a grid over lr x weight decay. Sequential time is measured on min(H, 16) configurations
and scaled linearly to H (each configuration is an independent run of the same cost). FLOPs count the matmuls of the
forward and backward passes of local training plus evaluation (2·m·n·k per product).

`optimizer_step` sets the fused per-configuration optimizer (featcache.training.optim.OPTIMIZERS) beside the
masked whole-stack one (featcache.training.optim.MASKED) on the grid's parameter stack [H, C, ...], every client
stepping (FedAvg's usual step): aten ops dispatched per step (about one kernel launch each on a GPU; counted by
featcache.testing's OpCount) and seconds per step on the bench's device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import featcache.cli  # noqa: F401  (the CLI's thread setting, as `featcache` runs)
import torch

from featcache.algorithms import create
from featcache.memory import keep_freed_memory
from featcache.training.config import resolve
from featcache.training.engine import Engine
from featcache.training.schedule import trained_rows
from featcache.training.optim import MASKED, OPTIMIZERS
from featcache.testing import OpCount, synthetic_clients

keep_freed_memory()  # the training commands' allocator setting, as `featcache train` runs


def mm_gflops(device: str, n: int = 1024, repeats: int = 10) -> float:
    """torch.mm's float32 GFLOP/s on `device` (the grid's), the reference for the grid's achieved rate."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    torch.mm(a, b)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    sync()
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e9


def optimizer_step(algo: str, cfgs: list[dict], train, test, device: str, repeats: int = 5) -> dict:
    """Dispatched ops and seconds per optimizer step, fused vs masked, on the grid's parameter stack; the fused one
    gets the models that step as host lists too (as eager steps pass them), the masked one only the device tensor."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    engine = Engine(create(algo), cfgs, train, test, device)
    params, hp = engine.state.params, engine.hp  # name -> [H, C, ...]; name -> [H]
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    active = torch.ones(*next(iter(params.values())).shape[:2], dtype=torch.bool, device=device)  # [H, C]
    out = {}
    for kind, table, host in (("fused", OPTIMIZERS, active.tolist()), ("masked", MASKED, None)):
        opt = table[cfgs[0]["optimizer"]]({k: v.clone() for k, v in params.items()}, hp)
        opt.step(grads, active, host=host)  # the first step also adopts the gradients' layout
        with OpCount() as count:
            opt.step(grads, active, host=host)
        sync()
        t0 = time.perf_counter()
        for _ in range(repeats):
            opt.step(grads, active, host=host)
        sync()
        out[kind] = {"ops_per_step": len(count.ops), "step_ms": round((time.perf_counter() - t0) / repeats * 1e3, 3)}
        del opt
    return out


def configs(base: dict, H: int) -> list[dict]:
    lrs = [10 ** (-1 - 3 * i / 7) for i in range(8)]
    wds = [10 ** (-2 - 3 * i / 7) for i in range(8)]
    return [base | {"lr": lr, "weight_decay": wd} for lr, wd in itertools.islice(itertools.product(lrs, wds), H)]


def train_flops(cfg: dict, train, test, H: int) -> float:
    D, P, K = train.features.shape[-1], cfg["proj_dim"], train.num_classes
    B = cfg["batch_size"]
    trained = sum(trained_rows(train.counts.tolist(), B, cfg["drop_last"]))
    per_sample = 2 * (D * P + P * K)
    return H * cfg["rounds"] * (3 * per_sample * trained * cfg["local_epochs"] + per_sample * int(test.counts.sum()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--algo", default="fedavg")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    train = synthetic_clients(C=5, n=(100, 100), D=1536, K=10, seed=0).to(args.device)
    test = synthetic_clients(C=5, n=(200, 200), D=1536, K=10, seed=1).to(args.device)
    algo = create(args.algo)
    base = resolve(algo, {"rounds": args.rounds})
    sync = (lambda: torch.cuda.synchronize()) if args.device.startswith("cuda") else (lambda: None)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    Engine(algo, configs(base, 2), train, test, args.device).run()  # warm-up (first-call imports, allocator)
    out = {
        "algo": args.algo,
        "rounds": args.rounds,
        "clients": 5,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "mm_gflops": round(mm_gflops(args.device), 1),
        "grids": [],
    }
    for H in (int(s) for s in args.sizes.split(",")):
        cfgs = configs(base, H)
        batched = timed(lambda: Engine(create(args.algo), cfgs, train, test, args.device).run())
        eager = {}
        if args.device.startswith("cuda"):  # the same batched run with eager local steps (no CUDA graphs)
            eager = {
                "batched_eager_seconds": round(
                    timed(lambda: Engine(create(args.algo), cfgs, train, test, args.device, capture="off").run()), 3
                )
            }
        n_seq = min(H, 16)
        t0 = time.perf_counter()
        for c in cfgs[:n_seq]:
            Engine(create(args.algo), [c], train, test, args.device).run()
        sync()
        sequential = (time.perf_counter() - t0) * H / n_seq
        gflops = train_flops(base, train, test, H) / batched / 1e9
        out["grids"].append(
            {
                "H": H,
                "batched_seconds": round(batched, 3),
                **eager,
                "sequential_seconds": round(sequential, 3),
                "sequential_measured_configs": n_seq,
                "speedup": round(sequential / batched, 2),
                "target_speedup": round(0.5 * H, 1),
                "batched_gflops": round(gflops, 2),
                "fraction_of_mm": round(gflops / out["mm_gflops"], 3),
                "target_fraction_of_mm": 0.4,
                "optimizer_step": optimizer_step(args.algo, cfgs, train, test, args.device),
            }
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
