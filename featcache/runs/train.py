"""`featcache train`: run one federated algorithm on a cache for several seeds in one batched engine run.

Seeds share the engine's configuration axis H, so three seeds cost one vectorized run. The result file `NAME.json`
(named by names.py) holds the resolved config, the cache, accuracies (final and best-round), fairness, communication
and provenance (provenance.py). Its numbers are a pure function of (cache, algorithm, config, seeds), so the same
command on the same machine and code writes the same file; wall-clock timings go to the printed summary and a
`.timing.json` sidecar instead. Beside it go `NAME.metrics.csv` (metrics.py) and, when asked, the trained state
(states.py) and TensorBoard scalars in `TENSORBOARD/NAME/seed-S`. These are written together or not at all, the
result file last; the TensorBoard folder is moved into place after them (a run killed in between keeps its result
without the scalars: run it again to log them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import cache as C
from ..algorithms import plugin_exits
from ..atomic import check_folder, missing_folders, output_errors, remove_empty, write_together
from ..devices import resolve_device
from ..errors import UserError, as_list, as_path
from .metrics import metrics_csv, summarize, tensorboard_writer, write_tensorboard
from ..provenance import library_call, provenance
from ..threads import threaded
from .states import SUFFIX, state_bytes
from .checkpoint import Checkpoint, check_every
from ..training.footprint import fit_at_once
from ..training.config import check_clients, check_seeds, scoped
from .names import run_name
from .spec import RunSpec
from ..training.engine import Engine, State
from ..training.guards import NO_TEST_ROWS, Diverged, check_features, check_split
from ..training.schedule import dropped_note, one_step_note

ALL = "all"  # --algo all: every registered algorithm, in turn


def load_split(path, algo, holdout: str = "none", split: str = "train", backbones=None) -> C.ClientData:
    """Train (or validation) clients with cached views when the algorithm uses them."""
    return C.load_clients(path, split, backbones=backbones, views=getattr(algo, "uses_views", False), holdout=holdout)


@dataclass(frozen=True)
class Trained:
    """What a run leaves behind when asked (`train(..., keep_state=True)`): the bound algorithm, the final engine
    state (H = seeds), and the data it trained and was tested on."""

    algo: object
    state: State
    train: C.ClientData
    test: C.ClientData


def run_configs(
    algo,
    cfgs: list[dict],
    train: C.ClientData,
    test: C.ClientData,
    device: str | torch.device = "cpu",
    progress=None,
    logs: bool = True,
    checkpoint=None,
    at_once: int | None = None,
) -> dict:
    """Train H configurations batched; returns the engine's raw output (acc [R_eval, H, C], with `logs` the other
    records of `Engine.run`, uploads, timings) and `trained` (a `Trained`). `checkpoint`: see `Engine.run`;
    `at_once`: see `Engine`."""
    with plugin_exits():
        engine = Engine(algo, cfgs, train, test, device=device, at_once=at_once)
        raw = engine.run(progress, logs, checkpoint)
    return raw | {"trained": Trained(engine.algo, engine.state, engine.train, engine.test)}


def surviving(train, models: list, same=lambda m: m) -> tuple:
    """`train(models)`, again without the models it names as diverged (`Diverged.models`: positions in `models`)
    and those `same` maps to the same key (a search's trial: all its seeds), until it finishes: (its result, or None
    where none is left; the survivors; {model: its one-line reason}). Each model of a batch trains as it would
    alone, so a survivor's numbers are those of a batch without the failed: a configuration that diverges fails
    alone (grid and search alike)."""
    failed: dict = {}
    while models:
        try:
            return train(models), models, failed
        except Diverged as e:
            bad = {same(models[h]) for h in e.models}
            failed |= {m: str(e) for m in models if same(m) in bad}
            models = [m for m in models if same(m) not in bad]
    return None, models, failed


def check_outputs(out: str | Path, tensorboard: str | Path | None = None) -> None:
    """The output folder(s) a run writes, checked before its cache is read: `out`, and TensorBoard (its package
    and folder) when asked for."""
    check_folder(as_path(out, "out"))
    if tensorboard is not None:
        tensorboard_writer()
        check_folder(as_path(tensorboard, "tensorboard"), "--tensorboard")


def tensorboard_run(folder: Path, raw: dict, seeds: list[int]) -> Path:
    """Write the run's scalars into a temporary folder beside `folder` (committed by `commit_folder`)."""
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with output_errors(tmp):
            write_tensorboard(tmp, raw, seeds)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def commit_folder(tmp: Path, folder: Path) -> None:
    """Move the finished `tmp` folder to `folder`, replacing the folder of an earlier run of the same name (the same
    training: names are hashes of what a run trains)."""
    old = folder.with_name(f".{folder.name}.{os.getpid()}.old")
    with output_errors(folder):
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def resolve_runs(
    algo: list[str],
    rounds: int | None = None,
    seeds=(0, 1, 2),
    set: list[str] | dict | None = None,
    backbones: list[str] | None = None,
) -> list[RunSpec]:
    """The specs of several algorithms trained in turn, every one's settings checked before the first trains: each
    listed once, `set`'s `ALGO.key=value` scoped to its algorithm. `all` is every registered algorithm."""
    from ..algorithms import create, list_algorithms, load

    if not algo:
        raise UserError("algo lists no algorithm: give at least one (featcache algos lists them)")
    if ALL in algo and len(algo) > 1:
        raise UserError(f"--algo {ALL} already lists every algorithm: give it alone")
    names = list(list_algorithms()) if algo == [ALL] else [load(a) for a in algo]  # plug-ins: registered by name
    twice = sorted({a for a in names if names.count(a) > 1})
    if twice:
        raise UserError(f"--algo {twice[0]} is given twice: list each algorithm once")
    seeds = check_seeds(seeds)
    sets = scoped(set, [create(name) for name in names])  # fedprox.mu=1 -> fedprox's own mu=1
    return [RunSpec.resolve(name, rounds, seeds, sets[name], backbones) for name in names]


