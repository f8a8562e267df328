"""`featcache search`: a sampled hyperparameter search trained on the batched configuration axis, pruned as it goes.

A space gives each setting a list of values (as `grid` takes them) or a range (`uniform:a,b`, `loguniform:a,b`,
`int:a,b`, `logint:a,b`). Optuna samples (seeded: random, TPE or grid) through its ask-and-tell interface and
featcache trains: a batch of asked trials (a "wave") trains as one [H, C] engine run (H = trials x seeds; a
structural setting given as a list splits the batch into buckets, as grid does). After each evaluation round every
live trial reports its validation accuracy (mean over clients, then over seeds); the trials a rung stops leave the
batch, and the survivors go on in a fresh engine holding only their models (`engine.take_models`): the compute of
later rounds follows the survivors, and each survivor trains exactly as it would alone. Pruned trials keep their
curves; a trial whose loss turns NaN/Inf fails alone (its curve kept) and the others go on.

Pruning is synchronous successive halving (Jamieson & Talwalkar 2016; Hyperband's inner loop, Li et al. 2018): the
trials of a wave reach a rung together, and the top ceil(n / η) of the n trials at that rung go on, counting the
rung values of earlier waves' trials, a tie at the boundary going on with them: one decision per rung, independent of
trial order. Optuna's pruners cannot make it: they decide one trial at a time as its report arrives (asynchronous
successive halving), so in a batch the kept trials depend on the order of reports. Hyperband runs such halving in
brackets that start at successive rungs, a trial's bracket drawn as Optuna's `HyperbandPruner` draws it.

Resumable and deterministic: each finished wave is written to the run folder; a resumed search replays the
recorded waves into a fresh study (the same asks, reports and decisions, checked) and trains the first unwritten
one, so a search killed anywhere writes the bytes of one that was not. The best completed trial is retrained on the
full train split as grid does (`grid.retrain_best`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ..algorithms import plugin_exits
from ..atomic import check_folder, make_folder, missing_folders, remove_empty, write_atomic, write_together
from ..cache import load_clients
from ..cache.identity import content_key
from ..devices import resolve_device
from ..errors import UserError, as_list
from ..provenance import library_call, provenance
from ..threads import threaded
from ..training.config import check_clients, resolve, scoped, settings_of, structural_keys
from ..training.engine import Engine, take_models
from ..training.footprint import check_memory
from ..training.guards import NO_TEST_ROWS, NO_VAL_ROWS, check_features, check_split
from ..training.schedule import evaluates
from . import grid
from .metrics import mean_std
from .spec import RunSpec, given_once
from .train import load_split, surviving

STUDY = "featcache-search"  # the study's name: Hyperband assigns brackets by a hash of it and the trial number
RUNGS, REDUCTION = 2, 4  # the default rung schedule: the first rung at R / 16 (docs/guides/search.md: why)
MAX_TRIALS = 100_000  # each trial trains every seed and is kept in memory and in its wave's file


@dataclass(frozen=True)
class Dim:
    """One setting's space: `kind` (a key of KINDS, or "list") with its `values` (list) or range `low`, `high`."""

    key: str
    kind: str
    values: tuple = ()
    low: float = 0.0
    high: float = 0.0

    def as_json(self) -> dict | list:
        return list(self.values) if self.kind == "list" else {self.kind: [self.low, self.high]}

    def distribution(self, optuna):
        """The Optuna distribution sampling this setting."""
        if self.kind == "list":
            return optuna.distributions.CategoricalDistribution(list(self.values))
        return KINDS[self.kind](optuna, self.low, self.high)


# A range kind -> (its Optuna distribution, whether it is an integer range, whether it is logarithmic).
KINDS = {
    "uniform": lambda o, a, b: o.distributions.FloatDistribution(a, b),
    "loguniform": lambda o, a, b: o.distributions.FloatDistribution(a, b, log=True),
    "int": lambda o, a, b: o.distributions.IntDistribution(int(a), int(b)),
    "logint": lambda o, a, b: o.distributions.IntDistribution(int(a), int(b), log=True),
}
INTEGER = {"int", "logint"}
LOG = {"loguniform", "logint"}


