"""Benchmark: the cross-device regime. FedAvg, FedPCL and FedProx (FedAvg's server, w^t from the context) at C = 100,
1,000 and 10,000 small clients (one 1280-d backbone, 20 train and 10 test rows per client, 10 classes, batch 10) at
participation 1.0 and 0.1 (and 0.01 at 10,000): seconds per round, evaluation seconds, peak RSS, the memory estimate
made before the run (featcache.training.footprint) and its ratio to the peak, and each p < 1 round's time over the
p = 1.0 round of the same C. Plus a FedAvg round on a cache shaped like the demo's (4 clients, 3,840-d, 10 classes,
100 train and 500 test rows each, evaluated every round): its time over the time of the same matrix products alone
(replayed on their recorded shapes, interleaved with the rounds), and its FLOPs split into training and evaluation.
Prints one JSON object. Run: `.venv/bin/python bench/scale.py [--quick] [--algos fedprox] [--no-extras]`.

Each case runs in a fresh process (`--case`) that builds its clients in memory (as a loaded cache holds them) and
reports its own VmHWM: the peak RSS of that exec alone, data and interpreter included. Rounds: one warm-up round,
then the median of the rest; evaluation only after the last round (eval_every = rounds), timed as the run's wall
time minus its rounds. Each case carries two estimates: `estimate_bytes` with P = max(1, round(p·C)) models training
per round, `estimate_every_client_trains_bytes` with all C (an engine that trains every client and masks the
update). A case whose estimate (`--skip-by participants`, or `every-client` for such an engine) exceeds the available
memory (or --max-gb) is skipped and says so. A p = 1.0 case estimated above --budget-gb (default 3) runs again
with its participants trained in slices that fit the budget (`at_once`, the engine's; the same results). The
scaling targets (`TARGETS`) are printed beside the figures as pass/fail, not asserted. `--quick` runs C = 10 and 30
only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import featcache.cli  # noqa: F401  (the CLI's thread setting, as `featcache` runs)
import torch

from featcache.algorithms import create
from featcache.cache import ClientData
from featcache.errors import UserError
from featcache.memory import available_bytes, keep_freed_memory
from featcache.training.config import resolve
from featcache.training.engine import Engine
from featcache.training.evaluate import record
from featcache.training.footprint import estimate, fit_at_once
from featcache.testing import synthetic_clients

keep_freed_memory()  # the training commands' allocator setting, as `featcache train` runs

D, K, N_TRAIN, N_TEST, BATCH = 1280, 10, 20, 10, 10
MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::baddbmm", "aten::addbmm")
ALGOS = ("fedavg", "fedpcl", "fedprox")
TARGETS = {
    "round_ratio_p0.1_C1000": 0.15,
    "fedprox_round_ratio_p0.1_C1000": 0.2,  # FedAvg's server with the proximal term's w^t in every step's context
    "peak_gib_C1000": 3.0,
    "demo_round_over_matmul": 1.6,
}


def config(algo, C: int, p: float, rounds: int, eval_every: int | None = None) -> dict:
    return resolve(
        algo, {"rounds": rounds, "eval_every": eval_every or rounds, "participation": p, "batch_size": BATCH}
    )


def vm(field: str) -> int:
    """Bytes of a /proc/self/status field (VmHWM: the peak RSS of this exec alone)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def run_case(
    name: str,
    C: int,
    p: float,
    rounds: int,
    at_once: int | None = None,
    eval_every: int | None = None,
    reuse: bool = True,
) -> dict:
    """One case in this (fresh) process: seconds per round, evaluation seconds (all evaluations, and per
    evaluation), peak RSS. `reuse=False` scores every client at every evaluation even where predict is personal."""
    torch.set_num_threads(torch.get_num_threads())
    base = vm("VmRSS")
    train = synthetic_clients(C=C, n=(N_TRAIN, N_TRAIN), D=D, K=K, seed=0)
    test = synthetic_clients(C=C, n=(N_TEST, N_TEST), D=D, K=K, seed=1)
    algo = create(name)
    if not reuse:
        type(algo).personal_predict = False
    t0 = time.perf_counter()
    raw = Engine(algo, [config(algo, C, p, rounds, eval_every)], train, test, at_once=at_once).run()
    wall = time.perf_counter() - t0
    times, evals = raw["round_seconds"], len(raw["eval_rounds"])
    return {
        "round_seconds": [round(t, 4) for t in times],
        "seconds_per_round": round(statistics.median(times[1:]), 4),
        "eval_seconds": round(wall - sum(times), 4),
        "seconds_per_evaluation": round((wall - sum(times)) / evals, 4),
        "peak_rss_bytes": vm("VmHWM"),
        "process_bytes": base,
    }


