"""Running a pipeline: find it (a path, or NAME in ./pipelines/ or the checkout's pipelines/), extract each distinct
extraction once (the content-keyed cache folder is shared by every pipeline), resolve each job's run once
(`RunSpec`, from the pipeline's typed values) and train it through the library's own `train` (after `grid`'s or
`search`'s validation selection when the run has a grid or a search), compute what the job's metrics need, then
write OUT/NAME.md, NAME.json and NAME.png (render.py).

Each result is stored once: train() writes it to OUT/runs/. A job's memo, OUT/jobs/LABEL.json (the run's
`RunSpec.label`: named by what the job trains; `search-ALGO-KEY16` for a search, keyed by the run and the search),
holds only where that result is, where the grid's or the search's selection is (grid.json, search.json), the
outputs its metrics needed (probe, similarity, parameter counts) and the code they came from (`_code`); a re-run,
or another target with the same job, reads these back instead of training. A memo that lacks an output of the
trained state retrains (the same seeds give the same result).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from .. import __version__
from .. import cache as C
from ..atomic import check_folder, write_atomic
from ..errors import UserError, suggest
from ..extraction.plan import Noise, extract
from ..devices import resolve_device
from ..provenance import library_call, provenance
from ..cache.identity import content_key
from ..runs.select import run_grid, run_search
from ..runs.space import parse_space
from ..runs.spec import RunSpec
from ..runs.train import check_outputs, run
from .metrics import NEEDS, RESULT_KEYS
from .plan import DEFAULT_PROFILE, Job, plan
from .agreement import comparability, rank_agreement
from .render import cell_values, column_domains, command_line, figure_png, paper_cell, render, table_markdown
from .schema import Pipeline, parse_pipeline

PIPELINE_DIR = Path("pipelines")  # NAME is looked up here (relative to the working directory) first, then ...
REPO_PIPELINE_DIR = Path(__file__).resolve().parents[2] / "pipelines"  # ... beside the package (a checkout)
# Jobs are memoised under what they train, not where: every job trains on the CPU, so a memoised result never mixes
# with one a GPU rounded differently (train and grid default to --device auto).
TRAIN_DEVICE = "cpu"
HEARTBEAT_S = 20.0  # while a job runs, a progress line at least this often (a log must not fall silent for minutes)


def reproduce(
    pipeline: str | Path,
    profile: str = DEFAULT_PROFILE,
    data_root: str | Path | None = None,
    dataset: str | None = None,
    backbones: list[str] | None = None,
    out: str | Path = "results",
    cache: str | Path = "cache",
    progress=None,
) -> dict:
    """Run one pipeline: extract (shared cache folder), train every job, write OUT/NAME.md (+ NAME.png, NAME.json)."""
    t0 = time.perf_counter()
    pipe = load_pipeline(pipeline)
    out, cache = Path(out), Path(cache)
    check_folder(out)
    check_folder(cache, "--cache")
    cells = plan(pipe, profile, dataset, data_root, backbones)
    jobs = list(dict.fromkeys(cells.values()))
    caches, runs = {}, {}
    for i, job in enumerate(sorted(jobs, key=lambda j: j.extract)):
        if job.extract not in caches:
            with heartbeat(progress, pipe.name, i, len(jobs), "extracting"):
                caches[job.extract] = _extract(job.extract_kwargs, cache, progress)
        if progress:
            progress(pipe.name, i, len(jobs))
        with heartbeat(progress, pipe.name, i, len(jobs), f"job {i + 1} of {len(jobs)} ({job.algo}) training"):
            runs[job.key()] = run_job(job, caches[job.extract], out)
    if progress:
        progress(pipe.name, len(jobs), len(jobs))
    values = cell_values(pipe, cells, runs)
    figures = [str(out / f"{pipe.name}.png")] if pipe.figure else []
    if figures:
        write_atomic(figures[0], figure_png(pipe, values))
    command = command_line(pipe, profile, data_root, dataset, backbones, out, cache)
    why = comparability(pipe, profile, jobs, [_backbones(info["cache"]) for info in caches.values()])
    write_atomic(out / f"{pipe.name}.md", render(pipe, profile, command, cells, runs, caches, figures, why))
    write_atomic(
        out / f"{pipe.name}.json",
        json.dumps(
            {
                "pipeline": pipe.name,
                "profile": profile,
                "command": command,
                "provenance": provenance(
                    TRAIN_DEVICE,
                    library_call(
                        "featcache.reproduce",
                        pipeline=str(pipeline),
                        profile=profile,
                        data_root=data_root and str(data_root),
                        dataset=dataset,
                        backbones=backbones,
                        out=str(out),
                        cache=str(cache),
                    ),
                ),
                "cells": [
                    {"row": r, "column": c, "ours": v, "paper": paper_cell(pipe, r, c)} for (r, c), v in values.items()
                ],
                "comparable": not why,
                "not_comparable_because": why,
                "rank_agreement": rank_agreement(pipe, values),
            },
            indent=1,
            sort_keys=True,
        ),
    )
    return {
        "pipeline": pipe.name,
        "markdown": str(out / f"{pipe.name}.md"),
        "figures": figures,
        "jobs": len(jobs),
        "caches": [info["cache"] for info in caches.values()],
        "embedded": _embedded(caches.values()),
        "images": _embedded(caches.values(), "images"),
        "table": table_markdown(pipe, values, column_domains(pipe, cells, runs)),
        "seconds": round(time.perf_counter() - t0, 1),
    }


@contextmanager
def heartbeat(progress, label: str, done: int, total: int, what: str, every: float | None = None):
    """While the block runs, call `progress(label, done, total, note)` every `every` seconds (default HEARTBEAT_S)
    from a daemon thread, the note saying `what` runs and for how long: a progress line comes at least that often
    however long one job takes (a note always gets its line)."""
    if progress is None:
        yield
        return
    every = HEARTBEAT_S if every is None else every
    stop, t0 = threading.Event(), time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            progress(label, done, total, f"{what}, {time.monotonic() - t0:.0f} s")

    thread = threading.Thread(target=beat, name="featcache-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _backbones(cache: str) -> list[dict]:
    """A cache's backbones in order, as it records them: key, timm architecture, weights source, feature width."""
    with C.open_cache(cache) as f:
        meta = C.read_meta(f)
    return [
        {"key": k, **{a: meta["backbone_info"][k][a] for a in ("name", "weights", "dim")}} for k in meta["backbones"]
    ]