def _optuna():
    """Optuna, imported when a search runs (the core install does not hold it); its per-trial log lines off."""
    try:
        import optuna
    except ImportError:
        raise UserError("featcache search needs Optuna: pip install 'featcache[search]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _sampler_random(optuna, space, seed, batch):
    return optuna.samplers.RandomSampler(seed=seed)


def _sampler_tpe(optuna, space, seed, batch):
    # the first wave samples at random (TPE's start-up), later waves from the model of the finished ones
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=batch)


def _sampler_grid(optuna, space, seed, batch):
    class Grid(optuna.samplers.GridSampler):
        def after_trial(self, study, trial, state, values) -> None:
            """Nothing: the grid's end is `--trials`, and `study.stop` raises outside `optimize` (ask-and-tell)."""

    return Grid({k: list(d.values) for k, d in space.items()}, seed=seed)


SAMPLERS = {"random": _sampler_random, "tpe": _sampler_tpe, "grid": _sampler_grid}


def _pruner_none(number: int, rungs: list[int], reduction: int) -> tuple[int, list[int]]:
    return 0, []


def _pruner_halving(number: int, rungs: list[int], reduction: int) -> tuple[int, list[int]]:
    return 0, rungs


def _pruner_hyperband(number: int, rungs: list[int], reduction: int) -> tuple[int, list[int]]:
    # brackets b = 0..len(rungs) halve from rung b on (the last trains all rounds), drawn by Optuna's budgets and hash
    n = len(rungs) + 1
    budgets = [math.ceil(n * reduction ** (n - 1 - b) / (n - b)) for b in range(n)]
    pick = zlib.crc32(f"{STUDY}_{number}".encode()) % sum(budgets)
    b = next(b for b in range(n) if pick < sum(budgets[: b + 1]))
    return b, rungs[b:]


# A pruner: trial number, rung rounds, η -> (the trial's bracket, the rounds it is decided at).
PRUNERS = {"none": _pruner_none, "halving": _pruner_halving, "hyperband": _pruner_hyperband}


def at_rung(curve: list, at: int) -> float | None:
    """A trial's rung value: its first validation score at or after round `at` (None if it stopped before)."""
    return next((v for step, v in curve if step >= at), None)


def survivors(population: dict, live: list, reduction: int) -> list:
    """Synchronous successive halving at one rung: of `population` {trial: rung value} (this wave's and earlier
    waves'), the `live` trials among the top ceil(n / η), all trials tied with the last kept one included."""
    ranked = sorted(population.values(), reverse=True)
    bar = ranked[math.ceil(len(ranked) / reduction) - 1]
    return [i for i in live if population[i] >= bar]


# Settings a space cannot hold, and why.
FIXED = {
    "rounds": "the rounds are the pruner's budget, one for every trial: give --rounds",
    "seed": "every trial trains every seed: give --seeds",
}


def parse_space(algo, space: list[str] | dict) -> dict[str, Dim]:
    """A search space, typed and strict: ['lr=loguniform:1e-4,1e-1', 'mu=0,0.1,1'] or {'lr': 'loguniform:1e-4,1e-1',
    'mu': [0, 0.1, 1]} -> {key: Dim}. A range is refused when empty or inverted, a log range when it touches 0, a
    range over a structural setting (not batchable) by name; every value and endpoint is checked as a setting."""
    given = space.items() if isinstance(space, dict) else (_item(text) for text in as_list(space, "space") or [])
    table, dims = settings_of(algo), {}
    for key, value in given:
        key = next(iter(scoped({str(key).strip(): ""}, [algo], "--space")[algo.name]))
        if key in FIXED:
            raise UserError(f"--space {key}: {FIXED[key]}")
        if key in dims:
            raise UserError(f"--space {key} is given twice: give one list or range per setting")
        dims[key] = _dim(algo, key, value, table)
    if not dims:
        raise UserError("no --space given: e.g. --space lr=loguniform:1e-4,1e-1")
    return dims