def as_caches(cache) -> list[Path]:
    """`cache` as a list of paths: one path, or a list of them (a sweep trained in one call)."""
    if not isinstance(cache, (list, tuple)):
        return [as_path(cache, "cache")]  # a path, or one line naming what it is instead
    caches = [as_path(c, "cache") for c in cache]
    if not caches:
        raise UserError("cache lists no cache: give at least one cache file from `featcache extract`")
    return caches


def check_runs(specs: list[RunSpec], caches: list[Path], every: bool = False) -> list[tuple[Path, RunSpec]]:
    """Every algorithm on every cache, checked against each cache's metadata before the first trains (a half set of
    results is no comparison): no cache twice (by content), participation against its clients, the backbones and
    views it must hold. Returns the (cache, spec) runs in order, cache by cache; with `every` (`--algo all`), an
    algorithm that needs augmented views (`uses_views`) is left out, with a note, where a cache holds none."""
    if len(specs) * len(caches) <= 1:
        return [(caches[0], s) for s in specs]
    runs: list[tuple[Path, RunSpec]] = []
    seen: dict[str, Path] = {}
    for cache in caches:
        meta = C.info(cache)
        if meta["key"] in seen:
            raise UserError(
                f"--cache {cache} holds what --cache {seen[meta['key']]} holds (the same content key): give one"
            )
        seen[meta["key"]] = cache
        left = [] if meta["views"] or not every else [s.name for s in specs if getattr(s.algo, "uses_views", False)]
        if left:
            on = f" on {cache}" if len(caches) > 1 else ""
            warnings.warn(
                f"--algo {ALL} leaves out {', '.join(left)}{on}: they train on augmented views and this cache holds "
                "none (extract --views N makes them)",
                UserWarning,
                stacklevel=3,
            )
        for spec in (s for s in specs if s.name not in left):
            check_clients(spec.config, len(meta["counts"]["clients"]))
            C.columns(meta, cache, spec.backbones, getattr(spec.algo, "uses_views", False))
            runs.append((cache, spec))
    return runs


