"""Benchmark: one algorithm as a Flower simulation (featcache.flower's ServerApp + ClientApp on Flower's simulation
runtime, Ray) vs `featcache train` on the same cache: seconds per round of each and the bytes Flower's messages carry
per round (server -> clients and back, measured from the records sent: `ArrayRecord.count_bytes` plus the skeleton)
beside featcache's own `params up/client/round` (the floats one client uploads, x 4 bytes). Prints one JSON object,
the machine's load average before and after included. Run:
`.venv/bin/python bench/flower.py [--algo fedpcl] [--clients 4] [--rounds 3] [--dim 64]`.

A Flower round is two message exchanges (train to the participants, download + evaluation to every client); each
client's state travels into and out of Flower's context state at every message, and a simulated node reloads
nothing (its rows are read once per actor process). Like with like: both sides run under the command's thread policy
(OpenMP threads wait passively, `featcache.threads`; Ray's actors inherit it), and featcache's round is timed with
its evaluation, as Flower's is: (wall of `rounds` rounds - wall of 1 round) / (rounds - 1) after an untimed call,
which also cancels the fixed costs of a call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from featcache.threads import passive_wait  # noqa: E402

passive_wait()  # before torch loads: the `featcache` command's OpenMP waiting, here and in Ray's actors

import featcache  # noqa: E402
from synthetic import write_cache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algo", default="fedpcl")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64, help="feature size of the synthetic cache")
    args = ap.parse_args()
    load_before = os.getloadavg()
    settings = {"batch_size": 16, "drop_last": False, "proj_dim": 32}
    from flwr.simulation import run_simulation

    from featcache.flower import client_app, server_app

    with tempfile.TemporaryDirectory() as tmp:
        cache = write_cache(Path(tmp) / "c.h5", C=args.clients, D=args.dim)
        featcache.train(cache, args.algo, rounds=1, seeds=[0], set=settings, out=Path(tmp) / "warm")  # first-call costs
        walls = {}
        for rounds in (1, args.rounds):  # featcache's round with its evaluation: the difference of two calls
            t0 = time.perf_counter()
            sim = featcache.train(
                cache, args.algo, rounds=rounds, seeds=[0], set=settings, out=Path(tmp) / f"r{rounds}"
            )
            walls[rounds] = time.perf_counter() - t0
        train_round = (walls[args.rounds] - walls[1]) / max(args.rounds - 1, 1)
        got: dict = {}
        t0 = time.perf_counter()
        run_simulation(
            server_app(args.algo, settings, 0, args.rounds, timeout=600, on_result=lambda r, w: got.update(raw=r, w=w)),
            client_app(args.algo, settings, 0, args.rounds, cache=cache),
            num_supernodes=args.clients,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}},
        )
        flower_wall = time.perf_counter() - t0
    raw, wire = got["raw"], got["w"]
    per_round = lambda k: statistics.mean(wire[k]) if wire.get(k) else 0
    floats = sim["params_uploaded_per_round"]
    acc = float(raw["acc"][-1].double().mean() * 100)
    out = {
        "algo": args.algo,
        "clients": args.clients,
        "rounds": args.rounds,
        "dim": args.dim,
        "featcache_train": {
            "seconds_per_round_with_evaluation": round(train_round, 4),
            "seconds_per_round_local_and_server": sim["seconds_per_round"],
            "wall_seconds": round(walls[args.rounds], 2),
        },
        "flower_simulation": {
            "seconds_per_round": round(statistics.median(raw["round_seconds"]), 4),
            "wall_seconds_with_runtime_start": round(flower_wall, 2),
        },
        "seconds_per_round_ratio_flower_over_train": round(
            statistics.median(raw["round_seconds"]) / max(train_round, 1e-9), 1
        ),
        "bytes_per_round": {
            "featcache_params_up_per_client": floats * 4,
            "flower_train_up_per_client": round(per_round("train up") / args.clients),
            "flower_train_down": round(per_round("train down")),
            "flower_train_up": round(per_round("train up")),
            "flower_evaluate_down": round(per_round("evaluate down")),
            "flower_evaluate_up": round(per_round("evaluate up")),
        },
        "params_up_per_client_round": floats,
        "final_mean_acc": {"flower": round(acc, 4), "train": sim["mean_acc"]},
        "load_average_1_5_15": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