def _item(text: str) -> tuple[str, object]:
    """'lr=loguniform:1e-4,1e-1' -> ('lr', 'loguniform:1e-4,1e-1'); 'mu=0,1' -> ('mu', ['0', '1'])."""
    key, sep, value = text.partition("=")
    if not sep or not value.strip():
        raise UserError(f"--space {text!r}: write key=v1,v2,... or key=uniform:low,high (loguniform, int, logint)")
    if re.match(r"^\s*[a-z]+:", value):
        return key, value.strip()
    values = [v.strip() for v in value.split(",")]
    if "" in values:
        raise UserError(f"--space {text!r} has an empty value: write key=v1,v2,...")
    return key, values


def _dim(algo, key: str, value, table) -> Dim:
    if isinstance(value, (list, tuple)):
        if not value:
            raise UserError(f"--space {key}: give at least one value")
        values = [resolve(algo, {key: v})[key] for v in value]
        if len(set(map(repr, values))) < len(values):
            raise UserError(f"--space {key} lists a value twice: each value once")
        return Dim(key, "list", tuple(values))
    kind, _, ends = str(value).partition(":")
    kind = kind.strip()
    text = f"{key}={value}"
    if kind not in KINDS:
        raise UserError(f"--space {text}: unknown range {kind!r}; use {', '.join(KINDS)} (or a list v1,v2,...)")
    parts = [p.strip() for p in ends.split(",")]
    try:
        low, high = (float(p) for p in parts)
    except ValueError:
        raise UserError(f"--space {text}: write {kind}:low,high with two numbers") from None
    if not table[key].batched:
        raise UserError(
            f"--space {text}: {key} is structural (it fixes a shape or an option of the batched run, so it cannot be "
            f"sampled): give it a list of values, e.g. --space {key}=v1,v2"
        )
    if not low < high:
        raise UserError(f"--space {text}: the range is empty or inverted: write {kind}:low,high with low < high")
    if kind in LOG and low <= 0:
        raise UserError(f"--space {text}: a log range must lie above 0: give low > 0 (or use uniform/int)")
    if kind in INTEGER and (low != int(low) or high != int(high)):
        raise UserError(f"--space {text}: an integer range takes integer ends")
    if kind not in INTEGER and isinstance(table[key].default, int):
        raise UserError(f"--space {text}: {key} is an integer setting: use int:{low:g},{high:g} or logint")
    for end in (low, high):
        resolve(algo, {key: int(end) if kind in INTEGER else end})  # a setting's own range, in one line
    return Dim(key, kind, (), low, high)


def rung_rounds(rounds: int, pruner: str, rungs: int, reduction: int) -> list[int]:
    """The rounds a halving pruner decides at: ceil(R / η^rungs), then η times later each, all before the last round
    (none without a pruner). Too few rounds for that many rungs is refused in one line."""
    if pruner == "none":
        return []
    first = math.ceil(rounds / reduction**rungs)
    at = [first * reduction**k for k in range(rungs)]
    if at[-1] >= rounds:
        raise UserError(
            f"--pruner {pruner} with {rungs} rung(s) (reduction {reduction}) needs more than {at[-1]} rounds, got "
            f"--rounds {rounds}: give more rounds or fewer --rungs"
        )
    return at


def check_options(
    sampler: str, pruner: str, trials: int, batch: int | None, rungs: int, reduction: int, sampler_seed: int = 0
) -> None:
    """A search's sampler and pruner (keys of SAMPLERS, PRUNERS), its counts and seed, checked before anything is
    read."""
    if sampler not in SAMPLERS:
        raise UserError(f"unknown sampler {sampler!r}: use {', '.join(SAMPLERS)}")
    if pruner not in PRUNERS:
        raise UserError(f"unknown pruner {pruner!r}: use {', '.join(PRUNERS)}")
    for flag, n, lo in (
        ("--trials", trials, 1),
        ("--batch", batch, 1),
        ("--rungs", rungs, 1),
        ("--reduction", reduction, 2),
    ):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < lo):
            raise UserError(f"{flag} {n}: give a whole number >= {lo}")
    if trials > MAX_TRIALS:
        raise UserError(f"--trials {trials}: a search trains at most {MAX_TRIALS:,} trials; give fewer")
    if isinstance(sampler_seed, bool) or not isinstance(sampler_seed, int) or not 0 <= sampler_seed < 2**32:
        raise UserError(f"--sampler-seed {sampler_seed}: give a whole number from 0 to 2^32 - 1 (Optuna's seeds)")


