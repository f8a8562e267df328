"""The training commands: train, grid, algos."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import UserError
from .app import emit, err, out, progress_bar


def _seeds(text: str) -> list[int]:
    from ..training.config import check_seeds  # lazy: `featcache --help` loads no torch

    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--seeds {text!r}: write comma-separated integers, e.g. 0,1,2") from None
    return check_seeds(seeds)


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
    checkpoint_every: Optional[int] = typer.Option(None, min=0, help="save a checkpoint every N rounds (0: none; "
                                                   "default: every 60 s); the same command resumes it"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Train federated algorithms on cached features (backbones are never loaded). Interrupted (Ctrl-C, kill), the
    same command resumes from the last checkpoint and skips the algorithms that finished."""
    from ..algorithms import load  # lazy: `featcache --help` skips the algorithm registry
    from ..training.train import precheck, train as run  # lazy: `featcache --help` loads no torch

    algo = [load(a) for a in algo]  # plug-in specs (file.py:Class) are imported and registered by their names
    twice = sorted({a for a in algo if algo.count(a) > 1})
    if twice:
        raise UserError(f"--algo {twice[0]} is given twice: list each algorithm once")
    seed_list = _seeds(seeds)
    for name in algo:  # every algorithm's settings and the output folder, before the first one trains
        precheck(algo=name, rounds=rounds, seeds=seed_list, set=set, out=out_dir, device=device,
                 tensorboard=tensorboard)
    results = []
    with progress_bar(not as_json) as progress, _stop_line():
        for name in algo:
            tick = (lambda done, total, name=name: progress(name, done, total)) if progress else None
            results.append(run(cache=cache, algo=name, rounds=rounds, seeds=seed_list, set=set, out=out_dir,
                               device=device, tensorboard=tensorboard, save_state=save_state, progress=tick,
                               checkpoint_every=checkpoint_every))
    if as_json:
        emit(results[0] if len(results) == 1 else {"runs": results}, True)
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


@contextmanager
def _stop_line():
    """Ctrl-C during `train`: the library's one line saying where the run stopped and how to resume (exit 130)."""
    from ..training.checkpoint import Interrupted  # lazy: `featcache --help` loads no torch

    try:
        yield
    except Interrupted as e:
        err.print(f"[yellow]interrupted:[/yellow] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise


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
    from ..algorithms import load  # lazy: `featcache --help` skips the algorithm registry
    from ..training.grid import grid as run  # lazy: `featcache --help` loads no torch

    algo = load(algo)  # a plug-in spec: registered here, shown by its name
    seed_list = _seeds(seeds)
    with progress_bar(not as_json) as progress:
        result = run(cache=cache, algo=algo, grid=grid, seeds=seed_list, rounds=rounds, set=set, out=out_dir,
                     device=device, backend=backend, chunk=chunk, progress=progress)
    if as_json:
        emit(result, True)
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


def algos(name: Optional[str] = typer.Argument(None, help="show one algorithm's settings (a name or file.py:Class)"),
          as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """List the registered algorithms with their paper reference and what a client uploads; with a NAME, its
    settings as the algorithm declares them."""
    from ..algorithms import UNAVAILABLE, create, list_algorithms  # lazy: `featcache --help` skips the registry
    from ..training.config import describe  # lazy: `featcache --help` loads no torch

    if as_json:
        if name:
            algo = create(name)
            emit({"algo": algo.name, "paper": algo.paper, "uploads": algo.uploads,
                  "limitation": getattr(algo, "limitation", ""), "settings": describe(algo)}, True)
            return
        emit({"algorithms": {key: {"paper": cls.paper, "uploads": cls.uploads,
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
