"""Benchmark: what uneven clients cost. The vectorized engine against a plain per-client loop at 1 thread on
Dirichlet-uneven clients (label skew, alpha 0.5, Hsu et al. 2019: each class's rows split over the clients by a
Dirichlet draw), the field's standard setting, where the largest client holds many times the smallest's rows.

Per case (algorithm x client count): seconds per round of `Engine.run(logs=False)` and of
`featcache.testing.plain_loop` (both evaluate test accuracy every round), timed alternately `--repeats` times, each
timed run right after an untimed one of the same contender; the medians' ratio; the largest accuracy difference
between the two (they train the same models: float32 rounding only); and the share of the client-steps the engine
computes that carry a batch (sum of the clients' steps over the sum of each step's trained prefix). Also FedProx's
round over FedAvg's at participation 1 on the 20-client case. Prints one JSON object with the targets as pass/fail
(not asserted) and the 1-minute load before and after.
Run: `.venv/bin/python bench/uneven.py [--clients 4,20,100] [--rows 10000] [--rounds 3] [--repeats 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import featcache.cli  # noqa: F401  (the CLI's thread setting, as `featcache` runs)
import numpy as np
import torch

from featcache.algorithms import create
from featcache.cache import ClientData
from featcache.memory import keep_freed_memory
from featcache.training.config import resolve
from featcache.training.engine import Engine
from featcache.testing import plain_loop

keep_freed_memory()  # the training commands' allocator setting, as `featcache train` runs
TARGETS = {"speed_over_plain_loop": 1.5, "batch_share": 0.95, "fedprox_over_fedavg": 1.3}


def dirichlet_clients(C: int, rows: int, D: int, K: int, alpha: float, seed: int) -> tuple[ClientData, ClientData]:
    """Train and test splits of C clients: class centres in D dims, each class's rows split over the clients by
    Dirichlet(alpha) proportions (the same for both splits; test holds a quarter of train's rows), every client at
    least 8 train rows."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((K, D)).astype(np.float32) * 0.3
    share = rng.dirichlet(np.full(C, alpha), size=K)  # [K, C] class -> client proportions

    def split(n_rows: int, floor: int) -> ClientData:
        counts = np.maximum(np.floor(share * n_rows / K).astype(int), 0)  # [K, C]
        counts[0] += np.maximum(floor - counts.sum(0), 0)  # the floor taken from class 0
        per_client = counts.sum(0)  # [C]
        N = int(per_client.max())
        x = np.zeros((C, N, D), np.float32)
        y = np.full((C, N), -1, np.int64)
        for c in range(C):
            labels = np.repeat(np.arange(K), counts[:, c])
            x[c, : len(labels)] = centres[labels] + rng.standard_normal((len(labels), D)).astype(np.float32)
            y[c, : len(labels)] = labels
        return ClientData(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(per_client), K, None)

    return split(rows, 8), split(rows // 4, 2)


def batch_share(eng: Engine) -> float:
    """The share of the client-steps one round of `eng` computes that carry a batch (after a round has run)."""
    computed = sum(len(host[0]) for host in eng.clients.runner.host) * eng.H
    carried = int(eng.plan.client_steps.sum()) * eng.H
    return carried / computed


def seconds_per_round(contenders: dict, rounds: int, repeats: int) -> dict:
    """Median seconds per round of each contender, timed alternately, each right after an untimed run of itself."""
    runs: dict = {k: [] for k in contenders}
    for _ in range(repeats):
        for k, fn in contenders.items():
            fn()
            t0 = time.perf_counter()
            fn()
            runs[k].append((time.perf_counter() - t0) / rounds)
    return {k: statistics.median(v) for k, v in runs.items()} | {"all": runs}


def case(algo_name: str, train: ClientData, test: ClientData, rounds: int, repeats: int) -> dict:
    cfg = resolve(create(algo_name), {"rounds": rounds}) | {"seed": 0}
    eng = Engine(create(algo_name), [cfg], train, test)
    acc = eng.run(logs=False)["acc"][:, 0]  # [R, C]
    ref, _ = plain_loop(create(algo_name), cfg, train, test)  # [R, C]
    times = seconds_per_round(
        {
            "vectorized": lambda: Engine(create(algo_name), [cfg], train, test).run(logs=False),
            "plain_loop": lambda: plain_loop(create(algo_name), cfg, train, test),
        },
        rounds,
        repeats,
    )
    counts = train.counts.tolist()
    return {
        "algo": algo_name,
        "clients": len(counts),
        "train_rows": [min(counts), max(counts), sum(counts)],
        "seconds_per_round": {k: round(times[k], 4) for k in ("vectorized", "plain_loop")},
        "all_seconds_per_round": {k: [round(t, 4) for t in v] for k, v in times["all"].items()},
        "speed_over_plain_loop": round(times["plain_loop"] / times["vectorized"], 2),
        "max_accuracy_difference": float((acc - ref).abs().max()),
        "batch_share": round(batch_share(eng), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="4,20,100")
    ap.add_argument("--algos", default="fedavg,fedpcl")
    ap.add_argument("--rows", type=int, default=10_000, help="train rows over all clients")
    ap.add_argument("--dim", type=int, default=1280)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = [os.getloadavg()[0]]
    cases, data = [], {}
    for C in map(int, args.clients.split(",")):
        data[C] = dirichlet_clients(C, args.rows, args.dim, 10, 0.5, seed=C)
        cases += [case(a, *data[C], args.rounds, args.repeats) for a in args.algos.split(",")]
    C = 20 if 20 in data else next(iter(data))
    prox = seconds_per_round(
        {
            a: lambda a=a: Engine(create(a), [resolve(create(a), {"rounds": args.rounds}) | {"seed": 0}], *data[C]).run(
                logs=False
            )
            for a in ("fedavg", "fedprox")
        },
        args.rounds,
        args.repeats,
    )
    load.append(os.getloadavg()[0])
    fedprox = round(prox["fedprox"] / prox["fedavg"], 2)
    passed = {
        "speed_over_plain_loop": all(
            c["speed_over_plain_loop"] >= TARGETS["speed_over_plain_loop"] for c in cases if c["clients"] >= 20
        ),
        "batch_share": all(c["batch_share"] >= TARGETS["batch_share"] for c in cases),
        "fedprox_over_fedavg": fedprox <= TARGETS["fedprox_over_fedavg"],
    }
    print(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "feature_dim": args.dim,
                "rounds": args.rounds,
                "repeats": args.repeats,
                "load_1min": load,
                "cases": cases,
                "fedprox_over_fedavg": {"clients": C, "ratio": fedprox, "seconds_per_round": prox["all"]},
                "targets": TARGETS,
                "passed": passed,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