def search_options(
    trials: int = 16,
    sampler: str = "random",
    pruner: str = "halving",
    batch: int | None = None,
    sampler_seed: int = 0,
    rungs: int | None = None,
    reduction: int | None = None,
) -> dict:
    """A search's options checked (`check_options`), the rung schedule's defaults filled in: the keyword arguments of
    `run_search`, as `featcache.search` and the command line both build them."""
    rungs, reduction = RUNGS if rungs is None else rungs, REDUCTION if reduction is None else reduction
    check_options(sampler, pruner, trials, batch, rungs, reduction, sampler_seed)
    return dict(
        trials=trials,
        sampler=sampler,
        pruner=pruner,
        batch=batch,
        sampler_seed=sampler_seed,
        rungs=rungs,
        reduction=reduction,
    )


def check_sampler(dims: dict[str, Dim], sampler: str, trials: int) -> None:
    """The grid sampler takes lists only, and at most as many trials as its grid holds points."""
    if sampler != "grid":
        return
    ranged = [k for k, d in dims.items() if d.kind != "list"]
    if ranged:
        raise UserError(f"--sampler grid takes lists only; {ranged[0]} is a range: use random or tpe")
    size = math.prod(len(d.values) for d in dims.values())
    if trials > size:
        raise UserError(f"--trials {trials} with --sampler grid: the grid holds {size} points, give at most that")


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
    rungs: int = RUNGS,
    reduction: int = REDUCTION,
    retrain: bool = True,
    progress=None,
    threads: int | None = None,
) -> dict:
    """Search `space` with `trials` trials, each trained for every seed on train-minus-validation; select the best
    completed trial on validation, retrain it on the full train split, report test mean(std). Resumable by run folder.

    `space`: `key=v1,v2` or `key=KIND:low,high` strings (KIND: uniform, loguniform, int, logint) or a dict of lists or
    such strings. `sampler` (random | tpe | grid, seeded by `sampler_seed`) picks the trials, `batch` at a time (one
    batched run each; default: all of them, a quarter for tpe so that later batches learn from earlier ones);
    `pruner` (none | halving | hyperband) stops trials at `rungs` rungs `reduction` times apart (η)."""
    options = search_options(trials, sampler, pruner, batch, sampler_seed, rungs, reduction)
    spec = RunSpec.resolve(algo, rounds, seeds, set, backbones)
    dims = parse_space(spec.algo, space)
    given_once(spec.algo, dims, set, rounds, "--space setting")
    call = library_call(
        "featcache.search",
        cache=str(cache),
        algo=algo,
        space=space if isinstance(space, dict) else as_list(space, "space"),
        seeds=list(spec.seeds),
        rounds=rounds,
        set=set,
        device=str(device),
        retrain=retrain,
        **options,
        **({"backbones": list(spec.backbones)} if spec.backbones else {}),
    )
    return run_search(spec, dims, cache, out, device, retrain, progress, call, **options)