def fresh_case(spec: str, rounds: int) -> dict:
    """`run_case` for `spec` (algo:C:p:at_once[:eval_every:reuse]) in a fresh process: its figures, or {"failed":
    [its last line of stderr]}."""
    done = subprocess.run(
        [sys.executable, __file__, "--case", spec, "--rounds", str(rounds)], capture_output=True, text=True
    )
    return {"failed": done.stderr.strip().splitlines()[-1:]} if done.returncode else json.loads(done.stdout)


def evaluation_cases(C: int, rounds: int) -> list[dict]:
    """FedPCL (personal predict) at participation 0.1, evaluated every round: the evaluation's seconds when the
    clients that did not train keep their figures over those when every client is scored again, each in a fresh
    process."""
    out = {reuse: fresh_case(f"fedpcl:{C}:0.1:0:1:{int(reuse)}", rounds) for reuse in (True, False)}
    case = {
        "algo": "fedpcl",
        "clients": C,
        "participation": 0.1,
        "eval_every": 1,
        "reused": out[True],
        "every_client": out[False],
    }
    if "seconds_per_evaluation" in out[True] and "seconds_per_evaluation" in out[False]:
        case["evaluation_reused_over_every_client"] = round(
            out[True]["seconds_per_evaluation"] / out[False]["seconds_per_evaluation"], 3
        )
    print(json.dumps({k: v for k, v in case.items() if k not in ("reused", "every_client")}), file=sys.stderr)
    return [case]


def shapes(C: int, n: int) -> ClientData:
    """Meta tensors shaped like the case's clients, with their row counts: the estimate reads nothing else."""
    meta = lambda *s, dtype=torch.float32: torch.empty(s, dtype=dtype, device="meta")
    return ClientData(meta(C, n, D), meta(C, n, dtype=torch.int64), torch.full((C,), n), K)


def scale_cases(
    clients: list[int],
    rounds: int,
    limit: int,
    process: int,
    every_client: bool,
    budget: int,
    algos: tuple[str, ...] = ALGOS,
) -> list[dict]:
    """Every (algorithm of `algos`, C, p) case, each in a fresh process unless its estimate exceeds `limit` bytes (with
    `every_client` the estimate with all C clients training); `process`: the RSS of an interpreter with these
    imports (this one's, before any work), added to each estimate. A p = 1.0 case estimated above `budget` bytes
    runs again with its participants in slices that fit it (`at_once`, footprint.fit_at_once)."""
    out = []
    for C in clients:
        for name in algos:
            algo = create(name)
            full = None
            train, test = shapes(C, N_TRAIN), shapes(C, N_TEST)
            runs = [(p, None) for p in (1.0, 0.1) + ((0.01,) if C >= 10_000 else ())]
            every = config(algo, C, 1.0, rounds)
            try:
                at_once = fit_at_once(
                    algo,
                    every,
                    1,
                    train,
                    torch.device("cpu"),
                    avail=budget - process - estimate(algo, every, train, test).data,
                )
            except UserError:  # the clients' state alone exceeds the budget
                at_once = None
            if at_once:
                runs.insert(1, (1.0, at_once))
            for p, at_once in runs:
                cfg = config(algo, C, p, rounds)
                est = estimate(algo, cfg, train, test, at_once=at_once)
                est_all = estimate(algo, cfg, train, test, P=C)
                need, need_all = process + est.total(), process + est_all.total()
                case = {
                    "algo": name,
                    "clients": C,
                    "participation": p,
                    "participants": est.participants,
                    "at_once": at_once or est.participants,
                    "estimate_bytes": need,
                    "estimate_every_client_trains_bytes": need_all,
                    "estimate_parts": {
                        "process": process,
                        "state": est.state,
                        "training": est.training,
                        "uploads": est.uploads,
                        "evaluation": est.evaluation,
                        "data": est.data,
                    },
                }
                judged = need_all if every_client else need
                if judged > limit:
                    case["skipped"] = f"estimate {judged / 2**30:.1f} GiB exceeds the {limit / 2**30:.1f} GiB available"
                else:
                    case |= fresh_case(f"{name}:{C}:{p}:{at_once or 0}", rounds)
                    if "failed" not in case:
                        peak = case["peak_rss_bytes"]
                        case["estimate_over_peak"] = round(need / peak, 3)
                        case["estimate_every_client_trains_over_peak"] = round(need_all / peak, 3)
                if p == 1.0 and at_once is None:
                    full = case
                elif full and "seconds_per_round" in case and "seconds_per_round" in full:
                    case["round_over_full_participation"] = round(
                        case["seconds_per_round"] / full["seconds_per_round"], 3
                    )
                print(json.dumps({k: v for k, v in case.items() if k != "estimate_parts"}), file=sys.stderr)
                out.append(case)
    return out


