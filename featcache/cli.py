"""The `featcache` command: a thin typer layer over the library; the only module that imports rich.

Every command is one library call with the same argument names. A `UserError` becomes one red line on stderr and
exit code 2; `--json` prints one JSON object on stdout and nothing else there.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from . import provenance
from .errors import UserError
from .memory import keep_freed_memory

# The command owns its process: freed tensors' pages stay in it for the next step to reuse (featcache/memory.py).
keep_freed_memory()

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run frozen backbones once, cache embeddings in HDF5, train federated heads on them.")
# Off a terminal (a pipe, a log file) rich would wrap tables at 80 columns and cut their cells: give it room.
out = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 120)


PLAIN_EVERY_S = 30.0  # when stderr is not a terminal: a line per label at least every 30 s ...
PLAIN_STEP = 0.1  # ... and at every 10 % of its total


def plain_progress(write=None, clock=time.monotonic):
    """A `(label, done, total)` callback for logs (stderr not a terminal: nohup, SLURM, CI): plain lines such as
    `progress: fedavg 10/50 (20 %) 12 s` at every 10 % of a label's total, at least every 30 s while it advances,
    and at its end; nothing before the first update."""
    write = write or (lambda line: print(line, file=sys.stderr, flush=True))
    start, last = {}, {}  # label -> first update time; label -> (time, fraction) of the last line

    def update(label: str, done: int, total: int) -> None:
        now = clock()
        start.setdefault(label, now)
        frac = done / total if total else 1.0
        t, f = last.get(label, (None, None))
        if (t is None or frac >= 1.0 and f < 1.0 or int(frac / PLAIN_STEP) > int(f / PLAIN_STEP)
                or now - t >= PLAIN_EVERY_S and frac > f):
            last[label] = (now, frac)
            write(f"progress: {label} {done}/{total} ({100 * frac:.0f} %) {now - start[label]:.0f} s")

    return update


@contextmanager
def progress_bar(enabled: bool = True):
    """Yield a `(label, done, total)` callback that drives one rich bar per label (on stderr), or, when stderr is not
    a terminal, prints plain periodic lines (`plain_progress`). The bars appear with the first update, so a command
    refused before any work prints its one error line and nothing else."""
    if not enabled:
        yield None
        return
    if not err.is_terminal:
        yield plain_progress()
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=False)
    tasks: dict[str, int] = {}

    def update(label: str, done: int, total: int) -> None:
        if not tasks:
            bar.start()
        if label not in tasks:
            tasks[label] = bar.add_task(label, total=total)
        bar.update(tasks[label], completed=done, total=total)

    try:
        yield update
    except BaseException:
        bar.live.transient = True  # on an error, its one-line message is all that stays on screen
        raise
    finally:
        if tasks:
            bar.stop()


def _emit(result: dict, as_json: bool, table: Table | None = None) -> None:
    if as_json:
        print(json.dumps(result, sort_keys=True))
    elif table is not None:
        out.print(table)


@app.command()
def extract(
    dataset: str = typer.Option("offline-digits", help="dataset name (see `featcache datasets`)"),
    backbone: list[str] = typer.Option(["efficientnet_lite0"], help="timm name, NAME=CHECKPOINT or NAME=random; repeat for several"),
    partition: str = typer.Option("feature", help="feature | label | feature-label | pathological | iid"),
    clients: Optional[str] = typer.Option(None, help="number of clients (default: one per domain / 5); a comma list "
                                                     "(5,10,20) writes one cache per value"),
    alpha: str = typer.Option("0.5", help="Dirichlet concentration for label skew; a comma list sweeps"),
    per_class: Optional[str] = typer.Option(None, help="train images per class per client (FedPCL: 10); a comma "
                                                       "list sweeps"),
    test_per_class: Optional[int] = typer.Option(None, help="test images per class per client (FedPCL: 200)"),
    classes_per_client: int = typer.Option(2, help="classes per client for the pathological partition"),
    domain: Optional[list[str]] = typer.Option(None, help="use only these domains (repeat)"),
    val_fraction: float = typer.Option(0.2, help="share of train held out for validation (grid search)"),
    order: str = typer.Option("shuffled", help="which images of a class a client takes: shuffled (seeded) | first "
                                               "(the dataset's order, FedPCL's first 10 per class)"),
    image_size: Optional[int] = typer.Option(None, help="input size override (FedPCL: 64 for ResNet18)"),
    views: int = typer.Option(0, help="augmented views per training image (FedPCL two-crop, FedPFT+Con)"),
    noise: Optional[str] = typer.Option(None, help="image noise: laplace or gaussian (FedPCL A.2.4)"),
    noise_scale: float = typer.Option(0.2, help="noise scale s"),
    noise_p: float = typer.Option(0.1, help="perturbation coefficient p: x~ = (1-p) x + e"),
    seed: int = typer.Option(0, help="seed of partition, views and noise"),
    data_root: Optional[Path] = typer.Option(None, help="folder holding the dataset"),
    download: bool = typer.Option(False, help="let torchvision datasets download (online users)"),
    out_dir: Path = typer.Option(Path("cache"), "--out", help="folder for caches"),
    store: Optional[Path] = typer.Option(None, help="folder of the embedding stores (default: OUT/store); share one "
                                                    "between projects or machines"),
    batch_size: Optional[int] = typer.Option(None, help="images per forward pass (default: 256 on CUDA, 64 on CPU)"),
    workers: Optional[int] = typer.Option(None, help="input worker processes (default: 0 for in-memory arrays, "
                                                     "else one per core)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    backend: str = typer.Option("local", help="local (this process) | ray (RAY_ADDRESS or a local Ray)"),
    allow_partial: bool = typer.Option(False, help="load checkpoints whose keys do not all match (rest: random)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Run each frozen backbone once over every client's images and write the embeddings to an HDF5 cache."""
    from .extraction.plan import Noise, extract as run

    with progress_bar(not as_json) as progress:
        result = run(
            dataset=dataset, backbone=backbone, partition=partition, clients=_sweep(clients, int, "--clients"),
            alpha=_sweep(alpha, float, "--alpha"), per_class=_sweep(per_class, int, "--per-class"),
            test_per_class=test_per_class, classes_per_client=classes_per_client,
            domains=domain, val_fraction=val_fraction, order=order, image_size=image_size, views=views,
            noise=Noise(noise, noise_scale, noise_p) if noise else None, seed=seed, data_root=data_root,
            download=download, out=out_dir, store=store, batch_size=batch_size, workers=workers, device=device, backend=backend,
            allow_partial=allow_partial, progress=progress,
        )
    table = Table(title="featcache extract")
    for r in result.get("caches", [result]):
        table.add_row("cache", f"{r['cache']} ({'hit' if r['cache_hit'] else 'written'}, {r['images']} images)")
    table.add_row("backbones", ", ".join(result.get("backbones") or result["caches"][0]["backbones"]))
    table.add_row("embedded", ", ".join(f"{k} {n} images" for k, n in result["embedded"].items()) or "nothing")
    table.add_row("seconds", str(result["seconds"]))
    if "phases" in result:  # a miss: where the seconds went
        table.add_row("phases", " · ".join(f"{k} {v:.1f} s" for k, v in result["phases"].items()))
    table.show_header = False
    _emit(result, as_json, table)


