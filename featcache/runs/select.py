"""`featcache grid` and `featcache search`: one selection pipeline, trials batched on the configuration axis.

Protocol of the papers (Tan et al., FedPCL, NeurIPS 2022, App. A.1.4): train every configuration on
train-minus-validation (the 20 % held out at extraction), score it by mean client accuracy on the validation rows,
retrain the best on the full train split and report test accuracy mean(std) over seeds (std: the sample std over
seeds, ddof=1; 0 with one seed).

The trials come from a grid (every point, in grid order) or from Optuna's samplers (`space.py`). Continuous settings
(lr, weight decay, τ, μ, ...) are per-model tensors on the engine's configuration axis, so trials x seeds x clients
train in the same vectorized steps; structural ones (widths, prompt counts, option strings) split a batch into
buckets (`Trainer`). One failure policy: a trial whose loss or scores turn NaN/Inf, in training or at an evaluation,
fails alone and is reported; the others train exactly as they would without it.

A grid has no pruner: its buckets are cut into chunks sized to the memory budget, trained one after another or as Ray
tasks, each finished chunk written atomically to the run folder, so an interrupted grid resumes at the first
unfinished chunk in the chunking it started with (`chunked_before`). A search trains wave after wave, round by round,
so that its pruner can stop trials at the rungs (`space.drive`); each finished wave is written, and a resumed search
replays the written waves into a fresh study, so a search killed anywhere writes the bytes of one that was not.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from ..algorithms import create, plugin_exits
from ..atomic import check_folder, make_folder, missing_folders, remove_empty, write_atomic, write_together
from ..cache import ClientData, load_clients
from ..cache.identity import content_key
from ..cluster import ray_module
from ..devices import resolve_device
from ..errors import UserError, as_list
from ..memory import available_bytes
from ..provenance import library_call, provenance
from ..threads import threaded
from ..training.config import check_clients, structural_keys
from ..training.engine import Engine, take_models
from ..training.footprint import check_memory
from ..training.guards import NO_TEST_ROWS, NO_VAL_ROWS, check_features, check_split
from ..training.schedule import dropped_note, evaluates, one_step_note
from . import space as S
from .metrics import mean_std
from .spec import RunSpec, given_once
from .train import load_split, run, surviving

BACKENDS: dict[str, Callable] = {}  # a grid's backend: (jobs, progress, (fit, val)) -> (job, its scores) as each ends

# A chunk plans for 1/N of the available memory: the rest is headroom for the loaded data, evaluation and the
# per-model estimate's error.
BUDGET_DIVISOR = {"cuda": 2, "cpu": 4}


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
    given = {"grid": grid if isinstance(grid, dict) else as_list(grid, "grid")}
    call = _call(
        "featcache.grid", cache, algo, given, spec, rounds, set, device, backend=backend, chunk=chunk, retrain=retrain
    )
    return run_grid(spec, cache, out, device, backend, chunk, retrain, progress, call)


@threaded
def search(
    cache: str | Path,
    algo: str,
    space: list[str] | dict,
    trials: int = 16,
    sampler: str = "random",
    pruner: str = "halving",
    seeds: Sequence[int] = (0, 1, 2),
    rounds: int | None = None,
    set: list[str] | dict | None = None,
    backbones: list[str] | None = None,
    out: str | Path = "runs",
    device: str | torch.device = "auto",
    batch: int | None = None,
    sampler_seed: int = 0,
    rungs: int = S.RUNGS,
    reduction: int = S.REDUCTION,
    retrain: bool = True,
    progress=None,
    threads: int | None = None,
) -> dict:
    """Search `space` with `trials` trials, each trained for every seed on train-minus-validation; select the best
    completed trial on validation, retrain it on the full train split, report test mean(std). Resumable by run folder.

    `space`: `key=v1,v2` or `key=KIND:low,high` strings (KIND: uniform, loguniform, int, logint) or a dict of lists or
    such strings. `sampler` (random | tpe | grid, seeded by `sampler_seed`) picks the trials, `batch` at a time (one
    batched run each; default: all of them, a quarter for tpe so that later batches learn from earlier ones, at most
    what fits in memory);
    `pruner` (none | halving | hyperband) stops trials at `rungs` rungs `reduction` times apart (η)."""
    options = S.search_options(trials, sampler, pruner, batch, sampler_seed, rungs, reduction)
    spec = RunSpec.resolve(algo, rounds, seeds, set, backbones)
    dims = S.parse_space(spec.algo, space)
    given_once(spec.algo, dims, set, rounds, "--space setting")
    given = {"space": space if isinstance(space, dict) else as_list(space, "space")}
    call = _call("featcache.search", cache, algo, given, spec, rounds, set, device, retrain=retrain, **options)
    return run_search(spec, dims, cache, out, device, retrain, progress, call, **options)


def _call(name: str, cache, algo: str, given: dict, spec: RunSpec, rounds, set, device, **options) -> str:
    """The library call a selection's provenance records: what the user gave, `given` (the grid or the space) after
    the algorithm, the options after the device, the backbones last when a subset was chosen."""
    picked = {"backbones": list(spec.backbones)} if spec.backbones else {}
    return library_call(
        name,
        cache=str(cache),
        algo=algo,
        **given,
        seeds=list(spec.seeds),
        rounds=rounds,
        set=set,
        device=str(device),
        **options,
        **picked,
    )


def check_options(backend: str, chunk: int | None) -> None:
    """A grid's `backend` (a key of BACKENDS) and `chunk` (None, or models per batched run >= 1), checked."""
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}: use local or ray")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise UserError(f"--chunk {chunk}: a chunk holds at least 1 model (leave it out to plan it from memory)")


