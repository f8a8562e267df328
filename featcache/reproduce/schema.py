"""The pipeline file (pipelines/NAME.toml): its schema and strict validation.

Every problem is one UserError line naming the file and the table, raised before anything is extracted or trained:
unknown or missing keys, wrong types, unknown algorithms, settings, metrics, extract or partition options, paper
cells that are not numbers. The format itself is described in the package docstring (featcache/reproduce/__init__.py).
"""

from __future__ import annotations

import inspect
import re
import tomllib
from dataclasses import dataclass, field

from ..algorithms import create
from ..training.config import resolve
from ..errors import UserError, suggest
from ..extraction.partition import PartitionSpec
from ..extraction.plan import OPTIONS, Noise, check_options, extract
from ..runs.space import check_options as check_search_options
from ..runs.select import search
from ..runs.space import check_sampler, parse_space, rung_rounds
from ..runs.spec import grid_axes
from .metrics import METRICS, metric_problem

PAPERS = ("fedpcl", "fedproc", "fedpft")
FIGURES = ("lines", "heatmap")
EXTRACT_KEYS = tuple(k for k in inspect.signature(extract).parameters if k not in ("out", "progress", "data_root"))
FIXED_EXTRACT = ("dataset", "backbone")  # set once per pipeline (and by --dataset / --backbones), never per cell
_CELL = re.compile(r"^-?\d[\d,]*(\.\d+)?(\(\d+(\.\d+)?\))?M?$")  # "82.75(0.40)", "133,632", "11M"

# key -> (type or types, required); every table is checked against its spec
_TOP = {
    "name": (str, True),
    "title": (str, True),
    "paper_dataset": (str, False),
    "note": (str, False),
    "extra_rows": (list, False),
    "set": (dict, False),
    "extract": (dict, True),
    "columns": (dict, True),
    "run": (list, True),
    "paper": (dict, False),  # none: a pipeline of one's own, ours only
    "figure": (dict, False),
    "profiles": (dict, True),
}
_PAPER = {
    "name": (str, True),
    "table": (str, True),
    "source": (str, True),
    "columns": (list, True),
    "rows": (dict, False),
    "claims": (list, False),
    "backbones": (list, False),
}
_PAPER_BACKBONE = {"arch": (str, True), "weights": (str, True), "dim": (int, False), "frozen": (bool, False)}
_COLUMN = {
    "metric": (str, True),
    "extract": (dict, False),
    "set": (dict, False),
    "backbones": (list, False),
    "x": ((int, float), False),
}
_RUN = {
    "row": (str, True),
    "algo": (str, True),
    "set": (dict, False),
    "backbones": (list, False),
    "extract": (dict, False),
    "columns": (list, False),
    "grid": (dict, False),
    "search": (dict, False),
}
# a row's search (featcache.search's options); its trials may come from the profile, which wins (the budget)
_SEARCH = {
    "space": (dict, True),
    "sampler": (str, False),
    "pruner": (str, False),
    "trials": (int, False),
    "rungs": (int, False),
    "reduction": (int, False),
}
SEARCH_DEFAULTS = {k: inspect.signature(search).parameters[k].default for k in _SEARCH if k not in ("space", "trials")}
_FIGURE = {
    "kind": (str, True),
    "xlabel": (str, False),
    "ylabel": (str, False),
    "xscale": (str, False),
    "normalize": (str, False),
}
_PROFILE = {
    "rounds": (int, True),
    "seeds": (list, True),
    "set": (dict, False),
    "extract": (dict, False),
    "columns": (list, False),
    "rows": (list, False),
    "trials": (int, False),
}


@dataclass(frozen=True)
class Column:
    name: str
    metric: str
    extract: dict = field(default_factory=dict)
    set: dict = field(default_factory=dict)
    backbones: tuple[int, ...] | None = None
    x: float | None = None


