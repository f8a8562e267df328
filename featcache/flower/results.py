"""A Flower run's result files, `featcache train`'s own (`runs.train.write_result`), so `featcache report` reads a
Flower run beside a simulated one. The body adds `runtime` = "flower" and the bytes Flower's messages carried per round
(`wire`), so a Flower run's file never takes a simulated run's name."""

from __future__ import annotations

from ..atomic import check_folder
from ..provenance import library_call
from ..runs.train import write_result as write


def write_result(out, algo, cfg: dict, meta: dict, raw: dict, wire: dict) -> str:
    """Write NAME.json and its sidecars into `out` from `run_server`'s output; returns the result path."""
    check_folder(out)
    seed, rounds = int(cfg["seed"]), max(len(raw["round_seconds"]), 1)
    sent = {k: round(sum(v) / rounds) for k, v in sorted(wire.items()) if k.split()[0] in ("train", "evaluate")}
    call = library_call("featcache.flower.server_app", algo=algo.name, seed=seed)
    extra = {"runtime": "flower", "wire": sent}
    return write(out, algo, cfg, [seed], meta, raw, "cpu", call, extra=extra)[2]["result_file"]
