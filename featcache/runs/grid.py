"""`featcache grid`: a hyperparameter grid trained as batched runs, validation-selected, then retrained.

Protocol of the papers (Tan et al., FedPCL, NeurIPS 2022, App. A.1.4): train every configuration on
train-minus-validation (the 20 % held out at extraction), score it by mean client accuracy on the validation rows,
retrain the best on the full train split and report test accuracy mean(std) over seeds
(std: the sample std over seeds, ddof=1; 0 with one seed).

Continuous hyperparameters (lr, weight decay, τ, μ, ...) become per-model tensors on the engine's configuration axis,
so H configurations x seeds x C clients train in the same vectorized steps; structural ones (widths, prompt counts,
option strings) split the grid into buckets. Buckets are cut into chunks sized to the memory budget; each finished
chunk is written atomically to the run folder, so an interrupted grid resumes at the first unfinished chunk, in the
chunking it started with (`chunked_before`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
from pathlib import Path

import numpy as np
import torch

from ..algorithms import create
from ..atomic import check_folder, make_folder, missing_folders, remove_empty, write_atomic, write_together
from ..cache import load_clients
from ..cluster import ray_module
from ..devices import resolve_device
from ..errors import UserError, as_list
from ..memory import available_bytes
from .metrics import mean_std
from ..provenance import library_call, provenance
from ..threads import threaded
from ..training.config import check, check_clients, check_seeds, merge_rounds, parse_value, resolve, scoped
from ..training.engine import structural_keys
from ..training.guards import NO_TEST_ROWS, NO_VAL_ROWS, check_features, check_split
from ..training.footprint import check_memory
from .train import load_split, run_configs, train

BACKENDS = {}


def parse_grid(algo, grid: list[str]) -> dict[str, list]:
    """['lr=1e-1,1e-2', 'weight_decay=1e-3,1e-4'] -> {'lr': [0.1, 0.01], 'weight_decay': [...]} (typed, strict:
    every value of every axis is checked against its setting's range; an axis or a value given twice is refused)."""
    defaults = resolve(algo)
    axes = {}
    for item in grid:
        key, sep, values = item.partition("=")
        key = next(iter(scoped({key.strip(): ""}, [algo], "--grid")[algo.name]))  # fedprox.mu -> mu, for fedprox only
        if not sep or not values.strip():
            raise UserError(f"--grid {item!r}: write key=v1,v2,..., e.g. --grid lr=1e-1,1e-2")
        if key in axes:
            raise UserError(f"--grid {key} is given twice: put all its values in one axis, e.g. --grid {key}=a,b")
        texts = [v.strip() for v in values.split(",")]
        if "" in texts:
            raise UserError(f"--grid {item!r} has an empty value: write key=v1,v2,...")
        for v in texts:
            resolve(algo, {key: v})  # unknown key, bad type, out of range -> one-line error naming the value
        axes[key] = [parse_value(key, v, defaults[key]) for v in texts]
        twice = [v for i, v in enumerate(axes[key]) if v in axes[key][:i]]
        if twice:
            raise UserError(f"--grid {key} lists {twice[0]!r} twice: each value once")
    if not axes:
        raise UserError("no --grid axis given: e.g. --grid lr=1e-1,1e-2,1e-3")
    return axes


def plan_chunk(n_models: int, per_model_bytes: int, budget_bytes: int) -> int:
    """How many configurations x seeds fit in one batched run."""
    return max(1, min(n_models, budget_bytes // max(per_model_bytes, 1)))


# A grid chunk plans for 1/N of the available memory: the rest is headroom for the loaded data, evaluation and the
# per-model estimate's error.
BUDGET_DIVISOR = {"cuda": 2, "cpu": 4}


def memory_budget(device: torch.device) -> int:
    """The memory one chunk of a grid may plan for: 1/BUDGET_DIVISOR of the device's available memory."""
    return available_bytes(device) // BUDGET_DIVISOR["cuda" if device.type == "cuda" else "cpu"]


def chunk_file(folder: Path, cfgs: list[dict], part: list) -> Path:
    """The file of the chunk training the models `part` ((config index, seed) pairs): named by what it trains, so
    any chunking resumes safely."""
    digest = hashlib.sha256(json.dumps([cfgs[i] | {"seed": int(s)} for i, s in part], sort_keys=True).encode())
    return folder / f"chunk-{digest.hexdigest()[:16]}.json"


def chunked_before(folder: Path, cfgs: list[dict], models: list) -> int | None:
    """The chunk size an interrupted run of this grid trained the bucket `models` with (its first chunk is in
    `folder`), or None: a resumed grid keeps its chunking, which its result records, whatever memory the plan
    would find now."""
    for path in folder.glob("chunk-*.json"):
        try:
            done = [tuple(m) for m in json.loads(path.read_text())["models"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if done and done == models[: len(done)] and chunk_file(folder, cfgs, done) == path:
            return len(done)
    return None


def _bucket_key(cfg: dict, algo) -> str:
    return json.dumps({k: cfg[k] for k in structural_keys(cfg, algo)}, sort_keys=True)


def _write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, sort_keys=True, indent=1))


def _split_data(cache: str, algo, backbones=None) -> tuple:
    """The chunk's training rows (train minus validation) and its validation rows."""
    return (
        load_split(cache, algo, holdout="fit", backbones=backbones),
        load_clients(cache, "train", holdout="val", backbones=backbones),
    )


def _run_chunk(
    cache: str,
    algo_name: str,
    cfgs: list[dict],
    device: str | torch.device,
    backbones=None,
    progress=None,
    data: tuple | None = None,
) -> list[list[float]]:
    """Train a chunk on train-minus-validation and score on validation: per model, per-client final accuracy.
    `progress(round, rounds, live)` is called after each round (Engine.run); `data` = (fit, val) when the caller already
    loaded them."""
    algo = create(algo_name)
    fit, val = data or _split_data(cache, algo, backbones)
    acc = run_configs(algo, cfgs, fit, val, device, progress, logs=False)["acc"][-1]  # [H, C]
    return (100 * acc).tolist()


def _local_backend(jobs, progress):
    """In-process, one chunk after another, on data read once; progress is reported per round (in rounds of all
    chunks to train)."""
    total = sum(job["rounds"] for job in jobs)
    done, data = 0, None
    for job in jobs:
        tick = None
        if progress:
            tick = lambda r, R, _, base=done, n=job["rounds"]: progress("grid rounds", base + round(r * n / R), total)
        cache, algo_name, _, _, backbones = job["args"]
        data = data or _split_data(cache, create(algo_name), backbones)
        yield job, _run_chunk(*job["args"], tick, data)
        done += job["rounds"]


BACKENDS["local"] = _local_backend


def _ray_backend(jobs, progress):
    """Chunks as Ray tasks on the cluster of `cluster.ray_module`."""
    ray = ray_module()
    remote = ray.remote(_run_chunk)
    pending = {remote.remote(*job["args"]): job for job in jobs}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        job = pending.pop(done[0])
        yield job, ray.get(done[0])


BACKENDS["ray"] = _ray_backend


@threaded
def grid(
    cache: str | Path,
    algo: str,
    grid: list[str],
    seeds: list[int] = (0, 1, 2),
    rounds: int | None = None,
    set: list[str] | None = None,
    backbones: list[str] | None = None,
    out: str | Path = "runs",
    device: str | torch.device = "auto",
    backend: str = "local",
    chunk: int | None = None,
    retrain: bool = True,
    progress=None,
    threads: int | None = None,
) -> dict:
    """Select on validation, retrain the best on full train, report test mean(std). Resumable by run folder.

    `backbones` trains on a subset of the cached backbones' features (default: all, concatenated).

    `device` (auto | cpu | cuda[:N]) is checked here and sizes the chunks; each chunk resolves it again where it runs,
    so with the Ray backend `auto` picks each worker's GPU when it has one. `threads` runs it on that many CPU
    threads (default: torch's; Ray's workers keep their own; featcache/threads.py)."""
    dev = resolve_device(device)
    grid, backbones = as_list(grid, "grid"), as_list(backbones, "backbones")  # a lone string is one item
    set = [f"{k}={v}" for k, v in set.items()] if isinstance(set, dict) else as_list(set, "set") or []
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}: use local or ray")
    seeds = check_seeds(seeds)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise UserError(f"--chunk {chunk}: a chunk holds at least 1 model (leave it out to plan it from memory)")
    impl = create(algo)
    spec, algo = algo, impl.name  # a plug-in spec names the run as its registered name; chunks load it by its spec
    base = merge_rounds(set, rounds)
    base_cfg = resolve(impl, base)
    axes = parse_grid(impl, grid)
    fixed = scoped(base, [impl])[impl.name]
    both = [k for k in axes if k in fixed]
    if both:
        flag = "--rounds" if both[0] == "rounds" and rounds is not None else f"--set {both[0]}"
        raise UserError(f"{both[0]} is both a --grid axis and {flag}: give it in one place")
    points = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    cfgs = [base_cfg | p for p in points]
    for c in cfgs:  # the whole grid, every combination, before anything trains
        check(impl, c)
    check_folder(out)
    picked = {"backbones": list(backbones)} if backbones else {}  # recorded only when a subset is asked for

    run_id = hashlib.sha256(
        json.dumps(
            {"cache": str(Path(cache).resolve()), "algo": algo, "base": base_cfg, "axes": axes, "seeds": list(seeds)}
            | picked,
            sort_keys=True,
        ).encode()
    ).hexdigest()[:12]
    folder = Path(out) / f"grid-{algo}-{run_id}"

    fit = load_split(cache, impl, holdout="fit", backbones=backbones)
    check_features(fit, cache)
    check_split(load_clients(cache, "train", holdout="val", backbones=backbones), "validation", cache, NO_VAL_ROWS)
    if retrain:  # the whole cache is read and checked before the run folder exists
        check_split(load_clients(cache, "test", backbones=backbones), "test", cache, NO_TEST_ROWS)
    C = fit.features.shape[0]
    buckets: dict[str, list[int]] = {}
    for i, c in enumerate(cfgs):
        check_clients(c, C)
        buckets.setdefault(_bucket_key(c, impl), []).append(i)
    per_model = {}  # memory of one model per bucket: refuse a bucket whose smallest chunk cannot fit, before training
    for key, members in buckets.items():
        per_model[key] = check_memory(
            impl, cfgs[members[0]], min(chunk or 1, len(members) * len(seeds)), fit, dev, "use a smaller --chunk"
        )
    made = missing_folders(folder)
    make_folder(folder)
    try:
        jobs, chunk_sizes = [], []
        for key, members in buckets.items():
            models = [(i, s) for i in members for s in seeds]  # configurations x seeds share the H axis
            size = (
                chunk
                or chunked_before(folder, cfgs, models)
                or plan_chunk(len(models), per_model[key], memory_budget(dev))
            )
            chunk_sizes.append(size)
            for start in range(0, len(models), size):
                part = models[start : start + size]
                jobs.append(
                    {
                        "file": chunk_file(folder, cfgs, part),
                        "models": part,
                        "rounds": max(cfgs[i]["rounds"] for i, _ in part),
                        "args": (str(cache), spec, [cfgs[i] | {"seed": int(s)} for i, s in part], device, backbones),
                    }
                )
        todo = [j for j in jobs if not j["file"].is_file()]
        if progress:
            progress("grid chunks", len(jobs) - len(todo), len(jobs))
        for job, acc in BACKENDS[backend](todo, progress):
            _write_json(job["file"], {"models": job["models"], "val_acc": acc})
            if progress:
                progress("grid chunks", sum(j["file"].is_file() for j in jobs), len(jobs))

        scores = {i: [] for i in range(len(cfgs))}
        for job in jobs:
            saved = json.loads(job["file"].read_text())
            for (i, _seed), per_client in zip(saved["models"], saved["val_acc"]):
                scores[i].append(float(np.mean(per_client)))
        table = sorted(
            ({"config": points[i], "val_mean": mean_std(v)[0], "val_std": mean_std(v)[1]} for i, v in scores.items()),
            key=lambda r: -r["val_mean"],
        )
        result = {
            "algo": algo,
            "cache": str(cache),
            "axes": axes,
            "seeds": list(seeds),
            "configs": len(cfgs),
            "models": len(cfgs) * len(seeds) * C,
            "chunks": len(jobs),
            "chunk_size": max(chunk_sizes),
            "backend": backend,
            "device": str(dev),
            "run_folder": str(folder),
            "selection": table,
            "best": table[0]["config"],
        } | picked
        if retrain:
            final = train(
                cache,
                spec,
                seeds=seeds,
                set=base + [f"{k}={v}" for k, v in table[0]["config"].items()],
                out=folder,
                device=dev,
                backbones=backbones,
                progress=(lambda done, total, _: progress("grid retrain", done, total)) if progress else None,
            )
            keep = (
                "mean_acc",
                "std_acc",
                "per_seed",
                "best_round_mean_acc",
                "best_round_std_acc",
                "result_file",
                "params_uploaded_per_round",
            )
            result["retrain"] = {k: final[k] for k in keep}
        result["provenance"] = provenance(
            dev,
            library_call(
                "featcache.grid",
                cache=str(cache),
                algo=spec,
                grid=list(grid),
                seeds=list(seeds),
                rounds=rounds,
                set=set,
                device=str(device),
                backend=backend,
                chunk=chunk,
                retrain=retrain,
                **picked,
            ),
        )
        resumed = {"chunks_resumed": len(jobs) - len(todo)}  # how this run went, not what it found: beside the result
        write_together(
            [
                (folder / "grid.csv", to_csv(table)),  # all three or none; grid.json last: its presence
                (folder / "grid.timing.json", json.dumps(resumed, sort_keys=True, indent=1)),  # means the
                (folder / "grid.json", json.dumps(result, sort_keys=True, indent=1)),
            ]
        )  # folder is complete
    except BaseException:
        remove_empty(made)  # a run folder that got nothing (and --out, when this run made it): not left behind
        raise
    return result | resumed


def to_csv(table: list[dict]) -> str:
    keys = list(table[0]["config"])
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*keys, "val_mean", "val_std"])
    for r in table:
        w.writerow([*(r["config"][k] for k in keys), f"{r['val_mean']:.4f}", f"{r['val_std']:.4f}"])
    return buf.getvalue()