def _sweep(text: str | None, kind: type, flag: str):
    """'0.1,0.5,1' -> [0.1, 0.5, 1.0]; one value -> that value; None -> None."""
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} takes a {kind.__name__} or a comma list of them (got {text!r})") from None
    return values if len(values) > 1 else values[0]


@app.command()
def info(cache: Path = typer.Argument(..., help="cache file, store file or folder of stores"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """Show a cache's metadata and per-client counts, or what a store (or a folder of them) holds."""
    from .cache import info as read
    from .extraction.stores import info as read_store, is_store

    if is_store(cache):
        _show_stores(read_store(cache), as_json)
        return
    meta = read(cache)
    if as_json:
        _emit(meta, True)
        return
    head = Table(title=str(cache), show_header=False)
    for k in ("dataset", "backbones", "classes", "domains", "partition", "views", "images", "bytes", "created", "key"):
        head.add_row(k, json.dumps(meta.get(k)))
    for k, b in meta["backbone_info"].items():
        head.add_row(f"backbone {k}", f"{b['name']} dim={b['dim']} weights={b['weights']} sha256={b['weights_sha256'][:12]}")
    out.print(head)
    counts = Table(title="clients")
    for col in ("client", "domain", "train", "val", "test"):
        counts.add_column(col)
    for c in meta["counts"]["clients"]:
        counts.add_row(*(str(c[col]) for col in ("client", "domain", "train", "val", "test")))
    out.print(counts)


def _show_stores(found: dict, as_json: bool) -> None:
    table = Table(title=f"stores in {found['path']}")
    for col in ("backbone", "dim", "views", "images", "held", "MB"):
        table.add_column(col)
    for st in found["stores"]:
        held = " · ".join(f"{k} {n}" for k, n in st["held"].items())
        table.add_row(st["backbone"], str(st["dim"]), str(st["views"]), str(st["images"]), held,
                      f"{st['bytes'] / 2**20:.1f}")
    _emit(found, as_json, table)


@app.command()
def gc(store: Path = typer.Argument(..., help="folder of embedding stores (default of extract: CACHE/store)"),
       dry_run: bool = typer.Option(False, help="say what would be removed, remove nothing"),
       as_json: bool = typer.Option(False, "--json")) -> None:
    """Check every store in a folder and remove the ones no command can use (damaged, or made by other code or
    library versions), with their leftover parts folders."""
    from .extraction.stores import gc as collect

    report = collect(store, dry_run=dry_run)
    table = Table(title=f"featcache gc {store}" + (" (dry run)" if dry_run else ""), show_header=False)
    for entry in report["removed"]:
        table.add_row("would remove" if dry_run else "removed", entry["file"], entry["reason"])
    for entry in report["kept"]:
        table.add_row("kept", entry["file"], "checksums match")
    _emit(report, as_json, table)


@app.command()
def verify(cache: Path = typer.Argument(..., help="cache file"), as_json: bool = typer.Option(False, "--json")) -> None:
    """Check a cache: schema, counts, finite features, checksums; report library versions that changed since."""
    from .cache import verify as check

    report = check(cache)
    if as_json:
        _emit(report, True)
    elif report["ok"]:
        out.print(f"ok: {cache} ({report['arrays']} arrays, checksums match, {report['seconds']} s)", soft_wrap=True)
    for line in report["stale"]:
        err.print(f"[yellow]warning:[/yellow] extracted with {line}", highlight=False, soft_wrap=True)
    if not report["ok"]:
        first = report["problems"][0]
        more = f" (+{len(report['problems']) - 1} more, see --json)" if len(report["problems"]) > 1 else ""
        raise UserError(f"{first}{more}" if str(cache) in first else f"{cache}: {first}{more}")


@app.command()
def migrate(cache: Path = typer.Argument(..., help="cache file of an older format"),
            as_json: bool = typer.Option(False, "--json")) -> None:
    """Convert a cache of an older format to the current one, in place (its feature bytes are kept and checked)."""
    from .cache import migrate as convert

    report = convert(cache)
    if as_json:
        _emit(report, True)
    else:
        out.print(f"migrated: {cache} (format {report['from_format']} -> {report['to_format']}, "
                  f"{report['bytes_before']} -> {report['bytes']} bytes)", soft_wrap=True)


def _seeds(text: str) -> list[int]:
    from .training.config import check_seeds

    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--seeds {text!r}: write comma-separated integers, e.g. 0,1,2") from None
    return check_seeds(seeds)


@app.command()
def train(
    cache: Path = typer.Option(..., help="cache file from `featcache extract`"),
    algo: list[str] = typer.Option(..., help="algorithm (see `featcache algos`), or a plug-in: path/to/file.py:Class "
                                             "or package.module:Class; repeat to compare several"),
    rounds: Optional[int] = typer.Option(None, help="communication rounds (default 50)"),
    seeds: str = typer.Option("0,1,2", help="comma-separated seeds; reported as mean(std) over them"),
    set: list[str] = typer.Option([], "--set", help="override a setting: key=value (see `featcache algos NAME`)"),
    out_dir: Path = typer.Option(Path("runs"), "--out", help="folder for result JSON files (and their "
                                                             "NAME.metrics.csv)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda[:N] (auto: cuda when available, else cpu)"),
    tensorboard: Optional[Path] = typer.Option(None, help="also log the per-seed curves for TensorBoard here "
                                                          "(DIR/NAME/seed-S)"),
    save_state: bool = typer.Option(False, "--save-state", help="also write the trained heads to "
                                                                "NAME.state.safetensors"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Train federated algorithms on cached features (backbones are never loaded)."""
    from .algorithms import load
    from .train import precheck, train as run

    algo = [load(a) for a in algo]  # plug-in specs (file.py:Class) are imported and registered by their names
    twice = sorted({a for a in algo if algo.count(a) > 1})
    if twice:
        raise UserError(f"--algo {twice[0]} is given twice: list each algorithm once")
    seed_list = _seeds(seeds)
    for name in algo:  # every algorithm's settings and the output folder, before the first one trains
        precheck(algo=name, rounds=rounds, seeds=seed_list, set=set, out=out_dir, device=device,
                 tensorboard=tensorboard)
    results = []
    with progress_bar(not as_json) as progress:
        for name in algo:
            tick = (lambda done, total, name=name: progress(name, done, total)) if progress else None
            results.append(run(cache=cache, algo=name, rounds=rounds, seeds=seed_list, set=set, out=out_dir,
                               device=device, tensorboard=tensorboard, save_state=save_state, progress=tick))
    if as_json:
        _emit(results[0] if len(results) == 1 else {"runs": results}, True)
        return
    table = Table(title=f"featcache train — {cache.name}")
    for col in ("algorithm", "final acc % mean(std)", "best-round acc %", "global", "params up/client/round",
                "KB up/client/round", "s/round"):
        table.add_column(col, justify="right" if col != "algorithm" else "left")
    for r in results:
        glob = "n/a" if r["global_mean_acc"] is None else f"{r['global_mean_acc']:.2f}({r['global_std_acc']:.2f})"
        table.add_row(r["algo"], f"{r['mean_acc']:.2f}({r['std_acc']:.2f})",
                      f"{r['best_round_mean_acc']:.2f}({r['best_round_std_acc']:.2f})", glob,
                      f"{r['params_uploaded_per_round']:,}", f"{r['bytes_uploaded_per_round'] / 1024:.1f}",
                      f"{r['seconds_per_round']:.4f}")
    out.print(table)
    for r in results:
        written = [r["result_file"], r["metrics_csv"], r["state_file"], r["tensorboard"]]
        out.print(f"[dim]{r['algo']}: {', '.join(escape(w) for w in written if w)}[/dim]", soft_wrap=True)


@app.command()
def grid(
    cache: Path = typer.Option(..., help="cache file from `featcache extract` (with a validation split)"),
    algo: str = typer.Option(..., help="algorithm (see `featcache algos`), or a plug-in: path/to/file.py:Class"),
    grid: list[str] = typer.Option(..., "--grid", help="axis: key=v1,v2,... (repeat for more axes)"),
    seeds: str = typer.Option("0,1,2", help="comma-separated seeds"),
    rounds: Optional[int] = typer.Option(None, help="communication rounds"),
    set: list[str] = typer.Option([], "--set", help="fixed setting key=value for every configuration"),
    out_dir: Path = typer.Option(Path("runs"), "--out", help="folder for the grid's run folder"),
    device: str = typer.Option("auto", help="auto | cpu | cuda[:N] (auto: cuda when available, else cpu)"),
    backend: str = typer.Option("local", help="local (in-process) | ray (RAY_ADDRESS or a local Ray)"),
    chunk: Optional[int] = typer.Option(None, help="models per batched run, >= 1 (default: planned from memory)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Train a hyperparameter grid batched, select on validation, retrain the best, report test accuracy."""
    from .algorithms import load
    from .grid import grid as run

    algo = load(algo)  # a plug-in spec: registered here, shown by its name
    seed_list = _seeds(seeds)
    with progress_bar(not as_json) as progress:
        result = run(cache=cache, algo=algo, grid=grid, seeds=seed_list, rounds=rounds, set=set, out=out_dir,
                     device=device, backend=backend, chunk=chunk, progress=progress)
    if as_json:
        _emit(result, True)
        return
    keys = list(result["axes"])
    table = Table(*keys, "val acc % mean(std)", title=f"{algo} grid: {result['configs']} configs x "
                  f"{len(result['seeds'])} seeds, {result['chunks']} chunk(s) of <= {result['chunk_size']} models")
    for row in result["selection"]:
        table.add_row(*(str(row["config"][k]) for k in keys), f"{row['val_mean']:.2f}({row['val_std']:.2f})")
    out.print(table)
    if "retrain" in result:
        r = result["retrain"]
        out.print(f"best {result['best']} retrained on full train: test acc {r['mean_acc']:.2f}({r['std_acc']:.2f})")
    out.print(f"[dim]{result['run_folder']}/grid.json, grid.csv[/dim]")


@app.command()
def algos(name: Optional[str] = typer.Argument(None, help="show one algorithm's settings (a name or file.py:Class)"),
          as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """List the registered algorithms with their paper reference and what a client uploads; with a NAME, its
    settings as the algorithm declares them."""
    from .algorithms import UNAVAILABLE, create, list_algorithms
    from .training.config import describe

    if as_json:
        if name:
            algo = create(name)
            _emit({"algo": algo.name, "paper": algo.paper, "uploads": algo.uploads,
                   "limitation": getattr(algo, "limitation", ""), "settings": describe(algo)}, True)
            return
        _emit({"algorithms": {key: {"paper": cls.paper, "uploads": cls.uploads,
                                    "limitation": getattr(cls, "limitation", ""), "settings": describe(cls)}
                              for key, cls in list_algorithms().items()},
               "unavailable": dict(UNAVAILABLE)}, True)
        return
    if name:
        algo = create(name)
        table = Table("setting", "default", "type", "range", "batched", "help", title=f"{algo.name} — {algo.paper}")
        for k, s in describe(algo).items():
            table.add_row(k, repr(s["default"]), s["type"], s["range"], "yes" if s["batched"] else "no", s["help"])
        out.print(table)
        out.print("batched: a grid over it trains its values as one batched run (other settings: one run per value)")
        return
    table = Table("algorithm", "reference", "uploads", "limitation")
    for key, cls in list_algorithms().items():
        table.add_row(key, cls.paper, cls.uploads, getattr(cls, "limitation", ""))
    for key, why in UNAVAILABLE.items():
        table.add_row(key, "", "—", f"not available on cached features: {why}")
    out.print(table)


@app.command()
def report(
    results: list[Path] = typer.Argument(..., help="result JSON files from `featcache train`, or folders holding them "
                                                   "(the *.json directly in each folder)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="write report.md, curves.png and clients.png here"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (the table, the notes, the files)"),
) -> None:
    """Render result files as a markdown table (and PNG curves and per-client bars with --out)."""
    from .report import report as render

    rendered = render(results, out_dir)
    for line in rendered["skipped"]:
        err.print(f"[yellow]note:[/yellow] {escape(line)}", highlight=False, soft_wrap=True)
    if as_json:
        _emit(rendered, True)
    else:
        print(rendered["table"])


@app.command()
def plot(
    state: Path = typer.Argument(..., help="saved state NAME.state.safetensors (`featcache train --save-state`)"),
    cache: Path = typer.Option(..., help="the cache the state was trained on"),
    method: str = typer.Option("tsne", help="tsne | pca"),
    split: str = typer.Option("test", help="train | val | test: whose rows to embed (val: the validation rows of the train split, which the saved model also trained on)"),
    seed: Optional[int] = typer.Option(None, help="which trained seed to draw (default: the first); also seeds the "
                                                  "subsample and t-SNE"),
    max_points: int = typer.Option(2000, help="draw at most this many points (a seeded random subsample)"),
    out_file: Optional[Path] = typer.Option(None, "--out", help="PNG file (default: beside the state, "
                                                                "NAME.METHOD-SPLIT.png)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Draw a t-SNE or PCA of the learned features (the head's embedding) per client and class."""
    from .plot import plot as draw

    result = draw(state, cache, method=method, split=split, seed=seed, max_points=max_points, out=out_file)
    if as_json:
        _emit(result, True)
        return
    out.print(f"{result['figure']} ({result['method']} of {result['points']} points: {result['clients']} clients, "
              f"{result['classes']} classes, seed {result['seed']}, {result['split']} split)", highlight=False,
              soft_wrap=True)


@app.command()
def datasets(as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """List the dataset readers and the layout each expects."""
    from .extraction.datasets import list_datasets

    if as_json:
        _emit({"datasets": dict(sorted(list_datasets().items()))}, True)
        return
    table = Table("dataset", "expected layout")
    for name, layout in sorted(list_datasets().items()):
        table.add_row(name, layout)
    out.print(table)


@app.command()
def reproduce(
    pipeline: str = typer.Argument(..., help="pipelines/NAME.toml, or NAME"),
    profile: str = typer.Option("full", help="full (the papers' rounds and seeds; the default, as for the make "
                                             "targets) | quick (minutes)"),
    data_root: Optional[Path] = typer.Option(None, help="folder with the paper's dataset (default: offline data)"),
    dataset: Optional[str] = typer.Option(None, help="dataset override (with --data-root, default: the paper's)"),
    backbones: Optional[list[str]] = typer.Option(None, "--backbones", help="backbone override, in order; repeat"),
    out_dir: Path = typer.Option(Path("results"), "--out", help="folder for NAME.md, NAME.png and job results"),
    cache: Path = typer.Option(Path("cache"), help="cache folder (shared by every pipeline)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Reproduce one paper table or figure: extract, train, write our numbers beside the paper's."""
    from .reproduce import reproduce as run

    with progress_bar(not as_json) as progress:
        result = run(pipeline=pipeline, profile=profile, data_root=data_root, dataset=dataset, backbones=backbones,
                     out=out_dir, cache=cache, progress=progress)
    if as_json:
        _emit(result, True)
        return
    print(result["table"])
    out.print(f"[dim]{result['markdown']} ({result['jobs']} jobs, {result['seconds']} s)[/dim]")
    embedded = ", ".join(f"{k} {n} of {result['images'][k]}" for k, n in result["embedded"].items())
    out.print(f"[dim]images embedded (of the caches' images): {embedded or 'none, every cache was found'}[/dim]")


def _warn_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    err.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split("\n")[0].split()) or "(no message)"
    return f"{type(e).__name__}: {text[:300]}"


def _out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in text or "CUDA out of memory" in text))


def main() -> None:
    """Console entry point: user errors are one line and exit code 2, never a traceback; warnings are one line.

    Last resort: any other exception is a bug of featcache; it is one line too ("internal error: ...") with exit code
    1. FEATCACHE_DEBUG=1 re-raises it with its traceback."""
    warnings.showwarning = _warn_one_line
    provenance.set_command(sys.argv)  # result files record the command line (for this call only)
    try:
        _main()
    finally:
        provenance.COMMAND = None


def _main() -> None:
    try:
        app()
    except UserError as e:
        err.print(f"[red]error:[/red] {escape(' '.join(str(e).splitlines()))}", highlight=False, soft_wrap=True,
                  emoji=False)  # `--algo file.py:X: ...` is no :x: emoji
        sys.exit(2)
    except Exception as e:
        if os.environ.get("FEATCACHE_DEBUG", "").strip() not in ("", "0"):
            raise
        from .algorithms import plugin_failure

        where = plugin_failure(e)
        if where:  # a bug in the user's own algorithm: their input, so one `error:` line naming the file and hook
            err.print(f"[red]error:[/red] plug-in failed at {escape(where)} (FEATCACHE_DEBUG=1 shows the traceback)",
                      highlight=False, soft_wrap=True, emoji=False)
            sys.exit(2)
        if _out_of_memory(e):  # the up-front estimate was too low: still the user's setting, still one line
            err.print(f"[red]error:[/red] out of memory ({escape(_first_line(e))}): lower batch_size or the widths "
                      "(proj_dim, ...), use fewer --seeds, or a smaller --chunk", highlight=False, soft_wrap=True)
            sys.exit(2)
        err.print(f"[red]internal error:[/red] {escape(_first_line(e))}; run with FEATCACHE_DEBUG=1 for the "
                  "traceback, and please report it", highlight=False, soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