@dataclass
class Rows:
    """What a selection trains and scores on, each read once: train-minus-validation (`fit`), the validation rows
    and, when the best is retrained, the test rows; and the device."""

    dev: torch.device
    fit: ClientData
    val: ClientData
    test: ClientData | None


def load_rows(spec: RunSpec, cache, out, device, retrain: bool) -> Rows:
    """The device, the output folder and the whole cache read and checked before any run folder exists."""
    dev = resolve_device(device)
    check_folder(out)
    fit = load_split(cache, spec.algo, holdout="fit", backbones=spec.backbones)
    check_features(fit, cache)
    val = load_clients(cache, "train", holdout="val", backbones=spec.backbones)
    check_split(val, "validation", cache, NO_VAL_ROWS)
    test = load_clients(cache, "test", backbones=spec.backbones) if retrain else None
    if test is not None:
        check_split(test, "test", cache, NO_TEST_ROWS)
    return Rows(dev, fit, val, test)


def bucket_key(cfg: dict, algo) -> str:
    """What configurations must share to train in one batched run: their structural settings."""
    return json.dumps({k: cfg[k] for k in structural_keys(cfg, algo)}, sort_keys=True)


def plan_buckets(algo, cfgs: list[dict], rows: Rows, models: int, least: int, hint: str) -> tuple[dict, list[str]]:
    """`cfgs` (each trained as `models` models: its seeds, or a search's batch x seeds) by bucket: {key: (their
    positions, the bytes of one model)}, each checked against the cache's clients and refused in one line when
    `least` of its models cannot fit in memory; and the notes on their local steps, which `warn` shows once
    training begins (bad input stays one error line)."""
    fit_rows, notes, buckets = rows.fit.counts.tolist(), [], cast(dict[str, list[int]], {})
    for i, c in enumerate(cfgs):
        check_clients(c, rows.fit.features.shape[0])
        epochs = algo.bind(c).local_epochs()
        notes.append(one_step_note(algo, fit_rows, c["batch_size"], c["drop_last"], epochs, "validation-fit"))
        notes.append(dropped_note(fit_rows, c["batch_size"], c["drop_last"], "validation-fit"))
        buckets.setdefault(bucket_key(c, algo), []).append(i)
    planned = {
        key: (
            members,
            check_memory(algo, cfgs[members[0]], min(least, len(members) * models), rows.fit, rows.dev, hint),
        )
        for key, members in buckets.items()
    }
    return planned, list(dict.fromkeys(line for line in notes if line))


def warn(notes: list[str]) -> None:
    for line in notes:
        warnings.warn(line, UserWarning, stacklevel=4)  # each distinct line once (Python's warning registry)