def run_search(
    spec: RunSpec,
    dims: dict[str, Dim],
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
    rungs: int = RUNGS,
    reduction: int = REDUCTION,
) -> dict:
    """`search` of a resolved `spec` and parsed space `dims` (what the CLI calls). The run folder `search-ALGO-KEY16`
    is named by what it searches; a finished one returns its result without training (or only retrains its best,
    when it finished without a retrain and one is asked for now)."""
    optuna = _optuna()
    check_options(sampler, pruner, trials, batch, rungs, reduction, sampler_seed)
    R = spec.config["rounds"]
    rung_at = rung_rounds(R, pruner, rungs, reduction)
    check_sampler(dims, sampler, trials)
    batch = min(batch or (max(1, math.ceil(trials / 4)) if sampler == "tpe" else trials), trials)
    dev = resolve_device(device)
    check_folder(out)
    impl, backbones, seeds = spec.algo, spec.backbones, list(spec.seeds)
    fit = load_split(cache, impl, holdout="fit", backbones=backbones)
    check_features(fit, cache)
    val = load_clients(cache, "train", holdout="val", backbones=backbones)
    check_split(val, "validation", cache, NO_VAL_ROWS)
    test = load_clients(cache, "test", backbones=backbones) if retrain else None
    if test is not None:
        check_split(test, "test", cache, NO_TEST_ROWS)
    check_clients(spec.config, fit.features.shape[0])
    check_memory(impl, spec.config, batch * len(seeds), fit, dev, "use a smaller --batch")
    space = {k: d.as_json() for k, d in dims.items()}
    searched = {
        "space": space,
        "trials": trials,
        "sampler": sampler,
        "pruner": pruner,
        "batch": batch,
        "sampler_seed": sampler_seed,
        "rungs": rung_at,
        "reduction": reduction,
        "rule": "synchronous",
        "optuna": optuna.__version__,
    }
    key = content_key({"run": spec.key(fit.meta), "search": searched})
    folder = Path(out) / f"search-{spec.name}-{key[:16]}"
    finished = _read(folder / "search.json", lambda r: _is_result(r, searched), "its finished waves are replayed")
    if finished and (not retrain or "retrain" in finished):  # its result, nothing trained
        return finished | {"waves_resumed": "all"}
    made = missing_folders(folder)
    make_folder(folder)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.create_study(
                study_name=STUDY, direction="maximize", sampler=SAMPLERS[sampler](optuna, dims, sampler_seed, batch)
            )  # Optuna's own pruner stays off: `drive` decides the rungs
        dists = {k: d.distribution(optuna) for k, d in dims.items()}
        rule = Rungs(PRUNERS[pruner], rung_at, reduction)
        waves = [min(batch, trials - start) for start in range(0, trials, batch)]
        records: list[dict] = []
        resumed = 0
        for w, n in enumerate(waves):
            path = folder / f"wave-{w:03d}.json"
            if path.is_file():
                saved = cast(dict, _read(path, lambda r: _is_wave(r, n), "that wave trains again"))["trials"]
                if json.loads(json.dumps(drive(study, dists, n, Replay(saved, folder), rule, records))) != saved:
                    raise UserError(f"{path} does not replay to the same decisions: remove {folder} to search again")
                resumed += 1
            else:
                tick = _ticker(progress, sum(waves[:w]) * R, trials * R)
                trainer = Trainer(impl, spec.config, seeds, fit, val, dev, tick)
                saved = drive(study, dists, n, trainer, rule, records)
                write_atomic(path, json.dumps({"trials": saved}, sort_keys=True, indent=1))
            records += saved
            if progress:
                progress("search trials", sum(waves[: w + 1]), trials)
        table = sorted(records, key=lambda r: (STATES.index(r["state"]), -_score(r), r["trial"]))
        done = [r for r in table if r["state"] == "complete"]
        if not done:
            failed = [r for r in table if r["state"] == "failed"]
            if len(failed) == len(table):
                why = failed[0].get("reason", "its loss became NaN/Inf")
                raise UserError(f"every trial of the search in {folder} failed (trial {failed[0]['trial']}: {why})")
            raise UserError(f"every trial of the search in {folder} was pruned: give more --trials or --pruner none")
        model_rounds = sum(r["rounds_trained"] for r in records) * len(seeds)
        result = {
            "algo": spec.name,
            "cache": str(cache),
            "seeds": seeds,
            "rounds": R,
            "clients": int(fit.features.shape[0]),
            "model_rounds": model_rounds,
            "model_rounds_unpruned": trials * len(seeds) * R,
            "device": str(dev),
            "run_folder": str(folder),
            "selection": table,
            "best": done[0]["config"],
        } | searched
        result |= {"backbones": list(backbones)} if backbones else {}
        if test is not None:
            del fit, val  # the trials' rows: the retrain reads the full train split
            result["retrain"] = grid.retrain_best(
                spec, done[0]["config"], cache, folder, dev, test, progress, "search retrain"
            )
        result["provenance"] = provenance(dev, call or library_call("featcache.search", cache=str(cache)))
        write_together(
            [
                (folder / "search.csv", to_csv(table)),  # all three or none; search.json last: its presence
                (folder / "search.timing.json", json.dumps({"waves_resumed": resumed})),  # means the folder is
                (folder / "search.json", json.dumps(result, sort_keys=True, indent=1)),  # complete
            ]
        )
    except BaseException:
        remove_empty(made)
        raise
    return result | {"waves_resumed": resumed}


