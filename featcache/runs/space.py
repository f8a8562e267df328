"""What a search adds to the selection pipeline (`select.py`): its space, Optuna's samplers, the pruners' rungs and
the wave a study drives.

A space gives each setting a list of values (as `grid` takes them) or a range (`uniform:a,b`, `loguniform:a,b`,
`int:a,b`, `logint:a,b`). Optuna samples (seeded: random, TPE or grid) through its ask-and-tell interface; a batch of
asked trials (a "wave") trains as one [H, C] run. After each evaluation round every live trial reports its
validation accuracy (mean over clients, then over seeds); the trials a rung stops leave the batch.

Pruning is synchronous successive halving (Jamieson & Talwalkar 2016; Hyperband's inner loop, Li et al. 2018): the
trials of a wave reach a rung together, and the top ceil(n / η) of the n trials at that rung go on, counting the
rung values of earlier waves' trials, a tie at the boundary going on with them: one decision per rung, independent of
trial order. Optuna's pruners cannot make it: they decide one trial at a time as its report arrives (asynchronous
successive halving), so in a batch the kept trials depend on the order of reports. Hyperband runs such halving in
brackets that start at successive rungs, a trial's bracket drawn as Optuna's `HyperbandPruner` draws it.

A written wave replays (`Replay`) into a fresh study: the same asks, reports and decisions, checked.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError, as_list
from ..training.config import resolve, scoped, settings_of
from .metrics import mean_std
from .spec import axis_text, setting_values

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


def optuna_module():
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
    return (key, value.strip()) if re.match(r"^\s*[a-z]+:", value) else axis_text(text, "--space")


def _dim(algo, key: str, value, table) -> Dim:
    if isinstance(value, (list, tuple)):
        return Dim(key, "list", tuple(setting_values(algo, key, value, "--space")))
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


def read_saved(path: Path, valid, then: str) -> dict | None:
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


def is_wave(saved, n: int) -> bool:
    return (
        isinstance(saved, dict)
        and isinstance(saved.get("trials"), list)
        and len(saved["trials"]) == n
        and all(map(_is_trial, saved["trials"]))
    )


def is_result(saved, searched: dict) -> bool:
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


STATES = ("complete", "pruned", "failed")  # a trial's states, in the order the selection lists them


def score(record: dict) -> float:
    return -math.inf if record["val_mean"] is None else record["val_mean"]


def ranked(records: list[dict], folder: Path) -> list[dict]:
    """A search's trials, completed first by validation score, then pruned, then failed; one line when none
    completed."""
    table = sorted(records, key=lambda r: (STATES.index(r["state"]), -score(r), r["trial"]))
    if table[0]["state"] == "complete":
        return table
    failed = [r for r in table if r["state"] == "failed"]
    if len(failed) == len(table):
        why = failed[0].get("reason", "its loss became NaN/Inf")
        raise UserError(f"every trial of the search in {folder} failed (trial {failed[0]['trial']}: {why})")
    raise UserError(f"every trial of the search in {folder} was pruned: give more --trials or --pruner none")


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
    trials are told at once, the rest after the last round. `source(points)` gives the values (select's `Trainer`
    training them, or a `Replay` reading a written wave: the same calls, so the same study). Returns the wave's trial
    records."""
    optuna = optuna_module()
    asked = [study.ask(dists) for _ in range(n)]
    points = [{k: t.params[k] for k in dists} for t in asked]
    number = [t.number for t in asked]
    values_of = source(points)
    curves: list[list] = [[] for _ in range(n)]
    live, stopped, states = list(range(n)), [None] * n, ["complete"] * n
    pending = {number[i]: list(rule.plan(number[i])[1]) for i in live}
    per_seed: list[list[float]] = [[] for _ in range(n)]
    reasons: dict[int, str] = {}
    for step, values in values_of.steps(live):
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
        values_of.drop(pruned)
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


class Replay:
    """A written wave read back: the same points, values and decisions as when it trained (checked)."""

    def __init__(self, saved: list[dict], folder: Path):
        self.saved, self.folder = saved, folder

    def __call__(self, points: list[dict]) -> Replay:
        if points != [r["config"] for r in self.saved]:
            raise UserError(
                f"{self.folder} was written by another sampler (an Optuna or featcache version): remove the folder "
                "to search again"
            )
        return self

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