@threaded
def train(
    cache: str | Path | Sequence[str | Path],
    algo: str | list[str],
    rounds: int | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    set: list[str] | dict | None = None,
    out: str | Path = "runs",
    device: str | torch.device = "auto",
    backbones: list[str] | None = None,
    keep_state: bool = False,
    tensorboard: str | Path | None = None,
    save_state: bool = False,
    progress=None,
    checkpoint_every: int | None = None,
    threads: int | None = None,
) -> dict:
    """Train `algo` on `cache` for each seed on `device` (auto | cpu | cuda[:N]); write the result JSON and its
    metrics CSV; return the result with timings, the device it ran on (the result file does not record it) and the
    paths written (result_file, metrics_csv, state_file, tensorboard: None when not asked for).

    `backbones` trains on a subset of the cached backbones' features (default: all, concatenated); `keep_state` adds
    `trained` (a `Trained`: algorithm, final state, data) to the returned dict, for analyses of the trained heads;
    `save_state` writes that state to NAME.state.safetensors; `tensorboard` (a folder) logs the per-seed curves to
    TENSORBOARD/NAME; `progress(round, rounds, live)` is called after each round (`Engine.run`: `live` holds each
    seed's test accuracy and training loss at an evaluation round).

    The run saves a checkpoint every `checkpoint_every` rounds (None: every ~60 s; 0: never) and on Ctrl-C, which
    raises `checkpoint.Interrupted`; the same call then resumes it, and once finished returns its result without
    training again (featcache.runs.checkpoint). `threads` runs it on that many CPU threads (default: torch's;
    featcache/threads.py).

    A list of algorithms, a list of caches (a sweep: the same data extracted with several backbones, partitions or
    α), or both train every algorithm on every cache in turn, cache by cache, as repeated `--algo`s and `--cache`s
    do, every run checked first (`plan_runs`); each cache is read once for its algorithms. They return
    `{"runs": [each one's result]}`, a result's numbers, name and files those of its own call's."""
    dev = resolve_device(device)
    runs = plan_runs(cache, algo, rounds, seeds, set, backbones, out, tensorboard, checkpoint_every)
    caches = [str(c) for c in as_caches(cache)]
    spec = runs[0][1]
    call = library_call(
        "featcache.train",
        cache=caches[0] if isinstance(cache, (str, os.PathLike)) else caches,
        algo=algo,
        rounds=rounds,
        seeds=list(spec.seeds),
        set=set,
        device=str(device),
        **({"backbones": list(spec.backbones)} if spec.backbones else {}),
    )
    options = dict(call=call, keep_state=keep_state, tensorboard=tensorboard, save_state=save_state)
    results = list(each_run(runs, out, dev, algo, lambda cache, spec: progress, checkpoint_every, **options))
    one = isinstance(cache, (str, os.PathLike)) and isinstance(algo, str) and algo != ALL
    return results[0] if one else {"runs": results}


def plan_runs(
    cache, algo, rounds, seeds, set, backbones, out, tensorboard, checkpoint_every
) -> list[tuple[Path, RunSpec]]:
    """The (cache, spec) runs `train` makes, every algorithm's settings, the output folders and each cache's
    clients checked before the first trains (`resolve_runs`, `check_runs`)."""
    caches = as_caches(cache)
    specs = (
        [RunSpec.resolve(algo, rounds, seeds, set, backbones)]
        if isinstance(algo, str) and algo != ALL
        else resolve_runs(as_list(algo, "algo") or [], rounds, seeds, set, backbones)
    )
    check_outputs(out, tensorboard)
    check_every(checkpoint_every)
    return check_runs(specs, caches, as_list(algo, "algo") == [ALL])


def each_run(runs, out, device, algo, progress_of, checkpoint_every=None, **options) -> Iterator[dict]:
    """Each (cache, spec) run in turn, its result yielded as soon as it is written; `progress_of(cache, spec)` is
    its progress callback. A cache is read once for the runs on it (`loaded`). Under `--algo all` an algorithm that
    diverges fails alone (`run_or_fail`)."""
    every = as_list(algo, "algo") == [ALL]
    several = len({cache for cache, _ in runs}) > 1
    held: dict = {}
    for cache, s in runs:
        progress = progress_of(cache, s)
        data = loaded(cache, s, held)
        train_one = lambda: run(
            s, cache, out, device, progress=progress, checkpoint_every=checkpoint_every, data=data, **options
        )
        yield run_or_fail(train_one, s, every, cache if several else None)