def _read(path: Path, valid, then: str) -> dict | None:
    """The JSON object a search wrote at `path` (None when absent), or one line naming it as damaged when it does not
    parse or `valid` refuses it."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        ok = valid(saved)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError):
        ok = False
    if not ok:
        raise UserError(
            f"{path} is damaged (not what `featcache search` writes there): remove it and run the search again ({then})"
        )
    return saved


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_trial(r) -> bool:
    """Whether `r` is a trial's record as `drive` writes it."""
    return (
        isinstance(r, dict)
        and isinstance(r.get("trial"), int)
        and isinstance(r.get("config"), dict)
        and r.get("state") in STATES
        and isinstance(r.get("rounds_trained"), int)
        and isinstance(r.get("curve"), list)
        and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and _number(p[1]) for p in r["curve"])
        and isinstance(r.get("val_per_seed"), list)
        and all(map(_number, r["val_per_seed"]))
        and all(r.get(k) is None or _number(r[k]) for k in ("val_mean", "val_std"))
        and isinstance(r.get("reason", ""), str)
    )


def _is_wave(saved, n: int) -> bool:
    return (
        isinstance(saved, dict)
        and isinstance(saved.get("trials"), list)
        and len(saved["trials"]) == n
        and all(map(_is_trial, saved["trials"]))
    )


def _is_result(saved, searched: dict) -> bool:
    """Whether `saved` is the result of the search `searched` describes, with its trials and best point."""
    return (
        isinstance(saved, dict)
        and all(saved.get(k) == v for k, v in json.loads(json.dumps(searched)).items())
        and isinstance(saved.get("selection"), list)
        and all(map(_is_trial, saved["selection"]))
        and isinstance(saved.get("best"), dict)
        and all(_number(saved.get(k)) for k in ("model_rounds", "model_rounds_unpruned"))
        and isinstance(saved.get("seeds"), list)
        and isinstance(saved.get("retrain", {}), dict)
    )


def _ticker(progress, base: int, total: int):
    """progress("search rounds", done, total) in trial-rounds of the whole search (pruned trials count in full)."""
    if not progress:
        return None
    return lambda done: progress("search rounds", base + done, total)


STATES = ("complete", "pruned", "failed")  # a trial's states, in the order the selection lists them


def _score(record: dict) -> float:
    return -math.inf if record["val_mean"] is None else record["val_mean"]


@dataclass(frozen=True)
class Rungs:
    """Where a pruner decides (its function of PRUNERS, the rung rounds, η) and the decision: synchronous halving."""

    pruner: Callable[[int, list[int], int], tuple[int, list[int]]]
    at: list[int]
    reduction: int

    def plan(self, number: int) -> tuple[int, list[int]]:
        """Trial `number`'s bracket and the rounds it is decided at."""
        return self.pruner(number, self.at, self.reduction)

    def decide(self, wave: dict[int, list], history: list[dict], pending: dict[int, list[int]]) -> list[int]:
        """The trials of `wave` {trial: curve so far} that stop now: at each rung every one of them still `pending`
        has reached (its rounds removed from `pending`), a bracket's trials are ranked with the rung values of the
        same bracket's trials in `history` (earlier waves' records), and those below the top ceil(n / η) stop."""
        stop: list[int] = []
        for at in sorted({a for rounds in pending.values() for a in rounds}):
            brackets: dict[int, list[int]] = {}
            for t in [t for t, rounds in pending.items() if at in rounds and t not in stop]:
                brackets.setdefault(self.plan(t)[0], []).append(t)
            for b, group in sorted(brackets.items()):
                if any(at_rung(wave[t], at) is None for t in group):
                    continue  # the rung is decided when the whole group has reached it
                population = {r["trial"]: at_rung(r["curve"], at) for r in history if self.plan(r["trial"])[0] == b}
                population = {t: v for t, v in population.items() if v is not None}
                population |= {t: at_rung(wave[t], at) for t in group}
                kept = survivors(population, group, self.reduction)
                stop += [t for t in group if t not in kept]
                for t in group:
                    pending[t].remove(at)
        return stop


