"""Benchmark: `featcache search` with successive halving vs the exhaustive `featcache grid` over the same 64
configurations, and TPE vs random search at an equal trial budget. Prints one JSON object.

Run: `.venv/bin/python bench/search.py --demo CACHE --skewed CACHE [--rounds 50] [--seeds 0,1]`. Without caches it
extracts them into --work: the demo cache (`make demo`'s extraction: offline-digits, 3 EfficientNet-Lites, one client
per domain; `--backbone efficientnet_lite0` for a third of the cost) and a label-skewed one (offline-digits' mnist
domain over 4 clients, Dirichlet α = 0.1, 30 images per class and client on average: 1,200 training rows, half of
each client's held out for validation). The gap is measured in validation accuracy, the mean of the clients'
accuracies, so the skewed cache holds enough validation images to tell 0.5 points apart: from the demo's 10 per
class and a fifth held out, its clients would hold 12-24 validation images, one image moving the mean by 1.0-2.1
points; here they hold 100-179, 0.25 points at most. Each case prints `one_image_points`, the most one validation
image moves one seed's score. Every configuration trains two seeds (`--seeds 0,1`) on both sides, and both score it
by the mean over seeds: with seed 0 alone the skewed grid's six best points end within 0.52 points of each other,
and which is "best" is that round's noise (docs/guides/search.md, the default schedule).

Per cache, side by side in one process: the grid of lr (8 values) x weight decay (8 values) for FedAvg, validation-
selected and retrained; the search of the same 64 points (`--sampler grid --pruner halving`, every point one trial,
pruned at the search's default rungs); TPE and random search over the continuous ranges with `--trials` trials each.
Each case carries `time_ratio` (search / grid wall time, retrains included; `cpu_time_ratio` the same in this
process's CPU seconds, which other processes' load leaves alone), `gap_points` (the grid's best minus the search's
best: validation accuracy points, and the retrained test accuracy) and `model_rounds` (models x rounds trained, both
sides: the figure that carries to a GPU). The machine's 1-minute load is printed before and after each case.

`--schedules` adds the evidence for the default schedule: the 64 points' per-round validation curves (the same
search unpruned) and, for each rung schedule (η 2..4, 1..3 rungs), what synchronous halving on those curves keeps
(survivors train as alone, so the curves decide it exactly): its best, gap and model-rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import featcache
import featcache.cli  # noqa: F401  (the CLI's thread setting, as `featcache` runs)
from featcache.cache import info as cache_info
from featcache.errors import UserError
from featcache.memory import keep_freed_memory
from featcache.runs.space import PRUNERS, Rungs, rung_rounds

keep_freed_memory()  # the training commands' allocator setting, as `featcache train` runs

LRS = [round(10 ** (-1 - 3 * i / 7), 7) for i in range(8)]  # 0.1 .. 1e-4
WDS = [round(10 ** (-2 - 3 * i / 7), 7) for i in range(8)]  # 1e-2 .. 1e-5
RANGES = {"lr": "loguniform:1e-4,0.1", "weight_decay": "loguniform:1e-5,1e-2"}
TARGETS = {"time_ratio": 0.3, "gap_points": 0.5}
SKEWED = {"per_class": 30, "val_fraction": 0.5}  # the label-skewed cache's validation size (the module docstring)


def demo_caches(work: Path, backbones: list[str]) -> tuple[str, str]:
    """The demo cache and a label-skewed cache (4 clients, α = 0.1, `SKEWED`), extracted into `work` (cache hits
    after once)."""
    common = dict(dataset="offline-digits", backbone=backbones, test_per_class=50, image_size=64, out=str(work))
    demo = featcache.extract(partition="feature", per_class=10, **common)["cache"]
    skewed = featcache.extract(partition="label", clients=4, alpha=0.1, **SKEWED, **common)
    return demo, skewed["cache"]


def one_image_points(cache: str) -> float:
    """The most one validation image moves one seed's validation score (the mean of the clients' accuracies, in
    points): 100 / (clients x the smallest client's validation rows)."""
    clients = cache_info(cache)["counts"]["clients"]
    return 100 / (len(clients) * min(c["val"] for c in clients))


def timed(fn, **kwargs) -> tuple[dict, float, float]:
    """fn's result, wall seconds and this process's CPU seconds (what a shared machine's load leaves alone); a line
    on stderr when it ends (the bench takes minutes)."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn(**kwargs)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"{fn.__name__} -> {kwargs['out']}: {seconds:.1f} s ({cpu:.1f} s CPU), load {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    return result, seconds, cpu


def case(cache: str, rounds: int, seeds: list[int], trials: int, out: Path) -> dict:
    """One cache: grid vs halving search over the same 64 points; TPE vs random at `trials` trials."""
    common = dict(cache=cache, algo="fedavg", seeds=seeds, rounds=rounds)
    grid, t_grid, c_grid = timed(featcache.grid, grid={"lr": LRS, "weight_decay": WDS}, out=out / "grid", **common)
    sha, t_sha, c_sha = timed(
        featcache.search,
        space={"lr": LRS, "weight_decay": WDS},
        trials=64,
        sampler="grid",
        pruner="halving",
        out=out / "halving",
        **common,
    )
    grid_rounds = len(LRS) * len(WDS) * len(seeds) * rounds
    best_val = grid["selection"][0]["val_mean"]
    halving = {
        "seconds": {"grid": round(t_grid, 2), "search": round(t_sha, 2)},
        "time_ratio": round(t_sha / t_grid, 3),
        "cpu_seconds": {"grid": round(c_grid, 2), "search": round(c_sha, 2)},
        "cpu_time_ratio": round(c_sha / c_grid, 3),
        "model_rounds": {"grid": grid_rounds, "search": sha["model_rounds"]},
        "model_round_ratio": round(sha["model_rounds"] / grid_rounds, 3),
        "gap_points": {
            "validation": round(best_val - sha["selection"][0]["val_mean"], 3),
            "retrained_test": round(grid["retrain"]["mean_acc"] - sha["retrain"]["mean_acc"], 3),
        },
        "best": {"grid": grid["best"], "search": sha["best"]},
        "rungs": sha["rungs"],
        "reduction": sha["reduction"],
        "completed_trials": sum(r["state"] == "complete" for r in sha["selection"]),
    }
    budget = {}
    for sampler in ("tpe", "random"):
        found, seconds, cpu = timed(
            featcache.search,
            space=RANGES,
            trials=trials,
            sampler=sampler,
            pruner="none",
            batch=max(1, trials // 4),
            out=out / sampler,
            **common,
        )
        budget[sampler] = {
            "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu, 2),
            "best": found["best"],
            "best_val": round(found["selection"][0]["val_mean"], 3),
            "gap_points_to_grid": round(best_val - found["selection"][0]["val_mean"], 3),
            "retrained_test": round(found["retrain"]["mean_acc"], 3),
            "model_rounds": found["model_rounds"],
        }
    return {
        "cache": cache,
        "one_image_points": round(one_image_points(cache), 3),
        "load_1min": round(os.getloadavg()[0], 2),
        "grid_best_val": round(best_val, 3),
        "grid_retrained_test": round(grid["retrain"]["mean_acc"], 3),
        "halving_vs_grid": halving,
        "meets": {
            "time_ratio": halving["time_ratio"] <= TARGETS["time_ratio"],
            "gap_points": max(halving["gap_points"].values()) <= TARGETS["gap_points"],
        },
        f"tpe_vs_random_{trials}_trials": budget,
    }


def schedules(cache: str, rounds: int, seeds: list[int], out: Path) -> dict:
    """The 64 points' validation curves (unpruned) and, per rung schedule, synchronous halving replayed on them."""
    full = featcache.search(
        cache=cache,
        algo="fedavg",
        space={"lr": LRS, "weight_decay": WDS},
        trials=64,
        sampler="grid",
        pruner="none",
        seeds=seeds,
        rounds=rounds,
        out=out / "curves",
        retrain=False,
    )
    curves = {r["trial"]: r["curve"] for r in full["selection"]}
    best = full["selection"][0]["val_mean"]
    found = {}
    for reduction in (2, 3, 4):
        for rungs in (1, 2, 3):
            try:
                at = rung_rounds(rounds, "halving", rungs, reduction)
            except UserError:
                continue
            rule, live, spent = Rungs(PRUNERS["halving"], at, reduction), dict(curves), 0
            for r in at:  # one wave: each rung decided over the survivors of the last
                pending = {t: [r] for t in live}
                stop = rule.decide(live, [], pending)
                spent += sum(next(step for step, _ in live[t] if step >= r) for t in stop)  # stopped at the rung
                live = {t: c for t, c in live.items() if t not in stop}
            spent += rounds * len(live)
            top = max(c[-1][1] for c in live.values())
            found[f"eta{reduction}-rungs{rungs}"] = {
                "rungs": at,
                "best_val": round(top, 3),
                "gap_points": round(best - top, 3),
                "model_round_ratio": round(spent / (rounds * len(curves)), 3),
                "completed": len(live),
            }
    return {"grid_best_val": round(best, 3), "curves_folder": full["run_folder"], "schedules": found}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", help="the demo cache (default: extracted into --work)")
    ap.add_argument("--skewed", help="a label-skewed cache (default: extracted into --work)")
    ap.add_argument("--work", default="cache", help="where missing caches are extracted")
    ap.add_argument("--backbone", action="append", help="backbones of the extracted caches (default: the demo's 3)")
    ap.add_argument("--out", help="keep the run folders here (default: a temporary folder, removed)")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds every configuration trains")
    ap.add_argument("--trials", type=int, default=16, help="TPE and random search's trial budget")
    ap.add_argument("--schedules", action="store_true", help="also the unpruned curves and each schedule on them")
    ap.add_argument("--case", action="append", choices=["demo", "label_skew"], help="run only this case (repeat)")
    args = ap.parse_args()
    backbones = args.backbone or ["efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2"]
    demo, skewed = (args.demo, args.skewed) if args.demo and args.skewed else demo_caches(Path(args.work), backbones)
    seeds = [int(s) for s in args.seeds.split(",")]
    load = {"before": round(os.getloadavg()[0], 2)}
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(args.out or tmp)
        for name, cache in [c for c in (("demo", demo), ("label_skew", skewed)) if c[0] in (args.case or c)]:
            cases[name] = case(cache, args.rounds, seeds, args.trials, runs / name)
            if args.schedules:
                cases[name]["schedules"] = schedules(cache, args.rounds, seeds, runs / name)
    load["after"] = round(os.getloadavg()[0], 2)
    print(
        json.dumps(
            {
                "algo": "fedavg",
                "rounds": args.rounds,
                "seeds": seeds,
                "configs": len(LRS) * len(WDS),
                "targets": TARGETS,
                "load_1min": load,
                "cpus": os.cpu_count(),
                "torch_threads": __import__("torch").get_num_threads(),
                "cases": cases,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
