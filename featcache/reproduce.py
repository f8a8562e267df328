"""`featcache reproduce`: one TOML pipeline per paper table or figure -> extract, train, and a markdown table with our
numbers beside the paper's (plus a PNG where the target is a figure).

A pipeline (pipelines/NAME.toml) holds:

    name, title                      the Make target (= the file's stem) and what the table shows
    paper_dataset                    the dataset the paper used: taken when --data-root is given without --dataset
    note                             how the paper's setting maps onto the data at hand (printed with the table)
    extra_rows                       rows we report that the paper's table does not have
    set                              settings for every run (a column's, a run's and the profile's set win, in order)
    [extract]                        featcache.extract.extract keyword arguments (noise = {kind, scale, p};
                                     domains = [..] for every dataset, or {dataset = [..]} per dataset)
    [columns."PAPER COLUMN"]         metric (below), and optional extract / set / backbones / x overrides for the cells
                                     of that column; a paper column without an entry is not reproduced
    [[run]]                          row (a paper row), algo, set = {setting = value}, backbones = [indices into the
                                     extract's backbone list] (default: all), extract = {overrides}, columns = [only
                                     these], grid = {setting = [values]} (validation-select + retrain)
    [paper]                          name (fedpcl | fedproc | fedpft), table ("Table 2"), source, columns = [the
                                     paper's columns], rows = {row = [cells: "mean(std)", a number or "-"]}, claims
    [figure]                         kind = lines | heatmap, xlabel, ylabel, xscale, normalize = column
    [profiles.quick], [profiles.full]   rounds, seeds, and optional set / extract / columns / rows overrides

Metrics: acc (final round: mean(std) over seeds of the unweighted client mean), best (best round per seed), params
(floats uploaded per client per round), trainable (trainable head parameters per client), fixed (frozen backbone
parameters), domain:NAME[|ALT..] (clients of the first of these domains the data has), fair:KEY (metrics.fairness;
fair:std is the paper's "Variance"), probe:origin|probe|match (fedpft.probe_match on the trained state), protosim:DOMAIN
(FedPCL Figure 3: cosine of the row's backbone's prototypes, computed by the all-backbone model from that backbone's
feature columns alone, to the fused prototypes, averaged over classes; the row's run names the backbone).

A cell is one job = (extraction, algorithm, settings, backbones, rounds, seeds). Jobs are deduplicated, extractions
shared through the content-keyed cache folder, and every finished job is kept in OUT/jobs/ under a hash of what it
trains, so targets that share a job (or a re-run) reuse it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import re
import shlex
import time
import tomllib
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from . import __version__
from . import cache as C
from .atomic import write_atomic
from .errors import UserError, suggest
from .extract import Noise, extract
from .metrics import mean_std
from .provenance import library_call, provenance
from .report import fmt

PIPELINE_DIR = Path("pipelines")  # NAME is looked up here (relative to the working directory) first, then ...
REPO_PIPELINE_DIR = Path(__file__).resolve().parent.parent / "pipelines"  # ... beside the package (a checkout)
DEFAULT_PROFILE = "full"  # the papers' rounds and seeds, as the Make targets (PROFILE ?= full); `quick` is opt-in
# Jobs are memoised in OUT/jobs/ under what they train, not where: every job trains on the CPU, so a memoised result
# never mixes with one a GPU rounded differently (train and grid default to --device auto, the engine to cpu).
TRAIN_DEVICE = "cpu"
PAPERS = ("fedpcl", "fedproc", "fedpft")
EXTRACT_KEYS = tuple(k for k in inspect.signature(extract).parameters if k not in ("out", "progress", "data_root"))
FIXED_EXTRACT = ("dataset", "backbone")  # set once per pipeline (and by --dataset / --backbones), never per cell
_CELL = re.compile(r"^-?\d[\d,]*(\.\d+)?(\(\d+(\.\d+)?\))?M?$")  # "82.75(0.40)", "133,632", "11M"

# key -> (type or types, required); the loader checks every table against these
_TOP = {"name": (str, True), "title": (str, True), "paper_dataset": (str, False), "note": (str, False),
        "extra_rows": (list, False), "set": (dict, False), "extract": (dict, True), "columns": (dict, True),
        "run": (list, True), "paper": (dict, True), "figure": (dict, False), "profiles": (dict, True)}
_PAPER = {"name": (str, True), "table": (str, True), "source": (str, True), "columns": (list, True),
          "rows": (dict, False), "claims": (list, False)}
_COLUMN = {"metric": (str, True), "extract": (dict, False), "set": (dict, False), "backbones": (list, False),
           "x": ((int, float), False)}
_RUN = {"row": (str, True), "algo": (str, True), "set": (dict, False), "backbones": (list, False),
        "extract": (dict, False), "columns": (list, False), "grid": (dict, False)}
_FIGURE = {"kind": (str, True), "xlabel": (str, False), "ylabel": (str, False), "xscale": (str, False),
           "normalize": (str, False)}
_PROFILE = {"rounds": (int, True), "seeds": (list, True), "set": (dict, False), "extract": (dict, False),
            "columns": (list, False), "rows": (list, False)}
FIGURES = ("lines", "heatmap")


# -- the pipeline file ------------------------------------------------------------------------------------------------
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


@dataclass(frozen=True)
class Profile:
    rounds: int
    seeds: tuple[int, ...]
    set: dict = field(default_factory=dict)
    extract: dict = field(default_factory=dict)
    columns: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pipeline:
    name: str
    paper: str
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

    @property
    def rows(self) -> list[str]:
        """Paper rows in the paper's order, then our extra rows."""
        return list(self.paper_rows) + [r for r in self.extra_rows if r not in self.paper_rows]


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