def products(events, rounds: int):
    """The round's matrix products alone: every leaf product op the profiler saw (grouped by input shapes), called
    as often per round on contiguous random tensors of those shapes."""
    calls = []
    for e in events:
        if e.key in MATMULS and e.key != "aten::matmul":  # matmul dispatches to the others
            op = getattr(torch, e.key.split("::")[1])
            args = [torch.randn(s) for s in e.input_shapes if s][:3]
            calls.append((op, args, max(1, e.count // rounds)))
    return lambda: [op(*args) for op, args, n in calls for _ in range(n)]


def demo_round(rounds: int, repeats: int = 3) -> dict:
    """FedAvg on the demo's shape, evaluated every round: round time (training + evaluation) over the time of the
    same matrix products alone (shapes recorded by torch.profiler, replayed on contiguous tensors), timed
    interleaved `repeats` times in this process (medians), and FLOPs per round."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    train = synthetic_clients(C=4, n=(100, 100), D=3840, K=10, seed=0)
    test = synthetic_clients(C=4, n=(500, 500), D=3840, K=10, seed=1)
    algo = create("fedavg")
    cfg = resolve(algo, {"rounds": rounds, "eval_every": 1})
    Engine(algo, [cfg], train, test).run()  # warm-up
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        Engine(algo, [cfg], train, test).run()
    events = prof.key_averages(group_by_input_shape=True)
    ops = sum(e.count for e in events if e.key.startswith("aten::")) // rounds
    replay = products(events, rounds)
    replay()  # warm-up
    round_s, mm_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        Engine(algo, [cfg], train, test).run()
        round_s.append((time.perf_counter() - t0) / rounds)
        t0 = time.perf_counter()
        replay()
        mm_s.append(time.perf_counter() - t0)
    per_round, mm = statistics.median(round_s), statistics.median(mm_s)
    one = resolve(algo, {"rounds": 1})
    engine = Engine(algo, [one], train, test)
    with FlopCounterMode(display=False) as total:
        raw = engine.run()
    with FlopCounterMode(display=False) as evaluation:
        record(engine.algo, engine.state, engine.train, engine.test, engine.last_round, raw["train_loss"][0])
    flops, ev = total.get_total_flops(), evaluation.get_total_flops()
    ratio = per_round / mm
    return {
        "clients": 4,
        "feature_dim": 3840,
        "rounds": rounds,
        "seconds_per_round": round(per_round, 4),
        "matmul_seconds_per_round": round(mm, 4),
        "round_over_matmul": round(ratio, 2),
        "round_over_matmul_each": [round(r / m, 2) for r, m in zip(round_s, mm_s)],
        "target_round_over_matmul": TARGETS["demo_round_over_matmul"],
        "pass_round_over_matmul": ratio <= TARGETS["demo_round_over_matmul"],
        "aten_ops_per_round": ops,
        "gflop_per_round": round(flops / 1e9, 3),
        "gflop_training": round((flops - ev) / 1e9, 3),
        "gflop_evaluation": round(ev / 1e9, 3),
    }


def verdicts(cases: list[dict]) -> dict:
    """The `TARGETS` beside the figures: pass, fail, or None where the case did not run."""
    at = {(c["algo"], c["clients"], c["participation"]): c for c in cases if c["at_once"] == c["participants"]}
    sliced = {(c["algo"], c["clients"]): c for c in cases if c["at_once"] < c["participants"]}
    out = {}
    for name in sorted({c["algo"] for c in cases}, key=ALGOS.index):
        c = at.get((name, 1000, 0.1), {})
        r = c.get("round_over_full_participation")
        target = TARGETS.get(f"{name}_round_ratio_p0.1_C1000", TARGETS["round_ratio_p0.1_C1000"])
        out[f"{name}_round_ratio_p0.1_C1000"] = {
            "value": r,
            "target": target,
            "pass": None if r is None else r <= target,
        }
        for label, c in (
            ("p1.0_sliced", sliced.get((name, 1000), {})),
            ("p1.0", at.get((name, 1000, 1.0), {})),
            ("p0.1", at.get((name, 1000, 0.1), {})),
        ):
            peak = round(c["peak_rss_bytes"] / 2**30, 2) if "peak_rss_bytes" in c else None
            out[f"{name}_peak_gib_C1000_{label}"] = {
                "value": peak,
                "target": TARGETS["peak_gib_C1000"],
                "pass": None if peak is None else peak <= TARGETS["peak_gib_C1000"],
            }
        c = at.get((name, 10_000, 0.01), {})
        out[f"{name}_runs_C10000_p0.01"] = {"pass": "seconds_per_round" in c if c else None}
    ratios = [c["estimate_over_peak"] for c in cases if "estimate_over_peak" in c]
    out["estimate_within_25pct"] = {
        "values": ratios,
        "pass": all(0.75 <= r <= 1.25 for r in ratios) if ratios else None,
    }
    ratios = [c["estimate_every_client_trains_over_peak"] for c in cases if "estimate_over_peak" in c]
    out["estimate_every_client_trains_within_25pct"] = {
        "values": ratios,
        "pass": all(0.75 <= r <= 1.25 for r in ratios) if ratios else None,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="C = 10 and 30 only, 3 rounds, 2 demo rounds")
    ap.add_argument("--clients", default="100,1000,10000")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per case: one warm-up, the median of the rest")
    ap.add_argument("--max-gb", type=float, default=None, help="skip cases estimated above this (default: available)")
    ap.add_argument(
        "--budget-gb",
        type=float,
        default=TARGETS["peak_gib_C1000"],
        help="run p = 1.0 cases estimated above this again in slices that fit it",
    )
    ap.add_argument(
        "--skip-by",
        choices=("participants", "every-client"),
        default="participants",
        help="judge a case by the estimate with P participants training, or with all C clients",
    )
    ap.add_argument("--algos", default=",".join(ALGOS), help="the algorithms of the scale cases")
    ap.add_argument("--no-extras", action="store_true", help="the scale cases only: no evaluation or demo figures")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # algo:C:p:at_once[:eval_every:reuse]
    args = ap.parse_args()
    process = vm("VmRSS")  # an interpreter with the imports a case runs with, before any work
    if args.case:
        name, C, p, at_once, *evaluation = args.case.split(":")
        eval_every, reuse = (int(evaluation[0]), bool(int(evaluation[1]))) if evaluation else (None, True)
        print(json.dumps(run_case(name, int(C), float(p), args.rounds, int(at_once) or None, eval_every, reuse)))
        return
    clients = [10, 30] if args.quick else [int(c) for c in args.clients.split(",")]
    rounds = 3 if args.quick else args.rounds
    avail = available_bytes(torch.device("cpu"))
    limit = min(avail, int(args.max_gb * 2**30)) if args.max_gb else avail
    load = [os.getloadavg()[0]]
    algos = tuple(a for a in args.algos.split(",") if a)
    if not set(algos) <= set(ALGOS):
        sys.exit(f"--algos: choose from {', '.join(ALGOS)}")
    budget = int(args.budget_gb * 2**30)
    cases = scale_cases(clients, rounds, limit, process, args.skip_by == "every-client", budget, algos)
    evaluation = [] if args.no_extras else evaluation_cases(1000 if 1000 in clients else max(clients), rounds)
    demo = None if args.no_extras else demo_round(2 if args.quick else 5)
    load.append(os.getloadavg()[0])
    print(
        json.dumps(
            {
                "feature_dim": D,
                "classes": K,
                "train_rows": N_TRAIN,
                "test_rows": N_TEST,
                "batch_size": BATCH,
                "rounds": rounds,
                "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "available_gb": round(avail / 2**30, 1),
                "limit_gb": round(limit / 2**30, 1),
                "load_1min": load,
                "process_gb": round(process / 2**30, 2),
                "cases": cases,
                "evaluation": evaluation,
                "demo": demo,
                "targets": verdicts(cases),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