def loaded(cache: Path, spec: RunSpec, held: dict) -> tuple[C.ClientData, C.ClientData]:
    """(train, test) of `spec` on `cache`, read once for the runs of one cache: `held` keeps what was read last,
    the train split with views for an algorithm that trains on them, without for the others (one at a time)."""
    views = bool(getattr(spec.algo, "uses_views", False))
    if held.get("cache") != cache:
        held.clear()  # the last cache's tensors go before the next one's are read
    if held.get("views") != views:
        held.pop("train", None)
        held |= {"cache": cache, "views": views, "train": load_split(cache, spec.algo, backbones=spec.backbones)}
    if "test" not in held:
        held["test"] = C.load_clients(cache, "test", backbones=spec.backbones)
    return held["train"], held["test"]


def run_or_fail(train_one, spec: RunSpec, every: bool, cache: Path | None = None) -> dict:
    """`train_one()`'s result; with `every` (`--algo all`) an algorithm that diverges at its defaults fails alone:
    its line as a warning and `{"algo": name, "failed": line}` in its place, and the others go on. `cache`: the
    cache it trained on, named where a call trains on several."""
    try:
        return train_one()
    except Diverged as e:
        if not every:
            raise
        on = f" on {cache}" if cache else ""
        warnings.warn(f"--algo {ALL} leaves out {spec.name}{on}, which failed: {e}", UserWarning, stacklevel=2)
        return {"algo": spec.name, "failed": str(e)} | ({"cache_path": str(cache)} if cache else {})


def run(
    spec: RunSpec,
    cache: str | Path,
    out: str | Path,
    device: torch.device,
    call: str | None = None,
    keep_state: bool = False,
    tensorboard: str | Path | None = None,
    save_state: bool = False,
    progress=None,
    checkpoint_every: int | None = None,
    data: tuple[C.ClientData, C.ClientData] | None = None,
) -> dict:
    """`train` of a resolved `spec` on `device` (a torch.device), its outputs checked (`check_outputs`): what the
    CLI, a grid's retrain and reproduce call. `call` is the library call the result's provenance records (default:
    the `featcache.train` call of `spec`); `data` = (train, test) when the caller loaded them."""
    cache = as_path(cache, "cache")
    impl, cfg, seeds, backbones = spec.algo, spec.config, list(spec.seeds), spec.backbones
    train_data = data[0] if data else load_split(cache, impl, backbones=backbones)
    check_features(train_data, cache)
    check_clients(cfg, int(train_data.features.shape[0]))
    epochs = impl.bind(cfg).local_epochs()
    at_once = fit_at_once(impl, cfg, len(seeds), train_data, device, "use fewer --seeds")  # None: every participant
    test_data = data[1] if data else C.load_clients(cache, "test", backbones=backbones)
    check_split(test_data, "test", cache, NO_TEST_ROWS)
    counts = train_data.counts.tolist()
    for line in (
        one_step_note(impl, counts, cfg["batch_size"], cfg["drop_last"], epochs),
        dropped_note(counts, cfg["batch_size"], cfg["drop_last"]),
    ):
        if line:  # after every check: bad input stays its one error line
            warnings.warn(line, UserWarning, stacklevel=2)
    meta = test_data.meta
    ckpt = Checkpoint(
        out, spec.label(meta), impl, cfg, seeds, meta["key"], backbones or meta["backbones"], device, checkpoint_every
    )
    done = None if keep_state else ckpt.finished(save_state, tensorboard)
    if done:
        return done | {"cache_path": str(cache)}
    made = missing_folders(out)  # where a checkpoint would go: removed again if a refusal leaves them empty
    try:
        with ckpt.watch():
            raw = run_configs(
                impl,
                [cfg | {"seed": int(s)} for s in seeds],
                train_data,
                test_data,
                device,
                progress,
                checkpoint=ckpt,
                at_once=at_once,
            )
    except BaseException:
        remove_empty(made)
        raise
    files = {"save_state": save_state, "tensorboard": tensorboard}
    call = call or spec.call(cache, device)
    result, timing, paths = write_result(
        out, impl, cfg, seeds, meta, raw, device, call, backbones, None, ckpt.resumed, **files
    )
    ckpt.finish(paths | {"timing_file": str(Path(paths["result_file"]).with_suffix(".timing.json"))})
    kept = {"trained": raw["trained"]} if keep_state else {}
    return result | timing | paths | {"cache_path": str(cache)} | kept