def _check_extract(where: str, overrides: dict, base: bool = False) -> None:
    for key in overrides:
        if key not in EXTRACT_KEYS:
            raise UserError(f"{where}: unknown extract option {key!r}{suggest(key, EXTRACT_KEYS)}; "
                            f"known: {', '.join(EXTRACT_KEYS)}")
        if not base and key in FIXED_EXTRACT:
            raise UserError(f"{where}: {key} is set once in [extract] (pick backbones per cell with backbones = [i])")
    if "noise" in overrides:
        noise = overrides["noise"]
        _check(f"{where} noise", noise, {"kind": (str, True), "scale": ((int, float), True), "p": ((int, float), True)})
        Noise(noise["kind"], float(noise["scale"]), float(noise["p"]))


def _indices(where: str, value) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not value or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise UserError(f"{where}: backbones must be a non-empty list of backbone positions (0 = the first)")
    return tuple(value)


def parse_pipeline(text: str, path: str = "<pipeline>") -> Pipeline:
    """Parse and validate a pipeline; every problem is a one-line UserError naming the file and the table."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e})") from None
    _check(path, doc, _TOP)
    paper = doc["paper"]
    _check(f"{path} [paper]", paper, _PAPER)
    if paper["name"] not in PAPERS:
        raise UserError(f"{path} [paper]: name must be one of {', '.join(PAPERS)} (got {paper['name']!r})")
    _check_extract(f"{path} [extract]", doc["extract"], base=True)
    paper_columns = [str(c) for c in paper["columns"]]
    rows = _paper_rows(path, paper.get("rows", {}), len(paper_columns))
    columns = _columns(path, doc["columns"], paper_columns)
    extra_rows = tuple(doc.get("extra_rows", ()))
    runs = _runs(path, doc, columns, [*rows, *extra_rows])
    profiles = {name: _profile(f"{path} [profiles.{name}]", spec, doc, columns, runs, [*rows, *extra_rows])
                for name, spec in doc["profiles"].items()}
    figure = doc.get("figure", {})
    if figure:
        _check(f"{path} [figure]", figure, _FIGURE)
        if figure["kind"] not in FIGURES:
            raise UserError(f"{path} [figure]: kind must be one of {', '.join(FIGURES)} (got {figure['kind']!r})")
        if figure["kind"] == "lines" and any(c.x is None for c in columns):
            raise UserError(f"{path} [figure]: a lines figure needs x = NUMBER in every [columns] entry")
    return Pipeline(
        name=doc["name"], paper=paper["name"], table=paper["table"], title=doc["title"], extract=doc["extract"],
        columns=columns, runs=runs, source=paper["source"], paper_columns=paper_columns, paper_rows=rows,
        profiles=profiles, paper_dataset=doc.get("paper_dataset"), note=doc.get("note", "").strip(),
        extra_rows=extra_rows, set=doc.get("set", {}), claims=tuple(paper.get("claims", ())), figure=figure,
        path=path,
    )


def _paper_rows(path: str, rows: dict, n_columns: int) -> dict[str, list]:
    for row, cells in rows.items():
        if not isinstance(cells, list) or len(cells) != n_columns:
            raise UserError(f"{path} [paper.rows] {row!r}: give one cell per paper column ({n_columns})")
        for cell in cells:
            if not (isinstance(cell, (int, float)) and not isinstance(cell, bool)
                    or isinstance(cell, str) and (cell == "-" or _CELL.match(cell))):
                raise UserError(f"{path} [paper.rows] {row!r}: cell {cell!r} is not a number, 'mean(std)' or '-'")
    return rows


def _columns(path: str, table: dict, paper_columns: list[str]) -> list[Column]:
    columns = []
    for name, spec in table.items():
        where = f"{path} [columns.{name!r}]"
        _check(where, spec, _COLUMN)
        if name not in paper_columns:
            raise UserError(f"{where}: not a paper column{suggest(name, paper_columns)}; paper: {paper_columns}")
        kind = spec["metric"].partition(":")[0]
        if kind not in METRICS:
            raise UserError(f"{where}: unknown metric {spec['metric']!r}{suggest(kind, METRICS)}; "
                            f"known: {', '.join(METRICS)}")
        _check_extract(where, spec.get("extract", {}))
        columns.append(Column(name, spec["metric"], spec.get("extract", {}), spec.get("set", {}),
                              _indices(where, spec.get("backbones")), spec.get("x")))
    return columns


def _runs(path: str, doc: dict, columns: list[Column], rows: list[str]) -> list[Run]:
    runs = []
    for i, spec in enumerate(doc["run"], 1):
        where = f"{path} [[run]] {i}"
        _check(where, spec, _RUN)
        if spec["row"] not in rows:
            raise UserError(f"{where}: row {spec['row']!r} is not a paper row{suggest(spec['row'], rows)}: "
                            "fix it or list it in extra_rows")
        unknown = [c for c in spec.get("columns", ()) if c not in {col.name for col in columns}]
        if unknown:
            raise UserError(f"{where}: column {unknown[0]!r} has no [columns] entry")
        _check_extract(where, spec.get("extract", {}))
        for col in columns:
            _check_settings(where, spec["algo"], doc.get("set", {}) | col.set | spec.get("set", {}),
                            spec.get("grid", {}))
        runs.append(Run(spec["row"], spec["algo"], spec.get("set", {}), _indices(where, spec.get("backbones")),
                        spec.get("extract", {}), tuple(spec.get("columns", ())), spec.get("grid", {})))
    return runs


def _profile(where: str, spec: dict, doc: dict, columns: list[Column], runs: list[Run], rows: list[str]) -> Profile:
    _check(where, spec, _PROFILE)
    if not spec["seeds"] or not all(isinstance(s, int) for s in spec["seeds"]) or spec["rounds"] < 1:
        raise UserError(f"{where}: rounds must be >= 1 and seeds a non-empty list of integers")
    _check_extract(where, spec.get("extract", {}))
    for key, known in (("columns", [c.name for c in columns]), ("rows", rows)):
        unknown = [v for v in spec.get(key, ()) if v not in known]
        if unknown:
            raise UserError(f"{where}: {key} names {unknown[0]!r}, which is not one of the pipeline's {key}")
    for run in runs:
        _check_settings(where, run.algo, doc.get("set", {}) | run.set | spec.get("set", {}), {})
    return Profile(spec["rounds"], tuple(spec["seeds"]), spec.get("set", {}), spec.get("extract", {}),
                   tuple(spec.get("columns", ())), tuple(spec.get("rows", ())))


def _check_settings(where: str, algo: str, settings: dict, grid: dict) -> None:
    """Unknown algorithm or setting, wrong type -> one line, before anything is extracted or trained."""
    from .algorithms import create
    from .config import resolve
    from .grid import parse_grid

    if "rounds" in settings:
        raise UserError(f"{where}: rounds comes from [profiles.*], not from set")
    try:
        impl = create(algo)
        resolve(impl, settings)
        if grid:
            parse_grid(impl, [f"{k}={','.join(str(v) for v in values)}" for k, values in grid.items()])
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def pipeline_dirs() -> list[Path]:
    """Where a bare NAME is looked up: ./pipelines/, then the pipelines/ folder of the checkout featcache runs from
    (so `featcache reproduce NAME` works from any working directory)."""
    dirs = [PIPELINE_DIR]
    if REPO_PIPELINE_DIR.is_dir() and REPO_PIPELINE_DIR.resolve() != PIPELINE_DIR.resolve():
        dirs.append(REPO_PIPELINE_DIR)
    return dirs


def pipeline_path(pipeline: str | Path) -> Path:
    """A TOML path, or a bare name (NAME or NAME.toml) looked up in `pipeline_dirs()`."""
    path = Path(pipeline)
    if path.is_file():
        return path
    stem = path.name[: -len(".toml")] if path.name.endswith(".toml") else str(pipeline)
    if path.parent == Path(".") or path.parent == PIPELINE_DIR:
        for folder in pipeline_dirs():
            named = folder / f"{stem}.toml"
            if named.is_file():
                return named
    known = sorted({p.stem for folder in pipeline_dirs() for p in folder.glob("*.toml")})
    raise UserError(f"no pipeline {str(pipeline)!r}{suggest(str(pipeline), known)}; known: {', '.join(known)}")


def load_pipeline(pipeline: str | Path) -> Pipeline:
    path = pipeline_path(pipeline)
    return parse_pipeline(path.read_text(), str(path))


# -- planning: cells -> jobs ------------------------------------------------------------------------------------------
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
    needs: tuple[str, ...]  # outputs beyond accuracy: probe | similarity (from the trained state) | fixed

    @property
    def extract_kwargs(self) -> dict:
        return json.loads(self.extract)

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


NEEDS = {"probe": "probe", "protosim": "similarity", "fixed": "fixed"}  # metric kind -> job output it needs


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
    for key in ("alpha", "val_fraction"):  # 1 and 1.0 are one setting: one job, one memo file
        if key in ex:
            ex[key] = float(ex[key])
    if isinstance(ex.get("domains"), dict):  # per-dataset domains: a dataset without an entry uses its defaults
        ex["domains"] = ex["domains"].get(ex.get("dataset", "offline-digits"))
    if data_root:
        ex["data_root"] = str(Path(data_root).resolve())
    return {k: v for k, v in ex.items() if v is not None}


def plan(pipe: Pipeline, profile: str = DEFAULT_PROFILE, dataset: str | None = None, data_root=None, backbones=None
         ) -> dict[tuple[str, str], Job]:
    """Every (row, column) cell the profile runs -> its job (protosim cells: the all-backbone job)."""
    if profile not in pipe.profiles:
        raise UserError(f"{pipe.path}: no profile {profile!r}{suggest(profile, pipe.profiles)}; "
                        f"known: {', '.join(pipe.profiles)}")
    prof = pipe.profiles[profile]
    cells = {}
    for run in pipe.runs:
        if prof.rows and run.row not in prof.rows:
            continue
        for col in pipe.columns:
            if (run.columns and col.name not in run.columns) or (prof.columns and col.name not in prof.columns):
                continue
            ex = resolve_extract(pipe, [col.extract, run.extract, prof.extract], dataset, data_root, backbones)
            kind = col.metric.partition(":")[0]
            chosen = run.backbones if run.backbones is not None else col.backbones
            if kind == "protosim":  # one all-backbone job; the row's single backbone is the one read
                if chosen is None or len(chosen) != 1:
                    raise UserError(f"{pipe.path}: row {run.row!r} feeds a protosim column: give backbones = [k]")
                _subset(pipe, run, chosen, ex["backbone"])  # in range
                chosen = None
            job = Job(
                extract=json.dumps(ex, sort_keys=True), algo=run.algo,
                settings=json.dumps(pipe.set | col.set | run.set | prof.set, sort_keys=True), rounds=prof.rounds,
                seeds=prof.seeds, backbones=_subset(pipe, run, chosen, ex["backbone"]),
                grid=json.dumps(run.grid, sort_keys=True), needs=(NEEDS[kind],) if kind in NEEDS else (),
            )
            cells[(run.row, col.name)] = job
    return _merge_needs(cells)


def _merge_needs(cells: dict) -> dict:
    """Cells that differ only in what they read from the trained state share one job with the union of needs."""
    base = lambda job: Job(**asdict(job) | {"needs": ()})
    union: dict[Job, set] = {}
    for job in cells.values():
        union.setdefault(base(job), set()).update(job.needs)
    return {cell: Job(**asdict(job) | {"needs": tuple(sorted(union[base(job)]))}) for cell, job in cells.items()}


def _subset(pipe: Pipeline, run: Run, chosen: tuple[int, ...] | None, names: list[str]) -> tuple[int, ...] | None:
    """Backbone positions a cell trains on; None when that is every backbone in order (the stored concat)."""
    if chosen is None or chosen == tuple(range(len(names))):
        return None
    if max(chosen) >= len(names):
        raise UserError(f"{pipe.path}: row {run.row!r} picks backbone {max(chosen)} but the extraction has "
                        f"{len(names)} ({', '.join(names)}): pass {max(chosen) + 1} or more backbones")
    return chosen


# -- running jobs -----------------------------------------------------------------------------------------------------
def _extract(ex: dict, cache: Path, progress) -> dict:
    kwargs = dict(ex)
    if "noise" in kwargs:
        kwargs["noise"] = Noise(kwargs["noise"]["kind"], float(kwargs["noise"]["scale"]), float(kwargs["noise"]["p"]))
    info = extract(**kwargs, out=cache, progress=progress)
    with C.open_cache(info["cache"]) as f:
        meta = C.read_attrs(f)
        info["dims"] = [int(f["backbones"][k].attrs["dim"]) for k in meta["backbones"]]  # [B] in concat order
    info["client_domains"] = [c["domain"] for c in meta["counts"]["clients"]]
    info["classes"] = len(meta["classes"])
    return info


OUTPUT_KEYS = {"probe": "probe", "similarity": "similarity", "fixed": "fixed_params"}  # need -> its result key


def _memo_path(job: Job, info: dict, out: Path) -> Path:
    """Named by what the job trains (not by what it reads off the state): one training serves every metric."""
    trains = Job(**asdict(job) | {"needs": ()}).key()
    digest = hashlib.sha256(f"{trains}|{info['key']}|{__version__}".encode()).hexdigest()[:16]
    return out / "jobs" / f"{job.algo}-{digest}.json"


def run_job(job: Job, info: dict, out: Path) -> dict:
    """Train one job on its cache (train(), grid(), or the engine directly when a backbone subset or the trained
    state is needed); the result is memoised in OUT/jobs/ and reused when it holds every output the job needs."""
    memo = _memo_path(job, info, out)
    if memo.is_file():
        found = json.loads(memo.read_text())
        have = {need for need, key in OUTPUT_KEYS.items() if key in found}
        if set(job.needs) <= have:
            return found
        job = Job(**asdict(job) | {"needs": tuple(sorted(have | set(job.needs)))})
    settings = json.loads(job.settings)
    if json.loads(job.grid):
        result = _grid_job(job, info, out, settings)
    elif job.backbones is not None or set(job.needs) & set(STATE_OUTPUTS):
        result = _engine_job(job, info, settings)
    else:
        from .train import train

        result = train(info["cache"], job.algo, rounds=job.rounds, seeds=list(job.seeds), set=settings,
                       out=out / "runs", device=TRAIN_DEVICE)
    chosen = job.backbones if job.backbones is not None else range(len(info["dims"]))
    keep = ("algo", "config", "seeds", "mean_acc", "std_acc", "per_seed", "per_client_per_seed", "best_round_mean_acc",
            "best_round_std_acc", "fairness", "curve", "params_uploaded_per_round", "probe", "similarity",
            "grid", "result_file")
    result = {k: v for k, v in result.items() if k in keep} | {
        "trainable_params": _trainable_params(job.algo, result["config"], sum(info["dims"][i] for i in chosen),
                                              info["classes"]),
        "client_domains": info["client_domains"], "cache_key": info["key"], "cache": Path(info["cache"]).name,
        "backbones": [job.extract_kwargs["backbone"][i] for i in chosen],
    }
    if "fixed" in job.needs:
        spec = job.extract_kwargs
        result["fixed_params"] = sum(_backbone_params(spec["backbone"][i], spec.get("image_size")) for i in chosen)
    write_atomic(memo, json.dumps(result, sort_keys=True))
    return result


def _engine_job(job: Job, info: dict, settings: dict) -> dict:
    """Train with featcache.engine.Engine on a subset of the cached backbones, keeping the trained state."""
    from .algorithms import create
    from .config import resolve
    from .engine import Engine
    from .metrics import summarize

    impl = create(job.algo)
    cfg = resolve(impl, settings | {"rounds": job.rounds})
    chosen = [info["backbones"][i] for i in job.backbones] if job.backbones is not None else None
    train = C.load_clients(info["cache"], "train", backbones=chosen, views=getattr(impl, "uses_views", False))
    test = C.load_clients(info["cache"], "test", backbones=chosen)
    engine = Engine(impl, [cfg | {"seed": s} for s in job.seeds], train, test, device=TRAIN_DEVICE)
    raw = engine.run()
    result = {"algo": job.algo, "config": cfg, "seeds": list(job.seeds),
              "params_uploaded_per_round": int(raw["upload_floats"][0])} | summarize(raw["acc"].numpy(),
                                                                                     raw["eval_rounds"])
    for need in job.needs:
        result |= STATE_OUTPUTS.get(need, lambda impl, engine, dims: {})(engine.algo, engine, info["dims"])
    return result


def _probe(impl, engine, dims: list[int]) -> dict:
    from .algorithms.fedpft import probe_match

    accs = probe_match(impl, engine.state, engine.train, engine.test)  # kind -> [H, C]
    return {"probe": {k: (100 * v.mean(1)).tolist() for k, v in accs.items()}}  # per seed, client mean, %


def _similarity(impl, engine, dims: list[int]) -> dict:
    """FedPCL Figure 3 on one trained all-backbone model: per backbone k, each client's prototypes computed from
    backbone k's feature columns alone (the others zeroed) against its fused prototypes: cosine, class mean."""
    import torch

    from .algorithms.protos import local_prototypes
    from .cache import ClientData

    data = engine.train
    fused, counts = local_prototypes(impl, engine.state, data)  # [H, C, K, d], [H, C, K]
    held = (counts > 0).float()  # [H, C, K]
    edges = np.cumsum([0, *dims])
    sims = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        keep = torch.zeros(data.features.shape[-1], device=data.features.device)
        keep[lo:hi] = 1
        alone, _ = local_prototypes(impl, engine.state, ClientData(data.features * keep, data.labels, data.counts,
                                                                   data.num_classes))  # [H, C, K, d]
        cos = torch.nn.functional.cosine_similarity(alone, fused, dim=-1)  # [H, C, K]
        sims.append((cos * held).sum(-1) / held.sum(-1).clamp(min=1))  # [H, C]
    return {"similarity": torch.stack(sims, -1).tolist()}  # [S, C, B]


