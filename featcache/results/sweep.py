"""Results of several caches as one sweep: each run's cache parameters read from the result file's own provenance
(the partition its cache records, the backbones it trained on), the parameter that differs between them as the x
axis (`x` picks one when several differ; the others split the lines), and each point's final accuracy, personal
and global, mean(std) over seeds.

A line is every run that shares its training settings (`tables.labels`) and the other differing parameters; one
point per x value, so two results for the same point are refused. std is the sample std over seeds (ddof=1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from ..errors import UserError, suggest
from .load import Run, cache_of, is_number
from .tables import DIRICHLET, fmt, fmt_global, labels, partition_words, shared_text


def _partition(r: dict) -> dict:
    p = cache_of(r).get("partition")
    return p if isinstance(p, dict) else {}


def _joined(values) -> str | None:
    return ", ".join(map(str, values)) if isinstance(values, list) and values else None


@dataclass(frozen=True)
class Parameter:
    """A cache parameter a sweep may vary: its name in a table and on an axis, how a result records it (None: not
    recorded, or meaningless for its partition, as α for a feature partition), and whether it is a number."""

    label: str
    read: Callable[[dict], object]
    numeric: bool


# --x NAME -> the parameter, in the order a table lists them.
PARAMETERS = {
    "alpha": Parameter(
        "α", lambda r: _partition(r).get("alpha") if _partition(r).get("scheme") in DIRICHLET else None, True
    ),
    "clients": Parameter("clients", lambda r: r.get("clients"), True),
    "partition": Parameter("partition", lambda r: _partition(r).get("scheme"), False),
    "per_class": Parameter("train images per class", lambda r: _partition(r).get("per_class"), True),
    "test_per_class": Parameter("test images per class", lambda r: _partition(r).get("test_per_class"), True),
    "classes_per_client": Parameter(
        "classes per client",
        lambda r: _partition(r).get("classes_per_client") if _partition(r).get("scheme") == "pathological" else None,
        True,
    ),
    "domains": Parameter("domains", lambda r: _joined(_partition(r).get("domains")), False),
    "holdout_domain": Parameter("held-out test domain", lambda r: _partition(r).get("holdout_domain"), False),
    "test_split": Parameter("test split", lambda r: _partition(r).get("test_split"), False),
    "percent": Parameter("train share (percent)", lambda r: _partition(r).get("percent"), True),
    "backbones": Parameter("backbones", lambda r: _joined(r.get("backbones") or cache_of(r).get("backbones")), False),
    "dataset": Parameter("dataset", lambda r: cache_of(r).get("dataset"), False),
    "val_fraction": Parameter("validation fraction", lambda r: _partition(r).get("val_fraction"), True),
    "partition_seed": Parameter("partition seed", lambda r: _partition(r).get("seed"), True),
    "order": Parameter("image order", lambda r: _partition(r).get("order"), False),
}


def text(value) -> str:
    """A parameter's value as a table shows it: numbers with %g, none as —."""
    if value is None:
        return "—"
    return f"{value:g}" if is_number(value) else str(value)


@dataclass
class Point:
    """One run on the sweep: its x value, its line, and its final accuracies (mean, std over seeds) in %."""

    run: Run
    x: object
    line: str
    setting: str  # the run's training settings that differ (`tables.labels`)
    others: dict  # the other differing parameters: name -> value
    acc: tuple[float, float]
    global_acc: tuple[float, float] | None


@dataclass
class Sweep:
    x: str
    points: list[Point]  # sorted by x, then line
    lines: list[str]  # in the order they are drawn
    others: list[str]  # the other parameters that differ (they split the lines)
    caches: int


def caches(results: list[dict]) -> int:
    return len({str(cache_of(r).get("key")) for r in results})


def differing(results: list[dict]) -> list[str]:
    """The parameters whose recorded value is not the same for every run."""
    return [name for name, p in PARAMETERS.items() if len({json.dumps(p.read(r), sort_keys=True) for r in results}) > 1]


def _described(names: list[str], results: list[dict]) -> str:
    """`alpha (0.1, 1, 10) and clients (4, 8)`."""
    parts = []
    for name in names:
        values = sorted({text(PARAMETERS[name].read(r)) for r in results}, key=order_key)
        parts.append(f"{name} ({', '.join(values[:6])}{', ...' if len(values) > 6 else ''})")
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


def order_key(v: str):
    """Numbers first, by value (0.1 < 1 < 10), then words alphabetically."""
    try:
        return (0, float(v), "")
    except ValueError:
        return (1, 0.0, v)


def choose_x(results: list[dict], x: str | None) -> str:
    """The sweep's axis: `x` when it names a parameter that differs, else the one that differs; refused in one line
    otherwise (naming what differs and `--x`)."""
    differ = differing(results)
    n = caches(results)
    if x is not None:
        if x not in PARAMETERS:
            raise UserError(f"--x {x} is not a cache parameter{suggest(x, PARAMETERS)}; known: {', '.join(PARAMETERS)}")
        if x not in differ:
            same = text(PARAMETERS[x].read(results[0]))
            if n == 1:
                raise UserError(
                    f"--x {x}: every result comes from one cache ({x} {same}): a curve over {x} needs the results "
                    "of caches that differ in it (e.g. `featcache extract --alpha 0.1,1,10`, then train each)"
                )
            rest = f": the caches differ in {_described(differ, results)}; pass --x {differ[0]}" if differ else ""
            raise UserError(f"--x {x}: every result has {x} {same}{rest}")
        return x
    if len(differ) == 1:
        return differ[0]
    if not differ:
        raise UserError(
            f"the results come from {n} caches that differ in nothing their result files record (image size, "
            "noise, views?): report the files of each cache separately"
        )
    raise UserError(
        f"the results' caches differ in {_described(differ, results)}: pass --x {differ[0]} (or another of them) "
        "for the axis; the others draw one line per value"
    )