class Trainer:
    """Models trained round by round: `models` holds (trial, settings with the seed) pairs; one engine per bucket
    (models that share their structural settings) holds them on H. Where a model's loss or scores turn NaN/Inf its
    trial's models leave, and the rest of the bucket trains again from round 0 without them (each survivor trains
    as alone); `drop` moves a bucket's survivors to a fresh engine of their models alone (`take_models`)."""

    def __init__(self, algo, models: list[tuple[int, dict]], fit, val, device, tick=None):
        self.algo, self.models, self.fit, self.val, self.device, self.tick = algo, models, fit, val, device, tick
        groups: dict[str, list[int]] = {}
        for m, (_, cfg) in enumerate(models):
            groups.setdefault(bucket_key(cfg, algo), []).append(m)
        self.buckets = [self._engine(ms) for ms in groups.values()]  # [engine, its models' positions]
        self.scores: dict[int, list | str] = {}  # model -> per-client accuracy % at its last evaluation, or why not

    def _engine(self, ms: list[int]) -> list:
        with plugin_exits():
            return [Engine(self.algo, [self.models[m][1] for m in ms], self.fit, self.val, self.device), ms]

    def steps(self, live=None) -> Iterator[tuple[int, dict]]:
        """(round, {trial: (validation accuracy %, per seed)}) after each round some bucket evaluates: mean over the
        clients per seed, then over the seeds; (NaN, its one-line reason) for a trial that failed, which leaves."""
        for rnd in range(max(cfg["rounds"] for _, cfg in self.models)):
            now: list[int] = []
            for bucket in [b for b in self.buckets if rnd < b[0].cfg["rounds"] and evaluates(rnd, b[0].cfg)]:
                now += self._run(bucket, rnd + 1)  # the rounds up to the next evaluation in one go
            if self.tick:
                self.tick(rnd + 1)
            self.buckets = [b for b in self.buckets if b[1]]
            by_trial: dict[int, list] = {}
            for m in now:
                by_trial.setdefault(self.models[m][0], []).append(self.scores[m])
            if by_trial:
                yield rnd + 1, {t: self._value(v) for t, v in by_trial.items()}

    @staticmethod
    def _value(scores: list) -> tuple:
        failed = [s for s in scores if isinstance(s, str)]
        if failed:
            return math.nan, failed[0]
        per_seed = [float(np.mean(s)) for s in scores]
        return mean_std(per_seed)[0], per_seed

    def _run(self, bucket: list, until: int) -> list[int]:
        """A bucket trained to round `until`; returns the models it scored (a failed trial's with their reason)."""
        before = bucket[1]

        def train(ms: list[int]) -> None:
            if ms != bucket[1]:  # some failed: the rest from round 0 without them
                bucket[:] = self._engine(ms)
            with plugin_exits():
                bucket[0].run(logs=False, until=until)

        _, bucket[1], failed = surviving(train, bucket[1], same=lambda m: self.models[m][0])
        self.scores |= failed
        if bucket[1]:
            acc = bucket[0].loop.records[-1]["test_acc"]  # [H, C]
            self.scores |= dict(zip(bucket[1], (100 * acc).tolist()))
        return before

    def drop(self, pruned: list[int]) -> None:
        """The models of the `pruned` trials leave their buckets; the survivors keep their state."""
        out = []
        for engine, ms in self.buckets:
            keep = [h for h, m in enumerate(ms) if self.models[m][0] not in pruned]
            if len(keep) == len(ms):
                out.append([engine, ms])
            elif keep:
                fresh = self._engine([ms[h] for h in keep])
                fresh[0].load_state_dict(take_models(engine.state_dict(), keep))
                out.append(fresh)
        self.buckets = out


def _run_chunk(cache: str, source: str, models: list, device, backbones=None, progress=None, data=None) -> list:
    """A grid chunk trained on train-minus-validation to its last round and scored on validation: per model
    (trial, settings with its seed), its per-client accuracy %, or the one line saying why its trial failed.
    `progress(round)` after each round; `data` = (fit, val) when the caller loaded them (a Ray task loads its own)."""
    algo = create(source)
    fit, val = data or (
        load_split(cache, algo, holdout="fit", backbones=backbones),
        load_clients(cache, "train", holdout="val", backbones=backbones),
    )
    trainer = Trainer(algo, [tuple(m) for m in models], fit, val, device, progress)
    for _ in trainer.steps():
        pass
    return [trainer.scores[m] for m in range(len(models))]