def drive(study, dists: dict, n: int, source, rule: Rungs, history: list[dict]) -> list[dict]:
    """One wave: ask `n` trials, report each live trial's validation accuracy after each evaluation round, and stop
    at each rung the trials `rule` stops (given the earlier waves' records `history`); pruned and failed (NaN/Inf)
    trials are told at once, the rest after the last round. `source` gives the values (a `Trainer` training them, or
    a `Replay` reading a written wave: the same calls, so the same study). Returns the wave's trial records."""
    optuna = _optuna()
    asked = [study.ask(dists) for _ in range(n)]
    points = [{k: t.params[k] for k in dists} for t in asked]
    number = [t.number for t in asked]
    source.start(points)
    curves: list[list] = [[] for _ in range(n)]
    live, stopped, states = list(range(n)), [None] * n, ["complete"] * n
    pending = {number[i]: list(rule.plan(number[i])[1]) for i in live}
    per_seed: list[list[float]] = [[] for _ in range(n)]
    reasons: dict[int, str] = {}
    for step, values in source.steps(live):
        failed = []
        for i in [i for i in live if i in values]:
            v, seeds = values[i]
            if not math.isfinite(v):
                failed.append(i)
                if isinstance(seeds, str):
                    reasons[i] = seeds
                continue
            curves[i].append([step, v])
            per_seed[i] = seeds
            asked[i].report(v, step)
        for i in failed:
            study.tell(asked[i], state=optuna.trial.TrialState.FAIL)
            stopped[i], states[i] = step, "failed"
            del pending[number[i]]
        stop = rule.decide({number[i]: curves[i] for i in live}, history, pending)
        pruned = [i for i in live if number[i] in stop]
        for i in pruned:
            study.tell(asked[i], state=optuna.trial.TrialState.PRUNED)
            stopped[i], states[i] = step, "pruned"
            del pending[number[i]]
        live = [i for i in live if i not in pruned and i not in failed]
        source.drop(pruned)
    for i in live:
        study.tell(asked[i], curves[i][-1][1])
    return [
        {
            "trial": number[i],
            "config": points[i],
            "state": states[i],
            "rounds_trained": stopped[i] or curves[i][-1][0],
            "val_mean": curves[i][-1][1] if curves[i] else None,
            "val_std": mean_std(per_seed[i])[1] if per_seed[i] else None,
            "val_per_seed": per_seed[i],
            "curve": curves[i],
        }
        | ({"reason": reasons[i]} if i in reasons else {})
        for i in range(n)
    ]


