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
import json
import warnings
from collections.abc import Sequence
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
from ..training.config import check_clients, structural_keys
from ..training.guards import NO_TEST_ROWS, NO_VAL_ROWS, check_features, check_split
from ..training.schedule import dropped_note, one_step_note
from ..training.footprint import check_memory
from .spec import RunSpec
from .train import load_split, run, run_configs, surviving

BACKENDS = {}


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
    """Train a chunk on train-minus-validation and score on validation: per model, per-client final accuracy, or
    the one line saying why it diverged (the others train again without it: `surviving`). `progress(round, rounds,
    live)` is called after each round (Engine.run); `data` = (fit, val) when the caller already loaded them."""
    algo = create(algo_name)
    fit, val = data or _split_data(cache, algo, backbones)
    fits = lambda hs: run_configs(algo, [cfgs[h] for h in hs], fit, val, device, progress, logs=False)["acc"][-1]
    acc, kept, failed = surviving(fits, list(range(len(cfgs))))  # acc [H', C] over the survivors
    scores = dict(zip(kept, (100 * acc).tolist())) if kept else {}
    return [scores[h] if h in scores else failed[h] for h in range(len(cfgs))]


def _local_backend(jobs, progress, data):
    """In-process, one chunk after another, on the grid's (fit, val) `data`; progress is reported per round (in rounds
    of all chunks to train)."""
    total = sum(job["rounds"] for job in jobs)
    done = 0
    for job in jobs:
        tick = None
        if progress:
            tick = lambda r, R, _, base=done, n=job["rounds"]: progress("grid rounds", base + round(r * n / R), total)
        yield job, _run_chunk(*job["args"], tick, data)
        done += job["rounds"]


BACKENDS["local"] = _local_backend


def _ray_backend(jobs, progress, data):
    """Chunks as Ray tasks on the cluster of `cluster.ray_module`; each loads its (fit, val) rows where it runs."""
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
    grid: list[str] | dict,
    seeds: Sequence[int] = (0, 1, 2),
    rounds: int | None = None,
    set: list[str] | dict | None = None,
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

    `grid` gives the axes: `key=v1,v2` strings or a dict of value lists (`{"lr": [0.1, 0.01]}`). `backbones` trains
    on a subset of the cached backbones' features (default: all, concatenated).

    `device` (auto | cpu | cuda[:N]) is checked before anything is read and sizes the chunks; each chunk resolves it
    again where it runs, so with the Ray backend `auto` picks each worker's GPU when it has one. `threads` runs it on
    that many CPU threads (default: torch's; Ray's workers keep their own; featcache/threads.py)."""
    check_options(backend, chunk)
    spec = RunSpec.resolve(algo, rounds, seeds, set, backbones, grid if grid is not None else [])
    call = library_call(
        "featcache.grid",
        cache=str(cache),
        algo=algo,
        grid=grid if isinstance(grid, dict) else as_list(grid, "grid"),
        seeds=list(spec.seeds),
        rounds=rounds,
        set=set,
        device=str(device),
        backend=backend,
        chunk=chunk,
        retrain=retrain,
        **({"backbones": list(spec.backbones)} if spec.backbones else {}),
    )
    return run_grid(spec, cache, out, device, backend, chunk, retrain, progress, call)


def check_options(backend: str, chunk: int | None) -> None:
    """A grid's `backend` (a key of BACKENDS) and `chunk` (None, or models per batched run >= 1), checked."""
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}: use local or ray")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise UserError(f"--chunk {chunk}: a chunk holds at least 1 model (leave it out to plan it from memory)")


