"""A Flower run's result files, in `featcache train`'s format (runs/train.py): the result JSON and its metrics CSV,
so `featcache report` reads a Flower run beside a simulated one. The body adds `runtime` = "flower" and the bytes
Flower's messages carried per round (`wire`), so a Flower run's file never takes a simulated run's name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


from ..atomic import check_folder, write_together
from ..provenance import library_call, provenance
from ..runs.metrics import metrics_csv, summarize
from ..runs.names import run_name


def write_result(out, algo, cfg: dict, meta: dict, raw: dict, wire: dict) -> str:
    """Write NAME.json and NAME.metrics.csv into `out` from `run_server`'s raw figures; returns the result path."""
    out = Path(out)
    check_folder(out)
    seeds = [int(cfg["seed"])]
    config = {k: v for k, v in cfg.items() if k != "seed"}
    floats = max(raw["upload_floats"])  # a round's most: FedDBE's first round uploads its means only
    glob = raw["global_acc"]
    rounds = len(raw["round_seconds"])
    result = {
        "algo": algo.name,
        "paper": algo.paper,
        "uploads": algo.uploads,
        "config": config,
        "seeds": seeds,
        "cache": {"key": meta.get("key"), "dataset": meta.get("dataset"), "backbones": meta.get("backbones")},
        "backbones": list(meta.get("backbones") or []),
        "clients": int(raw["clients"]),
        "params_uploaded_per_round": int(floats),
        "bytes_uploaded_per_round": int(floats) * 4,
        "runtime": "flower",
        "wire": {
            k: round(sum(v) / max(rounds, 1)) for k, v in sorted(wire.items()) if k.split()[0] in ("train", "evaluate")
        },
    } | summarize(
        raw["acc"].numpy(), raw["eval_rounds"], None if glob is None else glob.numpy(), raw["train_loss"].numpy()
    )
    run_id = hashlib.sha256(json.dumps(result, sort_keys=True, indent=1).encode()).hexdigest()[:12]
    result["cache"]["partition"] = meta.get("partition")
    result["provenance"] = provenance("cpu", library_call("featcache.flower.server_app", algo=algo.name, seed=seeds[0]))
    path = out / f"{run_name(algo, config, seeds, None, run_id, meta.get('partition'))}.json"
    write_together(
        [
            (path.with_suffix(".metrics.csv"), metrics_csv(raw, seeds)),
            (path, json.dumps(result, sort_keys=True, indent=1)),
        ]
    )
    return str(path)