def write_result(
    out,
    algo,
    cfg: dict,
    seeds,
    meta: dict,
    raw: dict,
    device,
    call: str,
    backbones=None,
    extra=None,
    resumed=0,
    **files,
) -> tuple[dict, dict, dict]:
    """Every run's result files (a Flower run's too), from `Engine.run`'s output `raw` of the bound `algo` at `cfg`
    for `seeds` on a cache of metadata `meta`: the result NAME.json (`extra` entries in its body), its timing (the
    rounds after the first `resumed`, which a checkpoint restored) and `write_run`'s sidecars (`files`: save_state,
    tensorboard). Returns (result, timing, paths written)."""
    floats = max(raw["upload_floats"])  # a round's most: FedDBE's first round uploads its means only
    result = {
        "algo": algo.name,
        "paper": algo.paper,
        "uploads": algo.uploads,
        "config": {k: v for k, v in cfg.items() if k != "seed"},
        "seeds": [int(s) for s in seeds],
        "cache": {"key": meta.get("key"), "dataset": meta.get("dataset"), "backbones": meta.get("backbones")},
        "backbones": list(backbones or meta.get("backbones") or []),
        "clients": int(raw["acc"].shape[-1]),
        "params_uploaded_per_round": int(floats),
        "bytes_uploaded_per_round": int(floats) * 4,
    } | (extra or {})
    result |= summarize(
        raw["acc"].numpy(), raw["eval_rounds"], none_or_numpy(raw["global_acc"]), raw["train_loss"].numpy()
    )
    run_id = hashlib.sha256(json.dumps(result, sort_keys=True, indent=1).encode()).hexdigest()[:12]
    result["cache"]["partition"] = meta.get("partition")  # for reports; the cache key above already fixes it
    result["provenance"] = provenance(device, call)
    body = json.dumps(result, sort_keys=True, indent=1)
    path = Path(out) / f"{run_name(algo, cfg, seeds, backbones, run_id, meta.get('partition'))}.json"
    ran = raw["round_seconds"][resumed:]  # this process's rounds: a resumed run's first ones ran elsewhere
    timing = {
        "seconds_per_round": round(float(np.mean(ran)), 5),
        "seconds_total": round(float(np.sum(ran)), 3),
        "rounds_timed": len(ran),
        "device": str(device),
    }
    timing |= {"resumed_after_round": resumed} if resumed else {}  # how it ran, not what it found
    return result, timing, write_run(path, body, timing, raw, result, **files)


def write_run(
    path: Path, body: str, timing: dict, raw: dict, result: dict, save_state: bool = False, tensorboard=None
) -> dict:
    """Write the result `body` to `path` with its sidecars (timing, metrics CSV, the state when asked for) and the
    TensorBoard run when asked for: all of them or none. Returns the paths written (None: not asked for)."""
    files: list[tuple[Path, str | bytes]] = [
        (path.with_suffix(".timing.json"), json.dumps(timing)),
        (path.with_suffix(".metrics.csv"), metrics_csv(raw, result["seeds"])),
    ]
    if save_state:
        files.append((path.with_suffix(SUFFIX), state_bytes(raw["trained"], result, path.name)))
    board = Path(tensorboard) / path.stem if tensorboard is not None else None
    tmp = tensorboard_run(board, raw, result["seeds"]) if board else None
    try:
        write_together([*files, (path, body)])
    except BaseException:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if tmp and board:
        commit_folder(tmp, board)
    return {
        "result_file": str(path),
        "metrics_csv": str(files[1][0]),
        "state_file": str(files[2][0]) if save_state else None,
        "tensorboard": str(board) if board else None,
    }


def none_or_numpy(t: torch.Tensor | None):
    return None if t is None else t.numpy()