def _embedded(infos, field: str = "embedded") -> dict[str, int]:
    """Images each backbone embedded for this pipeline (the stores' new rows), or, with field 'images', the images
    of the caches it wrote: what embedding once per extraction would have cost."""
    total: dict[str, int] = {}
    for info in (i for i in infos if field == "embedded" or not i["cache_hit"]):
        counts = info["embedded"] if field == "embedded" else dict.fromkeys(info["backbones"], info["images"])
        for key, n in counts.items():
            total[key] = total.get(key, 0) + n
    return total


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
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}): save the pipeline as UTF-8"
        ) from None
    return parse_pipeline(text, str(path))


def _extract(ex: dict, cache: Path, progress) -> dict:
    """extract()'s summary of one extraction, plus what the needs read: backbone widths, client domains, classes."""
    kwargs = dict(ex)
    if "noise" in kwargs:
        kwargs["noise"] = Noise(kwargs["noise"]["kind"], float(kwargs["noise"]["scale"]), float(kwargs["noise"]["p"]))
    info = extract(**kwargs, out=cache, progress=progress)
    with C.open_cache(info["cache"]) as f:
        meta = C.read_meta(f)
    info["dims"] = [int(meta["backbone_info"][k]["dim"]) for k in meta["backbones"]]  # [B] in concat order
    info["client_domains"] = [c["domain"] for c in meta["counts"]["clients"]]
    info["classes"] = len(meta["classes"])
    return info