STATE_OUTPUTS = {"probe": _probe, "similarity": _similarity}


def _grid_job(job: Job, info: dict, out: Path, settings: dict) -> dict:
    from .grid import grid

    axes = [f"{k}={','.join(str(v) for v in values)}" for k, values in json.loads(job.grid).items()]
    if job.backbones is not None or job.needs:
        raise UserError("a grid run cannot pick backbones or feed probe/protosim metrics: split it into runs")
    found = grid(info["cache"], job.algo, axes, seeds=list(job.seeds), rounds=job.rounds,
                 set=[f"{k}={v}" for k, v in settings.items()], out=out / "runs", device=TRAIN_DEVICE)
    path = found["retrain"]["result_file"]
    return json.loads(Path(path).read_text()) | {"result_file": path,
                                                 "grid": {"best": found["best"], "selection": found["selection"]}}


def _trainable_params(algo: str, cfg: dict, d_in: int, classes: int) -> int:
    """Parameters one client trains (the head on top of the frozen backbones)."""
    import torch

    from .algorithms import create

    impl = create(algo, cfg)
    params, _ = impl.init(cfg, d_in, classes, torch.Generator().manual_seed(0))
    return int(sum(p.numel() for p in params.values()))


@lru_cache(maxsize=None)
def _backbone_params(spec: str, image_size: int | None) -> int:
    from .backbones import create_backbone

    return int(sum(p.numel() for p in create_backbone(spec, image_size=image_size).model.parameters()))