def sweep(runs: list[Run], x: str) -> Sweep:
    """The runs as points of a sweep over `x` (see `choose_x`); two runs on the same point are refused."""
    results = [run.result for run in runs]
    others = [name for name in differing(results) if name != x]
    settings = labels(results, numbered=False)
    points, seen = [], {}
    for run, r, setting in zip(runs, results, settings):
        values = {name: PARAMETERS[name].read(r) for name in others}
        line = " · ".join([f"{PARAMETERS[k].label}={text(v)}" for k, v in values.items()] + [setting])
        value = PARAMETERS[x].read(r)
        where = (line, json.dumps(value))
        if where in seen:
            raise UserError(
                f"two results for one point ({x} {text(value)}, {line}): {seen[where]} and {run.path}: pass one of them"
            )
        seen[where] = run.path
        g = (r["global_mean_acc"], r["global_std_acc"]) if fmt_global(r) != "n/a" else None
        points.append(Point(run, value, line, setting, values, (r["mean_acc"], r["std_acc"]), g))
    by_value = sorted(points, key=lambda p: ([order_key(text(v)) for v in p.others.values()], p.setting))
    lines = list(dict.fromkeys(p.line for p in by_value))  # by the other parameters' values, then the settings
    points.sort(key=lambda p: (order_key(text(p.x)), lines.index(p.line)))
    return Sweep(x, points, lines, others, caches(results))


def sweep_title(s: Sweep) -> str:
    """What every point shares: `imagefolder, 3 caches: label partition, 4 clients; backbones b; 5 rounds; shared
    settings ...; seeds 0,1`."""
    results = [p.run.result for p in s.points]
    varied = {s.x, *s.others}
    common: dict = {}
    for key in ("scheme", "alpha", "classes_per_client", "per_class", "test_per_class", "domains"):
        values = {json.dumps(_partition(r).get(key), sort_keys=True) for r in results}
        name = {"scheme": "partition", "domains": "domains"}.get(key, key)
        if len(values) == 1 and name not in varied:
            common[key] = _partition(results[0]).get(key)
    clients = results[0].get("clients") if "clients" not in varied else None
    datasets = " / ".join(sorted({str(cache_of(r).get("dataset") or "?") for r in results}))
    words = partition_words(common, clients)
    backbones = " / ".join(sorted({text(PARAMETERS["backbones"].read(r)) for r in results}))
    rounds = " / ".join(sorted({str((r.get("config") or {}).get("rounds", "?")) for r in results}))
    seeds = " / ".join(sorted({",".join(map(str, r["seeds"])) for r in results}))
    shared = shared_text(results)
    return (
        f"{datasets}, {s.caches} caches"
        + (f": {words}" if words else "")
        + f"; backbones {backbones}; {rounds} rounds"
        + (f"; shared settings {shared}" if shared else "")
        + f"; seeds {seeds}"
    )


def sweep_table(s: Sweep) -> str:
    """A title (what every point shares), then one row per point: x, the other differing parameters, the run's
    settings, personal and global final accuracy, best round, worst 20 %, seeds, cache."""
    heads = [PARAMETERS[s.x].label, *(PARAMETERS[k].label for k in s.others), "run"]
    rows = [
        f"**final accuracy vs {PARAMETERS[s.x].label}: {sweep_title(s)}** — mean(std) over seeds (std = sample "
        "std, ddof=1; 0 with one seed); "
        "personal: each client's model on its own test rows, averaged over clients; global: the server's model on "
        "all test rows (n/a: the algorithm has none)",
        "",
        "| " + " | ".join(heads) + " | personal acc % | global acc % | best-round acc % | worst 20 % | seeds | cache |",
        "|" + "---|" * (len(heads) + 6),
    ]
    for p in s.points:
        r = p.run.result
        cells = [text(p.x), *(text(p.others[k]) for k in s.others), p.setting]
        rows.append(
            "| "
            + " | ".join(cells)
            + f" | {fmt(*p.acc)} | {fmt_global(r)} | {fmt(r['best_round_mean_acc'], r['best_round_std_acc'])} | "
            f"{fmt(*r['fairness']['worst_20'])} | {len(r['seeds'])} | {str(cache_of(r).get('key'))[:16]} |"
        )
    return "\n".join(rows) + "\n"


def sweep_points(s: Sweep) -> list[dict]:
    """The points as JSON: x, line, final accuracy mean/std (personal and global), cache key, result file."""
    return [
        {
            "x": p.x,
            "line": p.line,
            **p.others,
            "mean_acc": p.acc[0],
            "std_acc": p.acc[1],
            "global_mean_acc": p.global_acc[0] if p.global_acc else None,
            "global_std_acc": p.global_acc[1] if p.global_acc else None,
            "cache": cache_of(p.run.result).get("key"),
            "result_file": str(p.run.path),
        }
        for p in s.points
    ]
