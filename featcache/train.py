"""`featcache train`: run one federated algorithm on a cache for several seeds in one batched engine run.

Seeds share the configuration axis H of the engine, so three seeds cost one vectorized run. The result file holds the
fully resolved config, the cache it came from, accuracies (final and best-round, named plainly), fairness and
communication; it is a pure function of (cache, algorithm, config, seeds), so the same seed gives the same file.
Wall-clock timings, and the device they were taken on, go to the printed summary and a `.timing.json`
sidecar, never into the result file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import torch

from . import cache as C
from .algorithms import create
from .atomic import write_atomic
from .config import resolve
from .devices import resolve_device
from .engine import Engine
from .errors import UserError
from .metrics import summarize


def load_split(path, algo, holdout: str = "none", split: str = "train") -> C.ClientData:
    """Train (or validation) clients with cached views when the algorithm uses them."""
    return C.load_clients(path, split, views=getattr(algo, "uses_views", False), holdout=holdout)


def run_configs(algo, cfgs: list[dict], train: C.ClientData, test: C.ClientData,
                device: str | torch.device = "cpu", progress=None) -> dict:
    """Train H configurations batched; returns the engine's raw output (acc [R_eval, H, C], uploads, timings)."""
    return Engine(algo, cfgs, train, test, device=device).run(progress)


def train(cache: str | Path, algo: str, rounds: int | None = None, seeds: list[int] = (0, 1, 2),
          set: list[str] | dict | None = None, out: str | Path = "runs", device: str | torch.device = "auto",
          progress=None) -> dict:
    """Train `algo` on `cache` for each seed on `device` (auto | cpu | cuda[:N]); write the result JSON; return the
    result with timings and the device it ran on (the result file does not record it)."""
    dev = resolve_device(device)
    if not seeds:
        raise UserError("--seeds needs at least one seed, e.g. --seeds 0,1,2")
    impl = create(algo)
    overrides = dict(set) if isinstance(set, dict) else list(set or [])
    if rounds is not None:
        overrides = overrides | {"rounds": rounds} if isinstance(overrides, dict) else overrides + [f"rounds={rounds}"]
    cfg = resolve(impl, overrides)
    train_data = load_split(cache, impl)
    test_data = C.load_clients(cache, "test")
    raw = run_configs(impl, [cfg | {"seed": int(s)} for s in seeds], train_data, test_data, dev, progress)
    with h5py.File(cache, "r") as f:
        meta = C.read_attrs(f)
    floats = raw["upload_floats"][0]
    result = {
        "algo": algo,
        "paper": impl.paper,
        "uploads": impl.uploads,
        "config": {k: v for k, v in cfg.items() if k != "seed"},
        "seeds": [int(s) for s in seeds],
        "cache": {"key": meta["key"], "dataset": meta["dataset"], "backbones": meta["backbones"]},
        "clients": int(train_data.features.shape[0]),
        "params_uploaded_per_round": int(floats),
        "bytes_uploaded_per_round": int(floats) * 4,
    } | summarize(raw["acc"].numpy(), raw["eval_rounds"])
    body = json.dumps(result, sort_keys=True, indent=1)
    run_id = hashlib.sha256(body.encode()).hexdigest()[:12]
    path = Path(out) / f"{algo}-{run_id}.json"
    write_atomic(path, body)
    timing = {"seconds_per_round": round(float(np.mean(raw["round_seconds"])), 5),
              "seconds_total": round(float(np.sum(raw["round_seconds"])), 3), "device": str(dev)}
    write_atomic(path.with_suffix(".timing.json"), json.dumps(timing))
    return result | timing | {"result_file": str(path), "cache_path": str(cache)}