# -- metrics: one job result -> one cell ------------------------------------------------------------------------------
Value = tuple[float, float] | int | None  # mean(std), a count, or None (no counterpart in this data)


def _domain_clients(result: dict, names: str) -> tuple[str | None, list[int]]:
    """The first domain of 'a|b|c' that the result's clients hold, and those clients."""
    for name in names.split("|"):
        clients = [i for i, d in enumerate(result["client_domains"]) if d == name]
        if clients:
            return name, clients
    return None, []


def _domain(result: dict, names: str, pick: int | None) -> Value:
    _, clients = _domain_clients(result, names)
    if not clients:
        return None
    return mean_std(np.asarray(result["per_client_per_seed"])[:, clients].mean(1))


def _protosim(result: dict, names: str, pick: int | None) -> Value:
    """Per seed: the `pick`-th backbone's prototype similarity, mean over the domain's clients."""
    _, clients = _domain_clients(result, names)
    if not clients:
        return None
    return mean_std(np.asarray(result["similarity"])[:, clients, pick].mean(1))  # [S, C, B] -> [S]


METRICS = {
    "acc": lambda r, arg, pick: (r["mean_acc"], r["std_acc"]),
    "best": lambda r, arg, pick: (r["best_round_mean_acc"], r["best_round_std_acc"]),
    "params": lambda r, arg, pick: int(r["params_uploaded_per_round"]),
    "trainable": lambda r, arg, pick: int(r["trainable_params"]),
    "fixed": lambda r, arg, pick: int(r["fixed_params"]),
    "domain": _domain,
    "fair": lambda r, arg, pick: tuple(r["fairness"][arg]),
    "probe": lambda r, arg, pick: mean_std(r["probe"][arg]),
    "protosim": _protosim,
}