@dataclass(frozen=True)
class Run:
    row: str
    algo: str
    set: dict = field(default_factory=dict)
    backbones: tuple[int, ...] | None = None
    extract: dict = field(default_factory=dict)
    columns: tuple[str, ...] = ()
    grid: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)  # space, sampler, pruner, trials, rungs, reduction ({}: no search)


@dataclass(frozen=True)
class PaperBackbone:
    """A backbone the paper used: its architecture (a timm name), the weights it loads (a word that names their
    checkpoint, e.g. quickdraw for SUR's quickdraw-net), its feature width, and whether it stays frozen."""

    arch: str
    weights: str
    dim: int | None = None  # None: the paper does not say
    frozen: bool = True


@dataclass(frozen=True)
class Profile:
    rounds: int
    seeds: tuple[int, ...]
    set: dict = field(default_factory=dict)
    extract: dict = field(default_factory=dict)
    columns: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    trials: int | None = None  # the trials of every searching row it runs (None: each row's own)


@dataclass(frozen=True)
class Pipeline:
    name: str
    paper: str  # "" without a [paper] table: a pipeline of one's own, its table ours only
    table: str
    title: str
    extract: dict
    columns: list[Column]
    runs: list[Run]
    source: str
    paper_columns: list[str]
    paper_rows: dict[str, list]
    profiles: dict[str, Profile]
    paper_dataset: str | None = None
    note: str = ""
    extra_rows: tuple[str, ...] = ()
    set: dict = field(default_factory=dict)
    claims: tuple[str, ...] = ()
    figure: dict = field(default_factory=dict)
    path: str = ""
    paper_backbones: tuple[PaperBackbone, ...] = ()

    @property
    def rows(self) -> list[str]:
        """Paper rows in the paper's order, then our extra rows."""
        return list(self.paper_rows) + [r for r in self.extra_rows if r not in self.paper_rows]


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a file stem: no separator, no '..' prefix, not empty