def _local_backend(jobs, progress, data):
    """In-process, one chunk after another, on the grid's (fit, val) `data`; progress is reported per round (in rounds
    of all chunks to train)."""
    total, done = sum(job["rounds"] for job in jobs), 0
    for job in jobs:
        tick = (lambda r, base=done: progress("grid rounds", base + r, total)) if progress else None
        yield job, _run_chunk(*job["args"], tick, data)
        done += job["rounds"]


def _ray_backend(jobs, progress, data):
    """Chunks as Ray tasks on the cluster of `cluster.ray_module`; each loads its (fit, val) rows where it runs."""
    ray = ray_module()
    remote = ray.remote(_run_chunk)
    pending = {remote.remote(*job["args"]): job for job in jobs}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        job = pending.pop(done[0])
        yield job, ray.get(done[0])


BACKENDS |= {"local": _local_backend, "ray": _ray_backend}


def plan_chunk(n_models: int, per_model_bytes: int, budget_bytes: int) -> int:
    """How many configurations x seeds fit in one batched run."""
    return max(1, min(n_models, budget_bytes // max(per_model_bytes, 1)))


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


@contextmanager
def run_folder(folder: Path) -> Iterator[Path]:
    """`folder` made; removed again with the parents it needed (`--out` too, when this made it) where the run stops
    before anything is written into it."""
    made = missing_folders(folder)
    make_folder(folder)
    try:
        yield folder
    except BaseException:
        remove_empty(made)
        raise


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
    """`grid` of a resolved `spec` (its axes): what the CLI and reproduce call. The run folder `grid-LABEL` is named
    by `spec.label`, so a moved or copied cache resumes its grid. `call` is the library call grid.json's provenance
    records (default: the `featcache.grid` call of `spec`)."""
    rows = load_rows(spec, cache, out, device, retrain)
    cfgs, seeds = spec.configs(), spec.seeds
    buckets, notes = plan_buckets(spec.algo, cfgs, rows, len(seeds), chunk or 1, "use a smaller --chunk")
    warn(notes)
    folder = Path(out) / f"grid-{spec.label(rows.fit.meta)}"
    with run_folder(folder):
        jobs, sizes = [], []
        for members, per_model in buckets.values():
            models = [(i, s) for i in members for s in seeds]  # configurations x seeds share the H axis
            size = (
                chunk
                or chunked_before(folder, cfgs, models)
                or plan_chunk(len(models), per_model, memory_budget(rows.dev))
            )
            sizes.append(size)
            for part in (models[start : start + size] for start in range(0, len(models), size)):
                job_models = [(i, cfgs[i] | {"seed": int(s)}) for i, s in part]
                args = (str(cache), spec.source, job_models, device, list(spec.backbones or []) or None)
                rounds = max(cfgs[i]["rounds"] for i, _ in part)
                jobs.append({"file": chunk_file(folder, cfgs, part), "models": part, "rounds": rounds, "args": args})
        todo = [j for j in jobs if not j["file"].is_file()]
        if progress:
            progress("grid chunks", len(jobs) - len(todo), len(jobs))
        for job, acc in BACKENDS[backend](todo, progress, (rows.fit, rows.val)):
            write_atomic(job["file"], json.dumps({"models": job["models"], "val_acc": acc}, sort_keys=True, indent=1))
            if progress:
                progress("grid chunks", sum(j["file"].is_file() for j in jobs), len(jobs))
        table = _grid_table(spec.points(), jobs)
        result = {
            "algo": spec.name,
            "cache": str(cache),
            "axes": spec.axes,
            "seeds": list(seeds),
            "configs": len(cfgs),
            "models": len(cfgs) * len(seeds) * rows.fit.features.shape[0],
            "chunks": len(jobs),
            "chunk_size": max(sizes),
            "backend": backend,
            "device": str(rows.dev),
            "run_folder": str(folder),
            "selection": table,
            "best": table[0]["config"],
        } | ({"backbones": list(spec.backbones)} if spec.backbones else {})
        call = call or spec.call(cache, device, backend=backend, chunk=chunk, retrain=retrain)
        timing = {"chunks_resumed": len(jobs) - len(todo)}
        return _finish("grid", spec, result, _grid_csv(table), timing, cache, folder, rows, progress, call)


def _grid_table(points: list[dict], jobs: list[dict]) -> list[dict]:
    """The grid's configurations by mean validation score over seeds, best first (a tie keeps grid order, named in a
    warning), the failed ones last with their reason (each named in a warning); one line when every one failed."""
    scores: dict[int, list] = {i: [] for i in range(len(points))}
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
        warnings.warn(f"grid: {points[i]} failed and the others went on: {reason}", UserWarning, stacklevel=3)
    if not table:  # nothing to select: the first one's line, and no chunk left behind (each would fail again)
        for job in jobs:
            job["file"].unlink(missing_ok=True)
        raise UserError(failed[min(failed)])
    tied = [r["config"] for r in table if r["val_mean"] == table[0]["val_mean"]]
    if len(tied) > 1:  # the sort is stable: the first in grid order wins
        warnings.warn(
            f"{len(tied)} configurations tie exactly on validation ({table[0]['val_mean']:.4f}): picked "
            f"{table[0]['config']}, the first of them in grid order (a tie keeps the grid's order)",
            UserWarning,
            stacklevel=3,
        )
    failures = [
        {"config": points[i], "val_mean": None, "val_std": None, "state": "failed", "reason": r}
        for i, r in sorted(failed.items())
    ]
    return table + failures


def run_search(
    spec: RunSpec,
    dims: dict[str, S.Dim],
    cache: str | Path,
    out: str | Path,
    device: str | torch.device = "auto",
    retrain: bool = True,
    progress=None,
    call: str | None = None,
    *,
    trials: int = 16,
    sampler: str = "random",
    pruner: str = "halving",
    batch: int | None = None,
    sampler_seed: int = 0,
    rungs: int = S.RUNGS,
    reduction: int = S.REDUCTION,
) -> dict:
    """`search` of a resolved `spec` and parsed space `dims` (what the CLI calls). The run folder `search-ALGO-KEY16`
    is named by what it searches; a finished one returns its result without training (or only retrains its best,
    when it finished without a retrain and one is asked for now)."""
    optuna = S.optuna_module()
    S.check_options(sampler, pruner, trials, batch, rungs, reduction, sampler_seed)
    R, seeds = spec.config["rounds"], list(spec.seeds)
    rule = S.Rungs(S.PRUNERS[pruner], S.rung_rounds(R, pruner, rungs, reduction), reduction)
    S.check_sampler(dims, sampler, trials)
    given, batch = batch, min(batch or (max(1, math.ceil(trials / 4)) if sampler == "tpe" else trials), trials)
    rows = load_rows(spec, cache, out, device, retrain)
    least = (given or 1) * len(seeds)  # a batch not given is planned from memory, as a grid's chunks are
    buckets, notes = plan_buckets(spec.algo, [spec.config], rows, batch * len(seeds), least, "use a smaller --batch")
    if not given:
        per_model = next(iter(buckets.values()))[1]
        batch = max(1, plan_chunk(batch * len(seeds), per_model, memory_budget(rows.dev)) // len(seeds))
    searched = {
        "space": {k: d.as_json() for k, d in dims.items()},
        "trials": trials,
        "sampler": sampler,
        "pruner": pruner,
        "batch": batch,
        "sampler_seed": sampler_seed,
        "rungs": rule.at,
        "reduction": reduction,
        "rule": "synchronous",
        "optuna": optuna.__version__,
    }
    key = content_key({"run": spec.key(rows.fit.meta), "search": searched})
    folder = Path(out) / f"search-{spec.name}-{key[:16]}"
    finished = S.read_saved(
        folder / "search.json", lambda r: S.is_result(r, searched), "its finished waves are replayed"
    )
    if finished and (not retrain or "retrain" in finished):  # its result, nothing trained
        return finished | {"waves_resumed": "all"}
    with run_folder(folder):
        records, resumed = _waves(spec, rows, dims, folder, rule, notes, progress, trials, sampler, batch, sampler_seed)
        table = S.ranked(records, folder)
        result = {
            "algo": spec.name,
            "cache": str(cache),
            "seeds": seeds,
            "rounds": R,
            "clients": int(rows.fit.features.shape[0]),
            "model_rounds": sum(r["rounds_trained"] for r in records) * len(seeds),
            "model_rounds_unpruned": trials * len(seeds) * R,
            "device": str(rows.dev),
            "run_folder": str(folder),
            "selection": table,
            "best": table[0]["config"],
        } | searched
        result |= {"backbones": list(spec.backbones)} if spec.backbones else {}
        call = call or library_call("featcache.search", cache=str(cache))
        timing = {"waves_resumed": resumed}
        return _finish("search", spec, result, S.to_csv(table), timing, cache, folder, rows, progress, call)


def _waves(spec, rows, dims, folder, rule, notes, progress, trials, sampler, batch, sampler_seed) -> tuple:
    """The search's trial records, wave by wave: a written wave replayed into the study (checked to make the same
    decisions), the first unwritten one trained (`Trainer`, driven by `space.drive`) and written; and how many waves
    were replayed."""
    optuna = S.optuna_module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(
            study_name=S.STUDY, direction="maximize", sampler=S.SAMPLERS[sampler](optuna, dims, sampler_seed, batch)
        )  # Optuna's own pruner stays off: `drive` decides the rungs
    dists = {k: d.distribution(optuna) for k, d in dims.items()}
    waves = [min(batch, trials - start) for start in range(0, trials, batch)]
    R, records, resumed = spec.config["rounds"], cast(list[dict], []), 0
    for w, n in enumerate(waves):
        path = folder / f"wave-{w:03d}.json"
        if path.is_file():
            saved = cast(dict, S.read_saved(path, lambda r: S.is_wave(r, n), "that wave trains again"))["trials"]
            if json.loads(json.dumps(S.drive(study, dists, n, S.Replay(saved, folder), rule, records))) != saved:
                raise UserError(f"{path} does not replay to the same decisions: remove {folder} to search again")
            resumed += 1
        else:
            warn(notes)
            base = sum(waves[:w]) * R
            tick = (lambda r, b=base, n=n: progress("search rounds", b + r * n, trials * R)) if progress else None
            models = lambda points: [
                (i, spec.config | p | {"seed": int(s)}) for i, p in enumerate(points) for s in spec.seeds
            ]
            wave = lambda points, tick=tick: Trainer(spec.algo, models(points), rows.fit, rows.val, rows.dev, tick)
            saved = S.drive(study, dists, n, wave, rule, records)
            write_atomic(path, json.dumps({"trials": saved}, sort_keys=True, indent=1))
        records += saved
        if progress:
            progress("search trials", sum(waves[: w + 1]), trials)
    return records, resumed


def _finish(kind, spec, result, table_csv, timing, cache, folder, rows: Rows, progress, call) -> dict:
    """The best retrained when asked (on the full train split: the selection's rows are let go first), the provenance
    recorded, and KIND.csv, KIND.timing.json and KIND.json written all or none, KIND.json last: its presence means
    the folder is complete. Returns the result with how this run went (`timing`) beside it."""
    if rows.test is not None:
        del rows.fit, rows.val  # the selection's rows: the retrain reads the full train split
        result["retrain"] = retrain_best(spec, result["best"], cache, folder, rows.dev, rows.test, progress, kind)
    result["provenance"] = provenance(rows.dev, call)
    write_together(
        [
            (folder / f"{kind}.csv", table_csv),
            (folder / f"{kind}.timing.json", json.dumps(timing, sort_keys=True, indent=1)),
            (folder / f"{kind}.json", json.dumps(result, sort_keys=True, indent=1)),
        ]
    )
    return result | timing


def retrain_best(spec: RunSpec, point: dict, cache, folder: Path, dev, test, progress=None, kind: str = "grid") -> dict:
    """The `retrain` entry of a selection's result: `point` trained on the full train split into `folder`, tested on
    `test`; progress ticks under "KIND retrain"."""
    final = run(
        spec.pick(point),
        cache,
        folder,
        dev,
        progress=(lambda done, total, _: progress(f"{kind} retrain", done, total)) if progress else None,
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


def _grid_csv(table: list[dict]) -> str:
    keys = list(table[0]["config"])
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*keys, "val_mean", "val_std"])
    for r in table:
        score = ["", ""] if r["val_mean"] is None else [f"{r['val_mean']:.4f}", f"{r['val_std']:.4f}"]
        w.writerow([*(r["config"][k] for k in keys), *score])  # a failed configuration: no score
    return buf.getvalue()