def metric_value(result: dict, metric: str, pick: int | None = None) -> Value:
    """`pick`: the backbone a protosim cell reads (its run's first backbone position)."""
    kind, _, arg = metric.partition(":")
    return METRICS[kind](result, arg, pick)


def fmt_value(value: Value, metric: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return f"{value / 1e6:.1f}M" if metric == "fixed" else f"{value:,}"
    return fmt(*value)


def fmt_paper(cell) -> str:
    if isinstance(cell, bool) or cell is None:
        return "—"
    if isinstance(cell, int):
        return f"{cell:,}"
    return str(cell)


# -- rendering --------------------------------------------------------------------------------------------------------
def cell_values(pipe: Pipeline, cells: dict, results: dict) -> dict[tuple[str, str], Value]:
    """(row, column) -> our value; a heatmap with normalize = column divides each column by its sum (as Figure 3)."""
    metric = {c.name: c.metric for c in pipe.columns}
    pick = {r.row: r.backbones[0] for r in pipe.runs if r.backbones}
    values = {}
    for (row, col), job in cells.items():
        values[(row, col)] = metric_value(results[job.key()], metric[col], pick.get(row))
    if pipe.figure.get("normalize") == "column":
        for col in {c for _, c in values}:
            total = sum(v[0] for (_, c), v in values.items() if c == col and isinstance(v, tuple))
            for (row, c), v in list(values.items()):
                if c == col and isinstance(v, tuple) and total > 0:
                    values[(row, c)] = (v[0] / total, v[1] / total)
    return values


def column_labels(pipe: Pipeline, cells: dict, results: dict) -> dict[str, str]:
    """What each mapped paper column is on this data, e.g. 'clients of domain optdigits' for USPS."""
    labels = {}
    for col in pipe.columns:
        jobs = [job for (_, c), job in cells.items() if c == col.name]
        if not jobs:
            labels[col.name] = "not run in this profile"
            continue
        kind, _, arg = col.metric.partition(":")
        if kind in ("domain", "protosim"):
            found = {_domain_clients(results[j.key()], arg)[0] for j in jobs} - {None}
            labels[col.name] = f"clients of domain {', '.join(sorted(found))}" if found else \
                f"n/a (the data has no domain {arg.replace('|', ' or ')})"
        else:
            labels[col.name] = METRIC_TEXT[kind] + (f" {arg}" if arg else "")
    return labels


METRIC_TEXT = {"acc": "final-round accuracy", "best": "best-round accuracy", "params": "floats uploaded per round",
               "trainable": "trainable head parameters", "fixed": "frozen backbone parameters",
               "fair": "fairness", "probe": "probe_match", "domain": "domain", "protosim": "prototype similarity"}


def table_markdown(pipe: Pipeline, values: dict[tuple[str, str], Value]) -> str:
    """Rows = the paper's rows (+ extra rows); for every paper column: ours, then the paper's number.
    '—' = not run (no implementation or not in this profile); 'n/a' = no counterpart in this data."""
    metric = {c.name: c.metric for c in pipe.columns}
    head = ["row"] + [f"{c} {side}" for c in pipe.paper_columns for side in ("ours", "paper")]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for row in pipe.rows:
        paper = pipe.paper_rows.get(row)
        cells = [row]
        for i, col in enumerate(pipe.paper_columns):
            ours = fmt_value(values[(row, col)], metric[col]) if (row, col) in values else "—"
            cells += [ours, fmt_paper(paper[i]) if paper else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def command_line(pipe: Pipeline, profile: str, data_root, dataset, backbones, out, cache) -> str:
    parts = ["featcache", "reproduce", pipe.path, "--profile", profile]
    parts += ["--data-root", str(data_root)] if data_root else []
    parts += ["--dataset", dataset] if dataset else []
    for b in backbones or ():
        parts += ["--backbones", b]
    parts += ["--out", str(out), "--cache", str(cache)]
    return shlex.join(parts)


def render(pipe: Pipeline, profile: str, command: str, cells: dict, results: dict, caches: dict,
           figures: list[str]) -> str:
    """The whole results/NAME.md: header (command, profile, caches and keys), mapping note, table, claims, config."""
    prof = pipe.profiles[profile]
    labels = column_labels(pipe, cells, results)
    out = [f"# {pipe.name}: {pipe.paper} {pipe.table}: {pipe.title}", "",
           f"- command: `{command}`",
           f"- paper: {pipe.source}",
           f"- profile `{profile}`: rounds {prof.rounds}, seeds {', '.join(map(str, prof.seeds))}"
           + (f", settings {json.dumps(prof.set, sort_keys=True)}" if prof.set else "")
           + (f", extract {json.dumps(prof.extract, sort_keys=True)}" if prof.extract else ""),
           f"- featcache {__version__}; caches (content keys):"]
    for info in caches.values():
        out.append(f"  - `{Path(info['cache']).name}` key `{info['key']}` ({info['images']} images, "
                   f"backbones {', '.join(info['backbones'])})")
    out += ["", pipe.note, "", "Our columns: " + "; ".join(f"**{c}** = {labels[c]}" for c in labels), ""]
    out += [table_markdown(pipe, cell_values(pipe, cells, results)),
            "ours: mean(std) over seeds; '—' not run (no implementation, or not in this profile); "
            "'n/a' no counterpart in this data.", ""]
    if pipe.claims:
        out += ["The paper's claims for this target:", ""] + [f"- {c}" for c in pipe.claims] + [""]
    out += [f"![{pipe.name}]({Path(f).name})" for f in figures] + ([""] if figures else [])
    config = {"profile": profile, "jobs": [
        {"cells": [f"{r} / {c}" for (r, c), j in cells.items() if j == job], "algo": job.algo,
         "cache": results[job.key()]["cache"], "backbones": results[job.key()]["backbones"],
         "seeds": list(job.seeds), "config": results[job.key()]["config"]}
        for job in dict.fromkeys(cells.values())]}
    out += ["<details><summary>Resolved configuration</summary>", "", "```json",
            json.dumps(config, indent=1, sort_keys=True), "```", "", "</details>", ""]
    return "\n".join(out)


def _figure(pipe: Pipeline, values: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    number = lambda r, c: isinstance(values.get((r, c.name)), tuple)
    rows = [r for r in pipe.rows if any(number(r, c) for c in pipe.columns)]
    cols = [c for c in pipe.columns if any(number(r, c) for r in rows)]
    if pipe.figure["kind"] == "lines":
        for row in rows:
            pts = [(c.x, values[(row, c.name)]) for c in cols if number(row, c)]
            x = [p[0] for p in pts]
            ax.errorbar(x, [p[1][0] for p in pts], yerr=[p[1][1] for p in pts], marker="o", capsize=3, label=row)
        ax.set_xscale(pipe.figure.get("xscale", "linear"))
        ax.set_xticks([c.x for c in cols], [f"{c.x:g}" for c in cols])
        ax.minorticks_off()
        ax.legend()
        ax.grid(alpha=0.3)
    else:
        grid = np.array([[values[(r, c.name)][0] if number(r, c) else math.nan for c in cols] for r in rows])
        im = ax.imshow(grid, cmap="Blues")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center")
        ax.set_xticks(range(len(cols)), [c.name for c in cols])
        ax.set_yticks(range(len(rows)), rows)
        fig.colorbar(im, ax=ax)
    ax.set_xlabel(pipe.figure.get("xlabel", ""))
    ax.set_ylabel(pipe.figure.get("ylabel", ""))
    ax.set_title(f"{pipe.paper} {pipe.table} (ours)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the command ------------------------------------------------------------------------------------------------------
def reproduce(pipeline: str | Path, profile: str = DEFAULT_PROFILE, data_root: str | Path | None = None,
              dataset: str | None = None, backbones: list[str] | None = None, out: str | Path = "results",
              cache: str | Path = "cache", progress=None) -> dict:
    """Run one pipeline: extract (shared cache folder), train every job, write OUT/NAME.md (+ NAME.png, NAME.json)."""
    t0 = time.perf_counter()
    pipe = load_pipeline(pipeline)
    out, cache = Path(out), Path(cache)
    cells = plan(pipe, profile, dataset, data_root, backbones)
    jobs = list(dict.fromkeys(cells.values()))
    caches, results = {}, {}
    for i, job in enumerate(sorted(jobs, key=lambda j: j.extract)):
        if job.extract not in caches:
            caches[job.extract] = _extract(job.extract_kwargs, cache, progress)
        if progress:
            progress(pipe.name, i, len(jobs))
        results[job.key()] = run_job(job, caches[job.extract], out)
    if progress:
        progress(pipe.name, len(jobs), len(jobs))
    figures = []
    if pipe.figure:
        figures.append(str(out / f"{pipe.name}.png"))
        out.mkdir(parents=True, exist_ok=True)
        _figure(pipe, cell_values(pipe, cells, results), Path(figures[0]))
    command = command_line(pipe, profile, data_root, dataset, backbones, out, cache)
    text = render(pipe, profile, command, cells, results, caches, figures)
    write_atomic(out / f"{pipe.name}.md", text)
    values = cell_values(pipe, cells, results)
    paper = lambda r, c: pipe.paper_rows[r][pipe.paper_columns.index(c)] if r in pipe.paper_rows else None
    write_atomic(out / f"{pipe.name}.json", json.dumps(
        {"pipeline": pipe.name, "profile": profile, "command": command,
         "provenance": provenance(TRAIN_DEVICE, library_call(
             "featcache.reproduce", pipeline=str(pipeline), profile=profile, data_root=data_root and str(data_root),
             dataset=dataset, backbones=backbones, out=str(out), cache=str(cache))),
         "cells": [{"row": r, "column": c, "ours": v, "paper": paper(r, c)} for (r, c), v in values.items()]},
        indent=1, sort_keys=True))
    return {"pipeline": pipe.name, "markdown": str(out / f"{pipe.name}.md"), "figures": figures, "jobs": len(jobs),
            "caches": [info["cache"] for info in caches.values()],
            "table": table_markdown(pipe, values), "seconds": round(time.perf_counter() - t0, 1)}
