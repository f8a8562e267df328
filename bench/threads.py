"""Benchmark: featcache's thread policy (featcache/threads.py) with the machine as it is and with one core kept busy
by another process. Seconds per FedAvg round on a cache shaped like the demo's (4 clients, 3,840-d features, 10
classes, 100 train and 500 test rows each, evaluated every round) for three contenders, each a long-lived child
process timed in interleaved turns (the order rotating every repeat, so a noisy neighbour slows all alike):

- `one_thread`: torch on one thread;
- `openmp_default`: torch's default thread count, OpenMP's default waiting (a torch script as users write it);
- `policy`: what `featcache train` runs: torch's default thread count, started with `featcache.threads.WAIT`.

Phases: `as_is` (the machine as it is: its load is printed, on a shared machine it is not idle), then `one_core_busy`
(a busy-loop process added). Each child warms up with one run, then every turn times a run of `--rounds` rounds.
Each turn also times one op alone (`OP_SIZE` floats added, `OPS` times: what a parallel op costs beyond its
arithmetic, a spin or a wake). Prints one JSON object: each contender's seconds per round (all turns and the median)
and microseconds per op, the ratios side by side, the 1-minute load before and after each phase, and the targets as
pass/fail (not asserted): with one core busy the policy within 1.2x of one thread; as is, the policy no slower than
OpenMP's default (within 5 %, the noise of a shared machine).
Run: `.venv/bin/python bench/threads.py [--repeats 5] [--rounds 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

OP_SIZE, OPS = 65536, 5000  # the op timed alone: an add just above torch's grain for a parallel elementwise op
TARGETS = {"busy_policy_over_one_thread": 1.2, "as_is_policy_over_openmp_default": 1.05}


def contenders() -> dict[str, tuple[dict, int | None]]:
    """name -> (environment added to the child's, torch threads it sets: None keeps torch's default)."""
    from featcache.threads import WAIT

    return {"one_thread": ({}, 1), "openmp_default": ({}, None), "policy": (dict(WAIT), None)}


def child(threads: int | None, rounds: int) -> None:
    """One contender: build the demo-shaped clients, warm up, then answer each line on stdin with one timed run's
    seconds per round (JSON) on stdout."""
    from featcache.memory import keep_freed_memory

    keep_freed_memory()  # the `featcache` command's allocator setting (importing featcache.cli would set WAIT too)
    import torch

    from featcache.algorithms import create
    from featcache.testing import synthetic_clients
    from featcache.training.config import resolve
    from featcache.training.engine import Engine

    if threads is not None:
        torch.set_num_threads(threads)
    train = synthetic_clients(C=4, n=(100, 100), D=3840, K=10, seed=0)
    test = synthetic_clients(C=4, n=(500, 500), D=3840, K=10, seed=1)
    algo = create("fedavg")
    cfg = resolve(algo, {"rounds": rounds, "eval_every": 1})
    Engine(algo, [cfg], train, test).run(logs=False)  # warm-up
    x, y = torch.randn(OP_SIZE), torch.randn(OP_SIZE)
    print(json.dumps({"threads": torch.get_num_threads(), "wait": os.environ.get("OMP_WAIT_POLICY")}), flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        if line.strip() == "op":
            for _ in range(OPS):
                torch.add(x, y)
            print(json.dumps((time.perf_counter() - t0) / OPS * 1e6), flush=True)
        else:
            Engine(algo, [cfg], train, test).run(logs=False)
            print(json.dumps((time.perf_counter() - t0) / rounds), flush=True)


def ask(proc: subprocess.Popen, what: str) -> float:
    proc.stdin.write(what + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def phase(procs: dict[str, subprocess.Popen], repeats: int) -> dict:
    """Interleaved turns of every contender: seconds per round (each turn and the median), microseconds per op
    alone (medians), load before and after."""
    load = [os.getloadavg()[0]]
    runs, ops = {name: [] for name in procs}, {name: [] for name in procs}
    names = list(procs)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(ask(procs[name], "round"))
            ops[name].append(ask(procs[name], "op"))
    load.append(os.getloadavg()[0])
    median = {name: statistics.median(t) for name, t in runs.items()}
    return {
        "seconds_per_round": {k: round(v, 4) for k, v in median.items()},
        "microseconds_per_op": {k: round(statistics.median(v), 1) for k, v in ops.items()},
        "all_seconds_per_round": {k: [round(t, 4) for t in v] for k, v in runs.items()},
        "policy_over_one_thread": round(median["policy"] / median["one_thread"], 3),
        "openmp_default_over_one_thread": round(median["openmp_default"] / median["one_thread"], 3),
        "policy_over_openmp_default": round(median["policy"] / median["openmp_default"], 3),
        "load_1min": [round(x, 2) for x in load],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.threads, args.rounds)
    procs, told = {}, {}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    for name, (env, threads) in contenders().items():
        argv = [sys.executable, __file__, "--child", "--rounds", str(args.rounds)]
        argv += ["--threads", str(threads)] if threads is not None else []
        procs[name] = subprocess.Popen(argv, env=base | env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for name, p in procs.items():
        told[name] = json.loads(p.stdout.readline())
    report = {"cores": os.cpu_count(), "rounds": args.rounds, "repeats": args.repeats, "contenders": told}
    try:
        report["as_is"] = phase(procs, args.repeats)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(1)  # the busy loop is running before the first turn
            report["one_core_busy"] = phase(procs, args.repeats)
        finally:
            busy.kill()
            busy.wait()
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait()
    busy_ratio = report["one_core_busy"]["policy_over_one_thread"]
    idle_ratio = report["as_is"]["policy_over_openmp_default"]
    report |= {
        "targets": TARGETS,
        "pass_busy_policy_over_one_thread": busy_ratio <= TARGETS["busy_policy_over_one_thread"],
        "pass_as_is_policy_over_openmp_default": idle_ratio <= TARGETS["as_is_policy_over_openmp_default"],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