def run_grid(
    spec: RunSpec,
    cache: str | Path,
    out: str | Path,
    device: str | torch.device = "auto",
    backend: str = "local",
    chunk: int | None = None,
    retrain: bool = True,
    progress=None,
    call: str | None = None,
) -> dict:
    """`grid` of a resolved `spec` (its axes): what the CLI and reproduce call. Reads fit, validation and test rows
    once each (the retrain the full train split); the run folder `grid-LABEL` is named by `spec.label`, so a moved
    or copied cache resumes its grid. `call` is the library call grid.json's provenance records (default: the
    `featcache.grid` call of `spec`)."""
    dev = resolve_device(device)
    check_folder(out)
    impl, backbones, seeds = spec.algo, spec.backbones, spec.seeds
    picked = {"backbones": list(backbones)} if backbones else {}  # recorded only when a subset is asked for
    fit = load_split(cache, impl, holdout="fit", backbones=backbones)
    check_features(fit, cache)
    val = load_clients(cache, "train", holdout="val", backbones=backbones)
    check_split(val, "validation", cache, NO_VAL_ROWS)
    test = load_clients(cache, "test", backbones=backbones) if retrain else None
    if test is not None:  # the whole cache is read and checked before the run folder exists
        check_split(test, "test", cache, NO_TEST_ROWS)
    folder = Path(out) / f"grid-{spec.label(fit.meta)}"
    points, cfgs = spec.points(), spec.configs()
    C = fit.features.shape[0]
    buckets: dict[str, list[int]] = {}
    fit_rows, notes = fit.counts.tolist(), []
    for i, c in enumerate(cfgs):
        check_clients(c, C)
        notes.append(
            one_step_note(
                impl, fit_rows, c["batch_size"], c["drop_last"], impl.bind(c).local_epochs(), "validation-fit"
            )
        )
        notes.append(dropped_note(fit_rows, c["batch_size"], c["drop_last"], "validation-fit"))
        buckets.setdefault(_bucket_key(c, impl), []).append(i)
    per_model = {}  # memory of one model per bucket: refuse a bucket whose smallest chunk cannot fit, before training
    for key, members in buckets.items():
        per_model[key] = check_memory(
            impl, cfgs[members[0]], min(chunk or 1, len(members) * len(seeds)), fit, dev, "use a smaller --chunk"
        )
    for line in filter(None, notes):  # after every check: bad input stays its one error line
        warnings.warn(line, UserWarning, stacklevel=2)  # each distinct line once (Python's warning registry)
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
                        "args": (
                            str(cache),
                            spec.source,
                            [cfgs[i] | {"seed": int(s)} for i, s in part],
                            device,
                            list(backbones) if backbones else None,
                        ),
                    }
                )
        todo = [j for j in jobs if not j["file"].is_file()]
        if progress:
            progress("grid chunks", len(jobs) - len(todo), len(jobs))
        for job, acc in BACKENDS[backend](todo, progress, (fit, val)):
            _write_json(job["file"], {"models": job["models"], "val_acc": acc})
            if progress:
                progress("grid chunks", sum(j["file"].is_file() for j in jobs), len(jobs))

        scores: dict[int, list] = {i: [] for i in range(len(cfgs))}
        failed: dict[int, str] = {}  # a configuration any of whose seeds diverged: why, in one line
        for job in jobs:
            saved = json.loads(job["file"].read_text())
            for (i, _seed), got in zip(saved["models"], saved["val_acc"]):
                if isinstance(got, str):
                    failed.setdefault(i, got)
                else:
                    scores[i].append(float(np.mean(got)))
        table: list[dict] = sorted(
            (
                {"config": points[i], "val_mean": mean_std(v)[0], "val_std": mean_std(v)[1]}
                for i, v in scores.items()
                if i not in failed
            ),
            key=lambda r: -r["val_mean"],
        )
        for i, reason in sorted(failed.items()):
            warnings.warn(f"grid: {points[i]} failed and the others went on: {reason}", UserWarning, stacklevel=2)
        if not table:  # nothing to select: the first one's line, and no chunk left behind (each would fail again)
            for job in jobs:
                job["file"].unlink(missing_ok=True)
            raise UserError(failed[min(failed)])
        table += [
            {"config": points[i], "val_mean": None, "val_std": None, "state": "failed", "reason": r}
            for i, r in sorted(failed.items())
        ]
        tied = [r["config"] for r in table if r["val_mean"] == table[0]["val_mean"]]
        if len(tied) > 1:  # the sort is stable: the first in grid order wins
            warnings.warn(
                f"{len(tied)} configurations tie exactly on validation ({table[0]['val_mean']:.4f}): picked "
                f"{table[0]['config']}, the first of them in grid order (a tie keeps the grid's order)",
                UserWarning,
                stacklevel=2,
            )
        result = {
            "algo": spec.name,
            "cache": str(cache),
            "axes": spec.axes,
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
        if test is not None:
            del fit, val  # the chunks' rows: the retrain reads the full train split
            result["retrain"] = retrain_best(spec, table[0]["config"], cache, folder, dev, test, progress)
        result["provenance"] = provenance(
            dev, call or spec.call(cache, device, backend=backend, chunk=chunk, retrain=retrain)
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


def retrain_best(
    spec: RunSpec, point: dict, cache, folder: Path, dev, test, progress=None, label: str = "grid retrain"
) -> dict:
    """The `retrain` entry of a grid's (or a search's) result: `point` trained on the full train split into
    `folder`, tested on `test`; progress ticks under `label`."""
    final = run(
        spec.pick(point),
        cache,
        folder,
        dev,
        progress=(lambda done, total, _: progress(label, done, total)) if progress else None,
        data=(load_split(cache, spec.algo, backbones=spec.backbones), test),
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
    return {k: final[k] for k in keep}


def to_csv(table: list[dict]) -> str:
    keys = list(table[0]["config"])
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*keys, "val_mean", "val_std"])
    for r in table:
        score = ["", ""] if r["val_mean"] is None else [f"{r['val_mean']:.4f}", f"{r['val_std']:.4f}"]
        w.writerow([*(r["config"][k] for k in keys), *score])  # a failed configuration: no score
    return buf.getvalue()
