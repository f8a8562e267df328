"""A run resolved once: `RunSpec` holds what a `train` or `grid` run trains, checked and typed, and its one content
key.

The CLI, the API (`featcache.train`, `featcache.grid`) and `reproduce` each resolve a spec once from what they were
given (`RunSpec.resolve`: the algorithm, its settings with `--rounds` merged in, the seeds, the backbones and, for a
grid, its axes) and hand the spec to `train.run` / `select.run_grid`, which never parse a setting again. A grid's
retrain is the spec of its best point (`pick`).

`key(cache)` is a content key over what the run trains on which cache: the algorithm's name, the resolved settings,
the seeds, the cache's content key (never its path: a moved or copied cache keeps its runs), the backbones trained on
(all of the cache's, in order, when none are chosen) and a grid's axes. `label(cache)`, `ALGO-KEY16`, names the
checkpoint (`.LABEL.checkpoint`, `.LABEL.done`), the grid's run folder (`grid-LABEL`) and reproduce's job memo
(`jobs/LABEL.json`). A result file is named by its body (names.py), so equal numbers give one name.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from ..algorithms import create
from ..cache.identity import content_key
from ..errors import UserError, as_list
from ..provenance import library_call
from ..training.config import check, check_seeds, defaults, merge_rounds, resolve, scoped


@dataclass(frozen=True)
class RunSpec:
    """What one run trains: `algo` (the bound algorithm: registered name, declared settings), `source` (how it was
    named: a registered name or a plug-in spec, by which a Ray worker loads it), `config` (its resolved settings,
    rounds included, no seed; read, never changed), `seeds`, `backbones` (the cached backbones chosen, in order;
    None: all of them) and, for a grid, `axes` (setting -> its typed, checked values)."""

    algo: Any
    source: str
    config: dict
    seeds: tuple[int, ...]
    backbones: tuple[str, ...] | None = None
    axes: dict[str, list] = field(default_factory=dict)

    @classmethod
    def resolve(
        cls,
        algo: str,
        rounds: int | None = None,
        seeds=(0, 1, 2),
        set: list[str] | dict | None = None,
        backbones: list[str] | None = None,
        grid: list[str] | dict | None = None,
    ) -> RunSpec:
        """The spec of a run from what a user gives (`set`: `key=value` strings or a dict of values; `grid`: `key=v1,v2`
        strings or a dict of value lists), every setting and every grid point checked: an unknown key, a wrong type
        or a value out of range is one line before anything is read or trained."""
        seeds = check_seeds(seeds)
        impl = create(algo)
        overrides = merge_rounds(set, rounds)
        config = resolve(impl, overrides)
        chosen = as_list(backbones, "backbones")  # backbones="dino" is one backbone, not four letters
        spec = cls(impl, algo, config, tuple(seeds), tuple(chosen) if chosen else None)
        if grid is None:
            return spec
        axes = grid_axes(impl, grid)
        given_once(impl, axes, set, rounds, "--grid axis")
        spec = replace(spec, axes=axes)
        for c in spec.configs():  # the whole grid, every combination, before anything trains
            check(impl, c)
        return spec

    @property
    def name(self) -> str:
        """The algorithm's registered name (a plug-in's too)."""
        return self.algo.name

    def points(self) -> list[dict]:
        """A grid's points, `{axis: value}` in the order of `itertools.product` ([{}] for one run)."""
        return [dict(zip(self.axes, values)) for values in itertools.product(*self.axes.values())]

    def configs(self) -> list[dict]:
        """The resolved settings of every point (one for a run without axes)."""
        return [self.config | p for p in self.points()]

    def pick(self, point: dict) -> RunSpec:
        """The run of one grid point: its settings fixed, no axes (a grid's retrain)."""
        return replace(self, config=self.config | point, axes={})

    def key(self, cache: dict) -> str:
        """The run's content key on `cache` (its metadata: content `key` and `backbones`)."""
        trains = {
            "algo": self.name,
            "config": self.config,
            "seeds": list(self.seeds),
            "cache": cache["key"],
            "backbones": list(self.backbones or cache["backbones"]),
        }
        return content_key(trains | ({"axes": self.axes} if self.axes else {}))

    def label(self, cache: dict) -> str:
        """`ALGO-KEY16`: the name of the run's checkpoint, grid folder and job memo."""
        return f"{self.name}-{self.key(cache)[:16]}"

    def call(self, cache, device, **options) -> str:
        """The library call that trains this run, as a result's provenance records it: `featcache.train`, or
        `featcache.grid` with its axes and `options` (backend, chunk, retrain); settings that differ from the
        algorithm's defaults under `set`."""
        base = defaults(self.algo)
        changed = {k: v for k, v in self.config.items() if v != base[k]}
        picked = {"backbones": list(self.backbones)} if self.backbones else {}
        axes = {"grid": self.axes} if self.axes else {}
        return library_call(
            "featcache.grid" if self.axes else "featcache.train",
            cache=str(cache),
            algo=self.source,
            **axes,
            seeds=list(self.seeds),
            set=changed,
            device=str(device),
            **options,
            **picked,
        )