class Trainer:
    """A wave's trials trained: one engine per bucket (trials that share their structural settings), models = trials
    x seeds on H, run round by round; `drop` moves a bucket's survivors to a fresh engine of their models alone."""

    def __init__(self, algo, config: dict, seeds: list[int], fit, val, device, tick=None):
        self.algo, self.config, self.seeds, self.fit, self.val, self.device, self.tick = (
            algo,
            config,
            seeds,
            fit,
            val,
            device,
            tick,
        )

    def start(self, points: list[dict]) -> None:
        cfgs = [self.config | p for p in points]
        groups: dict[str, list[int]] = {}
        for i, c in enumerate(cfgs):
            groups.setdefault(json.dumps({k: c[k] for k in structural_keys(c, self.algo)}, sort_keys=True), []).append(
                i
            )
        self.cfgs = cfgs
        self.buckets: list[list[Any]] = []  # [engine, its models (trial, seed)] per bucket
        for members in groups.values():
            models = [(i, s) for i in members for s in self.seeds]  # trials x seeds share the H axis
            with plugin_exits():
                engine = Engine(self.algo, self._configs(models), self.fit, self.val, self.device)
            self.buckets.append([engine, models])
        self.done = 0

    def _configs(self, models) -> list[dict]:
        return [self.cfgs[i] | {"seed": int(s)} for i, s in models]

    def steps(self, live: list[int]):
        """(round, {trial: (validation accuracy %, per seed)}) after each round some bucket evaluates: mean over the
        clients per seed, then over the seeds; (NaN, its one-line reason) for a trial that diverged, which leaves."""
        R = self.config["rounds"]
        for rnd in range(R):
            values: dict = {}
            for bucket in [b for b in self.buckets if evaluates(rnd, b[0].cfg)]:
                self._run(bucket, rnd + 1, values)  # the rounds up to the next evaluation in one go
                engine, models = bucket
                if models:
                    acc = engine.loop.records[-1]["test_acc"]  # [H, C]
                    for (i, _seed), per_client in zip(models, (100 * acc).tolist()):
                        values.setdefault(i, []).append(float(np.mean(per_client)))
            if self.tick:
                self.done += 1
                self.tick(self.done * len(self.cfgs))
            self.buckets = [b for b in self.buckets if b[1]]
            if values:
                yield (
                    rnd + 1,
                    {i: (math.nan, v) if isinstance(v, str) else (mean_std(v)[0], v) for i, v in values.items()},
                )

    def _run(self, bucket: list, until: int, values: dict) -> None:
        """A bucket trained to round `until`; where a model's loss turns NaN/Inf, its trial is marked failed in
        `values` and the others train again from round 0 without it (each survivor trains as alone: the same
        numbers)."""

        def train(models: list) -> None:
            with plugin_exits():
                if models != bucket[1]:  # some failed: the rest from round 0 without them
                    bucket[:] = [Engine(self.algo, self._configs(models), self.fit, self.val, self.device), models]
                bucket[0].run(logs=False, until=until)

        _, bucket[1], failed = surviving(train, bucket[1], same=lambda m: m[0])  # m = (trial, seed)
        values.update({m[0]: reason for m, reason in failed.items()})

    def drop(self, pruned: list[int]) -> None:
        if not pruned:
            return
        out = []
        for engine, models in self.buckets:
            keep = [h for h, (i, _) in enumerate(models) if i not in pruned]
            if len(keep) == len(models):
                out.append([engine, models])
            elif keep:
                survivors = [models[h] for h in keep]
                with plugin_exits():
                    fresh = Engine(self.algo, self._configs(survivors), self.fit, self.val, self.device)
                fresh.load_state_dict(take_models(engine.state_dict(), keep))
                out.append([fresh, survivors])
        self.buckets = out


class Replay:
    """A written wave read back: the same points, values and decisions as when it trained (checked)."""

    def __init__(self, saved: list[dict], folder: Path):
        self.saved, self.folder = saved, folder

    def start(self, points: list[dict]) -> None:
        if points != [r["config"] for r in self.saved]:
            raise UserError(
                f"{self.folder} was written by another sampler (an Optuna or featcache version): remove the folder "
                "to search again"
            )

    def steps(self, live: list[int]):
        curves = [dict(r["curve"]) for r in self.saved]
        for i, r in enumerate(self.saved):
            if r["state"] == "failed":
                curves[i][r["rounds_trained"]] = math.nan
        for step in sorted({step for c in curves for step in c}):
            yield (
                step,
                {
                    i: (
                        c[step],
                        self.saved[i].get("reason", []) if math.isnan(c[step]) else self.saved[i]["val_per_seed"],
                    )
                    for i, c in enumerate(curves)
                    if step in c
                },
            )

    def drop(self, pruned: list[int]) -> None:
        pass


def to_csv(table: list[dict]) -> str:
    keys = list(table[0]["config"])
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["trial", *keys, "val_mean", "val_std", "state", "rounds_trained"])
    for r in table:
        w.writerow(
            [
                r["trial"],
                *(r["config"][k] for k in keys),
                "" if r["val_mean"] is None else f"{r['val_mean']:.4f}",
                "" if r["val_std"] is None else f"{r['val_std']:.4f}",
                r["state"],
                r["rounds_trained"],
            ]
        )
    return buf.getvalue()
