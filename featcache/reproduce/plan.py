"""Planning: a pipeline, a profile and the command line's overrides -> one job per table cell, shared where cells
train the same thing.

A job is everything that determines a training run's result (extraction, algorithm, settings, backbones, rounds,
seeds, grid or search) plus what its cells read beyond train()'s result (`needs`, see metrics.NEEDS). Cells that
differ only in what they read share one job with the union of their needs.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UserError, suggest
from ..extraction.plan import extract
from .metrics import METRICS
from .schema import SEARCH_DEFAULTS, Pipeline, Profile, Run

DEFAULT_PROFILE = "full"  # the papers' rounds and seeds, as the Make targets (PROFILE ?= full); `quick` is opt-in


@dataclass(frozen=True)
class Job:
    """One training run: everything that determines its result (and so its memo file)."""

    extract: str  # JSON of the resolved extract() keyword arguments
    algo: str
    settings: str  # JSON of the setting overrides
    rounds: int
    seeds: tuple[int, ...]
    backbones: tuple[int, ...] | None  # positions into extract's backbone list; None = all (the stored concat)
    grid: str  # JSON of the grid axes, "{}" for none
    needs: tuple[str, ...]  # outputs beyond train()'s result (metrics.NEEDS), e.g. probe | similarity | fixed
    search: str = "{}"  # JSON of the search's options (space, sampler, pruner, trials, rungs, reduction), "{}" for none

    @property
    def extract_kwargs(self) -> dict:
        return json.loads(self.extract)

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def trains(self) -> "Job":
        """The job without its needs: what it trains, which names its memo file."""
        return Job(**asdict(self) | {"needs": ()})

    def chosen(self, n_backbones: int) -> list[int]:
        """Positions of the backbones the job trains on, out of the extraction's `n_backbones`."""
        return list(self.backbones) if self.backbones is not None else list(range(n_backbones))


def resolve_extract(pipe: Pipeline, overrides: list[dict], dataset: str | None, data_root, backbones) -> dict:
    """[extract] + column/run/profile overrides + command-line overrides -> extract() keyword arguments."""
    ex = dict(pipe.extract)
    for o in overrides:
        ex |= o
    if dataset:
        ex["dataset"] = dataset
    elif data_root and pipe.paper_dataset:
        ex["dataset"] = pipe.paper_dataset
    if backbones:
        ex["backbone"] = list(backbones)
    if "backbone" not in ex:  # extract()'s own default, spelled out: the plan names the backbones of every cell
        ex["backbone"] = list(inspect.signature(extract).parameters["backbone"].default)
    for key in ("alpha", "val_fraction"):  # 1 and 1.0 are one setting: one job, one memo file
        if key in ex:
            ex[key] = float(ex[key])
    if isinstance(ex.get("domains"), dict):  # per-dataset domains: a dataset without an entry uses its defaults
        ex["domains"] = ex["domains"].get(ex.get("dataset", "offline-digits"))
    if data_root:
        ex["data_root"] = str(Path(data_root).resolve())
    return {k: v for k, v in ex.items() if v is not None}


def plan(
    pipe: Pipeline, profile: str = DEFAULT_PROFILE, dataset: str | None = None, data_root=None, backbones=None
) -> dict[tuple[str, str], Job]:
    """Every (row, column) cell the profile runs -> its job (a picks_backbone metric: the all-backbone job)."""
    if profile not in pipe.profiles:
        raise UserError(
            f"{pipe.path}: no profile {profile!r}{suggest(profile, pipe.profiles)}; known: {', '.join(pipe.profiles)}"
        )
    prof = pipe.profiles[profile]
    cells = {}
    for run in pipe.runs:
        if prof.rows and run.row not in prof.rows:
            continue
        for col in pipe.columns:
            if (run.columns and col.name not in run.columns) or (prof.columns and col.name not in prof.columns):
                continue
            ex = resolve_extract(pipe, [col.extract, run.extract, prof.extract], dataset, data_root, backbones)
            metric = METRICS[col.metric.partition(":")[0]]
            chosen = run.backbones if run.backbones is not None else col.backbones
            if metric.picks_backbone:  # one all-backbone job; the row's single backbone is the one read
                if chosen is None or len(chosen) != 1:
                    raise UserError(f"{pipe.path}: row {run.row!r} feeds a {col.metric} column: give backbones = [k]")
                _subset(pipe, run, chosen, ex["backbone"])  # in range
                chosen = None
            need = metric.need.name if metric.need and not metric.need.always else None
            cells[(run.row, col.name)] = Job(
                extract=json.dumps(ex, sort_keys=True),
                algo=run.algo,
                settings=json.dumps(pipe.set | col.set | run.set | prof.set, sort_keys=True),
                rounds=prof.rounds,
                seeds=prof.seeds,
                backbones=_subset(pipe, run, chosen, ex["backbone"]),
                grid=json.dumps(run.grid, sort_keys=True),
                needs=(need,) if need else (),
                search=_search(run, prof),
            )
            if run.grid and cells[(run.row, col.name)].backbones is not None:
                raise UserError(
                    f"{pipe.path}: row {run.row!r} has a grid and picks backbones: a grid selects on "
                    "every cached backbone; drop backbones or the grid"
                )
    return _merge_needs(cells)


def _search(run: Run, prof: Profile) -> str:
    """A row's search with every option spelled out and the profile's trial budget, which wins: "{}" for none."""
    if not run.search:
        return "{}"
    return json.dumps(SEARCH_DEFAULTS | run.search | ({"trials": prof.trials} if prof.trials else {}), sort_keys=True)


def _merge_needs(cells: dict) -> dict:
    """Cells that differ only in what they read share one job with the union of needs."""
    union: dict[Job, set] = {}
    for job in cells.values():
        union.setdefault(job.trains(), set()).update(job.needs)
    return {cell: Job(**asdict(job) | {"needs": tuple(sorted(union[job.trains()]))}) for cell, job in cells.items()}


def _subset(pipe: Pipeline, run: Run, chosen: tuple[int, ...] | None, names: list[str]) -> tuple[int, ...] | None:
    """Backbone positions a cell trains on; None when that is every backbone in order (the stored concat)."""
    if chosen is None or chosen == tuple(range(len(names))):
        return None
    if max(chosen) >= len(names):
        raise UserError(
            f"{pipe.path}: row {run.row!r} picks backbone {max(chosen)} but the extraction has "
            f"{len(names)} ({', '.join(names)}): pass {max(chosen) + 1} or more backbones"
        )
    return chosen
