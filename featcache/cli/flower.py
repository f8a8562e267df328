"""The federation commands: `split` (one verified cache file per client) and `flower new` (a `flwr run` project of
a featcache run). Registered on the app where app.py ends."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .app import app, emit, out, path_of

flower = typer.Typer(no_args_is_help=True, help="featcache runs as Flower apps (pip install 'featcache[flower]').")
app.add_typer(flower, name="flower")


@app.command()
def split(
    cache: Path = typer.Argument(..., parser=path_of("CACHE"), help="cache file from `featcache extract`"),
    out_dir: Path = typer.Option(..., "--out", parser=path_of("--out"), help="folder for the per-client files"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Write one verified cache file per client (the same key), so a federation's node reads only its own rows."""
    from ..cache.split import split as write  # lazy: `featcache --help` loads no h5py

    result = write(cache, out_dir)
    if as_json:
        emit(result, True)
        return
    for path in result["files"]:
        out.print(path, highlight=False, soft_wrap=True)


@flower.command("new")
def new(
    name: str = typer.Argument(..., help="the project's folder and name"),
    algo: str = typer.Option(..., help="algorithm (see `featcache algos`)"),
    cache: Path = typer.Option(..., parser=path_of("--cache"), help="cache file (or one file of `featcache split`)"),
    rounds: Optional[int] = typer.Option(None, help="communication rounds"),
    seed: int = typer.Option(0, help="the run's seed"),
    set: list[str] = typer.Option([], "--set", help="setting key=value (repeat)"),
    folder: Path = typer.Option(Path("."), "--dir", parser=path_of("--dir"), help="where the project folder goes"),
    results: str = typer.Option("runs", "--out", help="folder the ServerApp writes featcache's result files into"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Write a `flwr run` project (pyproject.toml with [tool.flwr.app]) running ALGO on CACHE as Flower apps."""
    from ..flower.project import new_project  # lazy: loads no torch for --help

    result = new_project(name, algo, cache, rounds, seed, set, folder, results)
    if as_json:
        emit(result, True)
        return
    out.print(f"{result['project']}: {result['run']}", highlight=False, soft_wrap=True)