def given_once(impl, keys, set, rounds, what: str) -> None:
    """Refuse a setting among `keys` (a grid's axes, a search's space) that `set` or `rounds` also fixes."""
    fixed = scoped(merge_rounds(set, rounds), [impl])[impl.name]
    both = [k for k in keys if k in fixed]
    if both:
        flag = "--rounds" if both[0] == "rounds" and rounds is not None else f"--set {both[0]}"
        raise UserError(f"{both[0]} is both a {what} and {flag}: give it in one place")


def grid_axes(algo, grid: list[str] | dict) -> dict[str, list]:
    """A grid's axes, typed and strict: ['lr=1e-1,1e-2', 'weight_decay=1e-3'] or {'lr': [0.1, 0.01], ...} ->
    {'lr': [0.1, 0.01], 'weight_decay': [0.001]}. Every value of every axis is checked against its setting's range;
    an axis or a value given twice is refused; `fedprox.mu` is fedprox's mu, for fedprox only."""
    given = grid.items() if isinstance(grid, dict) else (axis_text(item) for item in as_list(grid, "grid") or [])
    axes: dict[str, list] = {}
    for key, values in given:
        key = next(iter(scoped({str(key).strip(): ""}, [algo], "--grid")[algo.name]))
        if key in axes:
            raise UserError(f"--grid {key} is given twice: put all its values in one axis, e.g. --grid {key}=a,b")
        axes[key] = setting_values(algo, key, values, "--grid")
    if not axes:
        raise UserError("no --grid axis given: e.g. --grid lr=1e-1,1e-2,1e-3")
    return axes


def setting_values(algo, key: str, values, flag: str) -> list:
    """One setting's values (a grid's axis, a search's list), each checked as the setting (unknown key, bad type,
    out of range: one line); refused when not a non-empty list or when a value repeats."""
    if not isinstance(values, (list, tuple)) or not values:
        raise UserError(f"{flag} {key}: give a list of values, e.g. {flag} {key}=v1,v2 or {{'{key}': [v1, v2]}}")
    typed = [resolve(algo, {key: v})[key] for v in values]
    twice = [v for i, v in enumerate(typed) if v in typed[:i]]
    if twice:
        raise UserError(f"{flag} {key} lists {twice[0]!r} twice: each value once")
    return typed


def axis_text(item: str, flag: str = "--grid") -> tuple[str, list[str]]:
    """'lr=1e-1,1e-2' -> ('lr', ['1e-1', '1e-2'])."""
    key, sep, values = item.partition("=")
    if not sep or not values.strip():
        raise UserError(f"{flag} {item!r}: write key=v1,v2,..., e.g. {flag} lr=1e-1,1e-2")
    texts = [v.strip() for v in values.split(",")]
    if "" in texts:
        raise UserError(f"{flag} {item!r} has an empty value: write key=v1,v2,...")
    return key, texts