def parse_pipeline(text: str, path: str = "<pipeline>") -> Pipeline:
    """Parse and validate a pipeline; every problem is a one-line UserError naming the file and the table."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e})") from None
    _check(path, doc, _TOP)
    if not _NAME.fullmatch(doc["name"]):
        raise UserError(
            f"{path}: name {doc['name']!r} names the output files NAME.md and NAME.json inside --out: use "
            "1 to 64 letters, digits, '.', '_' and '-', starting with a letter or digit (e.g. "
            "fedpcl-table3)"
        )
    paper = doc.get("paper", {})
    if paper:
        _check(f"{path} [paper]", paper, _PAPER)
        if paper["name"] not in PAPERS:
            raise UserError(f"{path} [paper]: name must be one of {', '.join(PAPERS)} (got {paper['name']!r})")
    _check_extract(f"{path} [extract]", doc["extract"], doc["extract"], base_table=True)
    paper_columns = [str(c) for c in paper["columns"]] if paper else list(doc["columns"])  # no paper: ours
    rows = _paper_rows(path, paper.get("rows", {}), len(paper_columns))
    columns = _columns(path, doc, paper_columns)
    extra_rows = tuple(doc.get("extra_rows", ()))
    runs = _runs(path, doc, columns, [*rows, *extra_rows] if paper else None)
    if not paper:  # every run's row is a row of its own
        extra_rows = tuple(dict.fromkeys([*extra_rows, *(run.row for run in runs)]))
    profiles = {
        name: _profile(f"{path} [profiles.{name}]", spec, doc, columns, runs, [*rows, *extra_rows])
        for name, spec in doc["profiles"].items()
    }
    figure = doc.get("figure", {})
    if figure:
        _figure(f"{path} [figure]", figure, columns)
    return Pipeline(
        name=doc["name"],
        paper=paper.get("name", ""),
        table=paper.get("table", ""),
        title=doc["title"],
        extract=doc["extract"],
        columns=columns,
        runs=runs,
        source=paper.get("source", ""),
        paper_columns=paper_columns,
        paper_rows=rows,
        profiles=profiles,
        paper_dataset=doc.get("paper_dataset"),
        note=doc.get("note", "").strip(),
        extra_rows=extra_rows,
        set=doc.get("set", {}),
        claims=tuple(paper.get("claims", ())),
        figure=figure,
        path=path,
        paper_backbones=_paper_backbones(path, paper.get("backbones", [])),
    )


def _check(where: str, table, spec: dict) -> None:
    """Unknown key, missing key or wrong type in one TOML table -> one-line UserError."""
    if not isinstance(table, dict):
        raise UserError(f"{where}: expected a table, got {type(table).__name__}")
    for key, value in table.items():
        if key not in spec:
            raise UserError(f"{where}: unknown key {key!r}{suggest(key, spec)}; known: {', '.join(spec)}")
        types = spec[key][0] if isinstance(spec[key][0], tuple) else (spec[key][0],)
        if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
            raise UserError(f"{where}: {key} must be a {' or '.join(t.__name__ for t in types)} (got {value!r})")
    missing = [k for k, (_, required) in spec.items() if required and k not in table]
    if missing:
        raise UserError(f"{where}: missing key {missing[0]!r}")


def _check_extract(where: str, overrides: dict, base: dict, *, base_table: bool = False) -> None:
    """Known extract() options, a valid noise table, and partition options that featcache.partition accepts (the
    overrides applied to the pipeline's [extract]; per-dataset domains are checked when the dataset is known)."""
    for key in overrides:
        if key not in EXTRACT_KEYS:
            raise UserError(
                f"{where}: unknown extract option {key!r}{suggest(key, EXTRACT_KEYS)}; known: {', '.join(EXTRACT_KEYS)}"
            )
        if not base_table and key in FIXED_EXTRACT:
            raise UserError(f"{where}: {key} is set once in [extract] (pick backbones per cell with backbones = [i])")
        if key == "backbone" and not isinstance(overrides[key], list):  # runs and columns pick them by index
            value = overrides[key]
            hint = f': write backbone = ["{value}"]' if isinstance(value, str) else ""
            raise UserError(f"{where}: backbone must be a list of backbone names (got {value!r}){hint}")
        if key in OPTIONS and key != "noise":  # noise is a table here, checked below
            try:
                check_options({key: overrides[key]}, flags=False)
            except UserError as e:
                raise UserError(f"{where}: {e}") from None
    if "noise" in overrides:
        noise = overrides["noise"]
        _check(f"{where} noise", noise, {"kind": (str, True), "scale": ((int, float), True), "p": ((int, float), True)})
        Noise(noise["kind"], float(noise["scale"]), float(noise["p"]))
    options = {"scheme" if k == "partition" else k: v for k, v in (base | overrides).items()}  # extract's names
    options = {k: v for k, v in options.items() if k in PartitionSpec.__dataclass_fields__}
    if isinstance(options.get("domains"), dict):
        options.pop("domains")
    try:
        PartitionSpec(**options)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def _indices(where: str, value) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not value or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise UserError(f"{where}: backbones must be a non-empty list of backbone positions (0 = the first)")
    return tuple(value)


def _paper_backbones(path: str, backbones: list) -> tuple[PaperBackbone, ...]:
    for i, b in enumerate(backbones):
        _check(f"{path} [paper] backbones[{i}]", b, _PAPER_BACKBONE)
    return tuple(PaperBackbone(**b) for b in backbones)


def _paper_rows(path: str, rows: dict, n_columns: int) -> dict[str, list]:
    for row, cells in rows.items():
        if not isinstance(cells, list) or len(cells) != n_columns:
            raise UserError(f"{path} [paper.rows] {row!r}: give one cell per paper column ({n_columns})")
        for cell in cells:
            if not (
                isinstance(cell, (int, float))
                and not isinstance(cell, bool)
                or isinstance(cell, str)
                and (cell == "-" or _CELL.match(cell))
            ):
                raise UserError(f"{path} [paper.rows] {row!r}: cell {cell!r} is not a number, 'mean(std)' or '-'")
    return rows


def _columns(path: str, doc: dict, paper_columns: list[str]) -> list[Column]:
    columns = []
    for name, spec in doc["columns"].items():
        where = f"{path} [columns.{name!r}]"
        _check(where, spec, _COLUMN)
        if name not in paper_columns:
            raise UserError(f"{where}: not a paper column{suggest(name, paper_columns)}; paper: {paper_columns}")
        kind = spec["metric"].partition(":")[0]
        if kind not in METRICS:
            raise UserError(
                f"{where}: unknown metric {spec['metric']!r}{suggest(kind, METRICS)}; known: {', '.join(METRICS)}"
            )
        problem = metric_problem(spec["metric"])
        if problem:
            raise UserError(f"{where}: {problem}")
        _check_extract(where, spec.get("extract", {}), doc["extract"])
        columns.append(
            Column(
                name,
                spec["metric"],
                spec.get("extract", {}),
                spec.get("set", {}),
                _indices(where, spec.get("backbones")),
                spec.get("x"),
            )
        )
    return columns


def _runs(path: str, doc: dict, columns: list[Column], rows: list[str] | None) -> list[Run]:
    """The [[run]] tables; `rows` the rows they may name (None: any, a pipeline without a paper)."""
    runs = []
    for i, spec in enumerate(doc["run"], 1):
        where = f"{path} [[run]] {i}"
        _check(where, spec, _RUN)
        if rows is not None and spec["row"] not in rows:
            raise UserError(
                f"{where}: row {spec['row']!r} is not a paper row{suggest(spec['row'], rows)}: "
                "fix it or list it in extra_rows"
            )
        unknown = [c for c in spec.get("columns", ()) if c not in {col.name for col in columns}]
        if unknown:
            raise UserError(f"{where}: column {unknown[0]!r} has no [columns] entry")
        _check_extract(where, spec.get("extract", {}), doc["extract"])
        for col in columns:
            _check_settings(
                where, spec["algo"], doc.get("set", {}) | col.set | spec.get("set", {}), spec.get("grid", {})
            )
            _check_search(where, spec, doc.get("set", {}) | col.set | spec.get("set", {}))
        runs.append(
            Run(
                spec["row"],
                spec["algo"],
                spec.get("set", {}),
                _indices(where, spec.get("backbones")),
                spec.get("extract", {}),
                tuple(spec.get("columns", ())),
                spec.get("grid", {}),
                spec.get("search", {}),
            )
        )
    return runs


def _check_search(where: str, spec: dict, settings: dict) -> None:
    """A row's search table: known keys, a space `featcache search` takes (ranges as strings, lists as TOML
    values), known sampler and pruner, no grid beside it, no searched setting also set."""
    if "search" not in spec:
        return
    search = spec["search"]
    _check(f"{where} search", search, _SEARCH)
    if "grid" in spec:
        raise UserError(f"{where}: a row takes a grid or a search, not both: drop one")
    try:
        algo = create(spec["algo"])
        for key, value in search["space"].items():
            if isinstance(value, list):
                for v in value:
                    _typed(f"search space {key}", v, resolve(algo), key)
            elif not isinstance(value, str):
                raise UserError(f"search space {key}: give a list of values or a range string like 'uniform:0,1'")
        dims = parse_space(algo, search["space"])
        options = SEARCH_DEFAULTS | search
        check_search_options(options["sampler"], options["pruner"], options.get("trials", 1), None, *_halving(options))
        check_sampler(dims, options["sampler"], options.get("trials", 1))
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    both = [k for k in dims if k in settings]
    if both:
        raise UserError(f"{where}: {both[0]} is both searched and set: give it in one place")


def _halving(options: dict) -> tuple[int, int]:
    return options["rungs"], options["reduction"]


def _profile(where: str, spec: dict, doc: dict, columns: list[Column], runs: list[Run], rows: list[str]) -> Profile:
    _check(where, spec, _PROFILE)
    if not spec["seeds"] or not all(isinstance(s, int) for s in spec["seeds"]) or spec["rounds"] < 1:
        raise UserError(f"{where}: rounds must be >= 1 and seeds a non-empty list of integers")
    _check_extract(where, spec.get("extract", {}), doc["extract"])
    for key, known in (("columns", [c.name for c in columns]), ("rows", rows)):
        unknown = [v for v in spec.get(key, ()) if v not in known]
        if unknown:
            raise UserError(f"{where}: {key} names {unknown[0]!r}, which is not one of the pipeline's {key}")
    for run in runs:
        _check_settings(where, run.algo, doc.get("set", {}) | run.set | spec.get("set", {}), {})
        if run.search and (not spec.get("rows") or run.row in spec["rows"]):
            _check_budget(where, run, spec)
    return Profile(
        spec["rounds"],
        tuple(spec["seeds"]),
        spec.get("set", {}),
        spec.get("extract", {}),
        tuple(spec.get("columns", ())),
        tuple(spec.get("rows", ())),
        spec.get("trials"),
    )


def _check_budget(where: str, run: Run, spec: dict) -> None:
    """A searching row under a profile: a trial budget (the profile's or the row's), rounds for its rungs, no
    searched setting in the profile's set."""
    options = SEARCH_DEFAULTS | run.search | ({"trials": spec["trials"]} if "trials" in spec else {})
    if "trials" not in options:
        raise UserError(f"{where}: row {run.row!r} searches: give trials = N (the search budget) here or in its search")
    both = [k for k in run.search["space"] if k in spec.get("set", {})]
    if both:
        raise UserError(f"{where}: {both[0]} is searched in row {run.row!r} and set here: give it in one place")
    try:
        check_search_options(options["sampler"], options["pruner"], options["trials"], None, *_halving(options))
        check_sampler(parse_space(create(run.algo), run.search["space"]), options["sampler"], options["trials"])
        rung_rounds(spec["rounds"], options["pruner"], *_halving(options))
    except UserError as e:
        raise UserError(f"{where}: row {run.row!r}: {e}") from None


def _figure(where: str, figure: dict, columns: list[Column]) -> None:
    _check(where, figure, _FIGURE)
    if figure["kind"] not in FIGURES:
        raise UserError(f"{where}: kind must be one of {', '.join(FIGURES)} (got {figure['kind']!r})")
    if figure["kind"] == "lines" and any(c.x is None for c in columns):
        raise UserError(f"{where}: a lines figure needs x = NUMBER in every [columns] entry")


def _check_settings(where: str, algo: str, settings: dict, grid: dict) -> None:
    """Unknown algorithm or setting, wrong type -> one line, before anything is extracted or trained."""
    if "rounds" in settings:
        raise UserError(f"{where}: rounds comes from [profiles.*], not from set")
    try:
        impl = create(algo)
        defaults = resolve(impl)
        for key, value in settings.items():
            _typed(key, value, defaults)
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise UserError(
                    f"grid {key} must be a list of values, e.g. {key} = [{defaults.get(key, 0.1)!r}] (got {values!r})"
                )
            for value in values:
                _typed(f"grid {key}", value, defaults, key)
        resolve(impl, settings)
        if grid:
            grid_axes(impl, grid)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def _typed(label: str, value, defaults: dict, key: str | None = None) -> None:
    """A TOML value has its own type: a string where the setting (its default) is a number or a boolean is refused,
    not parsed as `--set key=TEXT` is."""
    default = defaults.get(key or label)
    if isinstance(value, str) and isinstance(default, (bool, int, float)):
        kind = type(default).__name__
        raise UserError(
            f"{label}: expected {'an' if kind == 'int' else 'a'} {kind} like {default!r}, not the string "
            f"{value!r} (write it without quotes)"
        )