def run_job(job: Job, info: dict, out: Path) -> dict:
    """Train one job on its extraction `info` (or find it memoised) -> the run its cells read (metrics.py): train()'s
    result restricted to metrics.RESULT_KEYS, `result_file`, `client_domains`, the needed outputs, and `grid` (the
    selection) for a grid job."""
    out = Path(out)
    spec = job_spec(job, info)
    memo, code = out / "jobs" / f"{_memo_label(job, spec, info)}.json", _code(spec)
    found = _read_memo(memo, out, code)
    wanted = [NEEDS[name] for name in job.needs] + [need for need in NEEDS.values() if need.always]
    if found and all(not need.state or need.name in found["outputs"] for need in wanted):
        result_file, grid_file, outputs = found["result_file"], found["grid_file"], dict(found["outputs"])
        search_file = found.get("search_file")
        result, trained = json.loads((out / result_file).read_text()), None
    else:
        result, grid_file, search_file = _train(spec, info, out, any(need.state for need in wanted), job.search)
        result_file, trained = _relative(result["result_file"], out), result.pop("trained", None)
        outputs = dict(found["outputs"]) if found else {}  # the same training: what it gave before still holds
    missing = [need for need in wanted if need.name not in outputs]
    for need in missing:
        outputs[need.name] = need.compute(trained, job, info, result)
    outputs = json.loads(json.dumps(outputs))  # as JSON holds it: lists, not tuples or tensors
    if missing or not found:
        memo_body = {"result_file": result_file, "grid_file": grid_file, "outputs": outputs, "code": code}
        memo_body |= {"search_file": search_file} if search_file else {}
        write_atomic(memo, json.dumps(memo_body, sort_keys=True))
    run = {k: result[k] for k in RESULT_KEYS if k in result}
    run |= {"result_file": str(out / result_file), "client_domains": info["client_domains"]} | outputs
    if grid_file:
        grid = json.loads((out / grid_file).read_text())
        run["grid"] = {"best": grid["best"], "selection": grid["selection"]}
    if search_file:
        found = json.loads((out / search_file).read_text())
        rows = [
            {k: r[k] for k in ("trial", "config", "state", "rounds_trained", "val_mean")} for r in found["selection"]
        ]
        run["search"] = {"best": found["best"], "selection": rows, "model_rounds": found["model_rounds"]}
    return json.loads(json.dumps(run))


def job_spec(job: Job, info: dict) -> RunSpec:
    """The run a job trains on its extraction `info`, resolved from the pipeline's typed values (a grid job: its
    axes; `_train` retrains the point the grid picks)."""
    names = [info["backbones"][i] for i in job.backbones] if job.backbones is not None else None
    axes = json.loads(job.grid) or None
    return RunSpec.resolve(job.algo, job.rounds, list(job.seeds), json.loads(job.settings), names, axes)


def _memo_label(job: Job, spec: RunSpec, info: dict) -> str:
    """A memo's name: the run's label, or for a search job `search-ALGO-KEY16` keyed by the run and the search."""
    if job.search == "{}":
        return spec.label(info)
    return f"search-{spec.name}-{content_key({'run': spec.key(info), 'search': json.loads(job.search)})[:16]}"


def _code(spec: RunSpec) -> str:
    """What else a memo's outputs depend on: featcache's version and, for a plug-in, its source file (an edited
    plug-in trains again)."""
    cls = type(spec.algo)
    if cls.__module__.startswith("featcache."):
        return __version__
    source = hashlib.sha256(Path(inspect.getsourcefile(cls)).read_bytes()).hexdigest()
    return f"{__version__}|{source}"


def _read_memo(memo: Path, out: Path, code: str) -> dict | None:
    """The memo, or None when there is none, it is from an older layout or other code (`_code`), or a file it
    points to is gone."""
    try:
        found = json.loads(memo.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or not isinstance(found.get("outputs"), dict) or found.get("code") != code:
        return None
    files = [found.get("result_file"), *(found[k] for k in ("grid_file", "search_file") if found.get(k))]
    return found if all(isinstance(f, str) and (out / f).is_file() for f in files) else None


def _relative(path: str | Path, out: Path) -> str:
    """A file under OUT as the memo records it: relative to OUT, so the folder can move."""
    return os.path.relpath(path, out)


def _train(
    spec: RunSpec, info: dict, out: Path, keep_state: bool, search: str = "{}"
) -> tuple[dict, str | None, str | None]:
    """Train the job's `spec` (a grid's or a search's: the point it selects on validation) -> (its result, the grid's
    grid.json, the search's search.json)."""
    grid_file = search_file = None
    check_outputs(out / "runs")
    if spec.axes:
        found = run_grid(spec, info["cache"], out / "runs", TRAIN_DEVICE, retrain=False)
        spec, grid_file = spec.pick(found["best"]), _relative(Path(found["run_folder"]) / "grid.json", out)
    if search != "{}":
        options = json.loads(search)
        dims = parse_space(spec.algo, options.pop("space"))
        found = run_search(spec, dims, info["cache"], out / "runs", TRAIN_DEVICE, retrain=False, **options)
        spec, search_file = spec.pick(found["best"]), _relative(Path(found["run_folder"]) / "search.json", out)
    result = run(spec, info["cache"], out / "runs", resolve_device(TRAIN_DEVICE), keep_state=keep_state)
    return result, grid_file, search_file
