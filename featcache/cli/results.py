"""The results commands: report, plot, reproduce."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from .app import emit, err, out, path_of, progress_bar


def report(
    results: list[Path] = typer.Argument(
        ...,
        parser=path_of("RESULTS"),
        help="result JSON files from `featcache train`, or folders holding them (the *.json directly in each folder)",
    ),
    out_dir: Optional[Path] = typer.Option(
        None,
        "--out",
        parser=path_of("--out"),
        help="write report.md, curves.png, clients.png (and sweep.png for results of several caches) here",
    ),
    x: Optional[str] = typer.Option(
        None,
        "--x",
        help="results of several caches: the cache parameter on the x axis (alpha, clients, partition, per_class, "
        "backbones, ...; default: the one that differs); the others that differ draw one line per value",
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (the table, the notes, the files)"),
) -> None:
    """Render result files as a markdown table (and PNG curves and per-client bars with --out); results of several
    caches (a sweep) as accuracy against the parameter that differs."""
    from ..results import report as render  # lazy: `featcache --help` loads no numpy

    rendered = render(results, out_dir, x=x)
    for line in rendered["skipped"]:
        err.print(f"[yellow]note:[/yellow] {escape(line)}", highlight=False, soft_wrap=True)
    if as_json:
        emit(rendered, True)
    else:
        print(rendered["table"])


def plot(
    state: Path = typer.Argument(
        ..., parser=path_of("STATE"), help="saved state NAME.state.safetensors (`featcache train --save-state`)"
    ),
    cache: Path = typer.Option(..., parser=path_of("--cache"), help="the cache the state was trained on"),
    method: str = typer.Option("tsne", help="tsne | pca"),
    split: str = typer.Option(
        "test",
        help="train | val | test: whose rows to embed (val: the validation rows of the train split, which the saved "
        "model also trained on)",
    ),
    seed: Optional[int] = typer.Option(
        None, help="which trained seed to draw (default: the first); also seeds the subsample and t-SNE"
    ),
    max_points: int = typer.Option(2000, help="draw at most this many points (a seeded random subsample)"),
    out_file: Optional[Path] = typer.Option(
        None, "--out", parser=path_of("--out"), help="PNG file (default: beside the state, NAME.METHOD-SPLIT.png)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Draw a t-SNE or PCA of the learned features (the head's embedding) per client and class."""
    from ..results import plot as draw  # lazy: `featcache --help` loads no numpy

    result = draw(state, cache, method=method, split=split, seed=seed, max_points=max_points, out=out_file)
    if as_json:
        emit(result, True)
        return
    out.print(
        f"{result['figure']} ({result['method']} of {result['points']} points: {result['clients']} clients, "
        f"{result['classes']} classes, seed {result['seed']}, {result['split']} split)",
        highlight=False,
        soft_wrap=True,
    )


def reproduce(
    pipeline: str = typer.Argument(..., help="pipelines/NAME.toml, or NAME"),
    profile: str = typer.Option(
        "full", help="full (the papers' rounds and seeds; the default, as for the make targets) | quick (minutes)"
    ),
    data_root: Optional[Path] = typer.Option(
        None, parser=path_of("--data-root"), help="folder with the paper's dataset (default: offline data)"
    ),
    dataset: Optional[str] = typer.Option(None, help="dataset override (with --data-root, default: the paper's)"),
    backbones: Optional[list[str]] = typer.Option(None, "--backbones", help="backbone override, in order; repeat"),
    out_dir: Path = typer.Option(
        Path("results"), "--out", parser=path_of("--out"), help="folder for NAME.md, NAME.png and job results"
    ),
    cache: Path = typer.Option(
        Path("cache"), parser=path_of("--cache"), help="cache folder (shared by every pipeline)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Reproduce one paper table or figure: extract, train, write our numbers beside the paper's."""
    from ..reproduce import reproduce as run  # lazy: `featcache --help` loads no torch

    with progress_bar(not as_json) as progress:
        result = run(
            pipeline=pipeline,
            profile=profile,
            data_root=data_root,
            dataset=dataset,
            backbones=backbones,
            out=out_dir,
            cache=cache,
            progress=progress,
        )
    if as_json:
        emit(result, True)
        return
    print(result["table"])
    out.print(f"[dim]{result['markdown']} ({result['jobs']} jobs, {result['seconds']} s)[/dim]")
    embedded = ", ".join(f"{k} {n} of {result['images'][k]}" for k, n in result["embedded"].items())
    out.print(f"[dim]images embedded (of the caches' images): {embedded or 'none, every cache was found'}[/dim]")
