"""The training commands: train, grid, search, algos."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..errors import UserError
from .app import Table, emit, err, live_text, out, path_of, progress_bar


def _seeds(text: str) -> list[int]:
    from ..training.config import check_seeds  # lazy: `featcache --help` loads no torch

    return check_seeds(text)  # the comma string parsed as the API parses it (errors.comma_values)


def train(
    cache: list[Path] = typer.Option(
        ...,
        parser=path_of("--cache"),
        help="cache file from `featcache extract`; repeat for a sweep (every algorithm trains on every cache)",
    ),
    algo: list[str] = typer.Option(
        ...,
        help="algorithm (see `featcache algos`), or a plug-in: path/to/file.py:Class "
        "or package.module:Class; repeat to compare several; `all` trains every registered algorithm",
    ),
    rounds: Optional[int] = typer.Option(None, help="communication rounds (default 50)"),
    seeds: str = typer.Option("0,1,2", help="comma-separated seeds; reported as mean(std) over them"),
    set: list[str] = typer.Option(
        [],
        "--set",
        help="override a setting: key=value, or ALGO.key=value for one algorithm (see `featcache algos NAME`)",
    ),
    backbones: Optional[list[str]] = typer.Option(
        None, "--backbones", help="train on these cached backbones' features only (repeat; default: all, concatenated)"
    ),
    out_dir: Path = typer.Option(
        Path("runs"), "--out", parser=path_of("--out"), help="folder for result JSON files (and their NAME.metrics.csv)"
    ),
    device: str = typer.Option("auto", help="auto | cpu | cuda[:N] (auto: cuda when available, else cpu)"),
    tensorboard: Optional[Path] = typer.Option(
        None,
        parser=path_of("--tensorboard"),
        help="also log the per-seed curves for TensorBoard here (DIR/NAME/seed-S)",
    ),
    save_state: bool = typer.Option(
        False, "--save-state", help="also write the trained heads to NAME.state.safetensors"
    ),
    checkpoint_every: Optional[int] = typer.Option(
        None, min=0, help="save a checkpoint every N rounds (0: none; default: every 60 s); the same command resumes it"
    ),
    threads: Optional[int] = typer.Option(
        None,
        min=1,
        help="CPU threads torch runs on (default: torch's own; a checkpoint resumes at the count it was written with)",
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Train federated algorithms on cached features (backbones are never loaded), every algorithm on every cache.
    Interrupted (Ctrl-C, kill), the same command resumes from the last checkpoint and skips the runs that finished."""
    from ..devices import resolve_device  # lazy: `featcache --help` loads no torch
    from ..runs.train import ALL, each_run, plan_runs
    from ..threads import check_threads, use_threads

    dev = resolve_device(device)  # as featcache.train: the device first, then every algorithm's settings
    runs = plan_runs(cache, algo, rounds, seeds, set, backbones, out_dir, tensorboard, checkpoint_every)
    results = []
    with progress_bar(not as_json) as progress, use_threads(check_threads(threads)):
        ticker = _ticker(runs, progress, _names(cache))
        options = dict(tensorboard=tensorboard, save_state=save_state)
        for result in each_run(runs, out_dir, dev, algo, ticker, checkpoint_every, **options):
            results.append(result)
            if not as_json and "failed" not in result:  # each result as soon as it is written
                _print_run(result)
    if as_json:
        emit(results[0] if len(results) == 1 else {"runs": results}, True)
        return
    out.print(_table(results, cache, sort=algo == [ALL]))


def _names(caches: list[Path]) -> dict[str, str] | None:
    """How the output names each cache where there are several (None: one): its file name, or the path as given
    where two share a name."""
    if len(caches) == 1:
        return None
    short = len({c.name for c in caches}) == len(caches)
    return {str(c): c.name if short else str(c) for c in caches}


def _ticker(runs: list, progress, names: dict[str, str] | None):
    """`progress_of(cache, spec)` for `each_run`: a run's progress bar, labelled by its algorithm (and its cache by
    `names` when there are several), and its notes once its first round here trained (where it resumed, what its
    loss is)."""
    from ..algorithms import objective_note  # lazy: `featcache --help` skips the algorithm registry

    def ticker(cache: Path, spec):
        label = f"{spec.name} on {names[str(cache)]}" if names else spec.name
        label += f" ({runs.index((cache, spec)) + 1} of {len(runs)})" if len(runs) > 1 else ""
        note = objective_note(spec.algo, spec.config)

        def tick(done, total, live, told=[]):  # noqa: B006 - told: this label's own memory of its first tick
            if not told:  # once its first round here trained: a refused run stays one error line
                told.append(done)
                said = [f"resumed from its checkpoint after round {done - 1}"] if done > 1 else []
                said += [f"the training loss is {note}"] if note else []
                for text in said:
                    err.print(f"[yellow]note:[/yellow] {escape(f'{label}: {text}')}", highlight=False, soft_wrap=True)
            progress(label, done, total, live_text(live))

        return tick if progress else None

    return ticker


def _table(results: list[dict], caches: list[Path], sort: bool) -> Table:
    """`train`'s table: a row per run (best first with `sort`: `--algo all`'s leaderboard, cache by cache), failed
    ones last; with several caches, a column names each run's cache."""
    names = _names(caches)
    table = Table(title=f"featcache train — {f'{len(caches)} caches' if names else caches[0].name}")
    heads = ["cache"] * bool(names) + ["algorithm", "final acc % mean(std)", "best-round acc %", "global"]
    for col in (*heads, "params up/client/round", "KB up/client/round", "s/round"):
        table.add_column(col, justify="left" if col in ("cache", "algorithm") else "right")
    where = lambda r: [names[r["cache_path"]]] if names else []
    order = {str(c): i for i, c in enumerate(caches)}
    trained = [r for r in results if "failed" not in r]
    for r in sorted(trained, key=lambda r: (order[r["cache_path"]], -r["mean_acc"])) if sort else trained:
        glob = "n/a" if r["global_mean_acc"] is None else f"{r['global_mean_acc']:.2f}({r['global_std_acc']:.2f})"
        table.add_row(
            *where(r),
            r["algo"],
            f"{r['mean_acc']:.2f}({r['std_acc']:.2f})",
            f"{r['best_round_mean_acc']:.2f}({r['best_round_std_acc']:.2f})",
            glob,
            f"{r['params_uploaded_per_round']:,}",
            f"{r['bytes_uploaded_per_round'] / 1024:.1f}",
            f"{r['seconds_per_round']:.4f}",
        )
    for r in results:
        if "failed" in r:  # last, with its line (the warning said it when it happened)
            table.add_row(*where(r), r["algo"], "failed", *[""] * 5)
    return table


def _print_run(r: dict) -> None:
    """One finished algorithm: its final and best-round accuracy, and the files it wrote."""
    written = [r["result_file"], r["metrics_csv"], r["state_file"], r["tensorboard"]]
    out.print(
        f"{escape(r['algo'])}: final acc {r['mean_acc']:.2f}({r['std_acc']:.2f}) %, best-round "
        f"{r['best_round_mean_acc']:.2f}({r['best_round_std_acc']:.2f}) % [dim]→ "
        f"{', '.join(escape(w) for w in written if w)}[/dim]",
        soft_wrap=True,
        highlight=False,
    )


def grid(
    cache: Path = typer.Option(
        ..., parser=path_of("--cache"), help="cache file from `featcache extract` (with a validation split)"
    ),
    algo: str = typer.Option(..., help="algorithm (see `featcache algos`), or a plug-in: path/to/file.py:Class"),
    grid: list[str] = typer.Option(..., "--grid", help="axis: key=v1,v2,... (repeat for more axes)"),
    seeds: str = typer.Option("0,1,2", help="comma-separated seeds"),
    rounds: Optional[int] = typer.Option(None, help="communication rounds"),
    set: list[str] = typer.Option([], "--set", help="fixed setting key=value for every configuration"),
    backbones: Optional[list[str]] = typer.Option(
        None, "--backbones", help="train on these cached backbones' features only (repeat; default: all, concatenated)"
    ),
    out_dir: Path = typer.Option(
        Path("runs"), "--out", parser=path_of("--out"), help="folder for the grid's run folder"
    ),
    device: str = typer.Option("auto", help="auto | cpu | cuda[:N] (auto: cuda when available, else cpu)"),
    backend: str = typer.Option("local", help="local (in-process) | ray (RAY_ADDRESS or a local Ray)"),
    chunk: Optional[int] = typer.Option(None, help="models per batched run, >= 1 (default: planned from memory)"),
    retrain: bool = typer.Option(
        True, help="retrain the best configuration on the full train split and report its test accuracy"
    ),
    threads: Optional[int] = typer.Option(None, min=1, help="CPU threads torch runs on (default: torch's own)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Train a hyperparameter grid batched, select on validation, retrain the best, report test accuracy."""
    from ..algorithms import load  # lazy: `featcache --help` skips the algorithm registry
    from ..runs.select import check_options, run_grid  # lazy: `featcache --help` loads no torch
    from ..runs.spec import RunSpec
    from ..threads import check_threads, use_threads

    algo = load(algo)  # a plug-in spec: registered here, shown by its name
    check_options(backend, chunk)
    spec = RunSpec.resolve(algo, rounds, _seeds(seeds), set, backbones, grid)
    with progress_bar(not as_json) as progress, use_threads(check_threads(threads)):
        result = run_grid(spec, cache, out_dir, device, backend, chunk, retrain, progress)
    if as_json:
        emit(result, True)
        return
    keys = list(result["axes"])
    table = Table(
        *keys,
        "val acc % mean(std)",
        title=f"{algo} grid: {result['configs']} configs x "
        f"{len(result['seeds'])} seeds, {result['chunks']} chunk(s) of <= {result['chunk_size']} models",
    )
    for row in result["selection"]:
        score = "failed" if row["val_mean"] is None else f"{row['val_mean']:.2f}({row['val_std']:.2f})"
        table.add_row(*(str(row["config"][k]) for k in keys), score)
    out.print(table)
    if "retrain" in result:
        r = result["retrain"]
        out.print(f"best {result['best']} retrained on full train: test acc {r['mean_acc']:.2f}({r['std_acc']:.2f})")
    out.print(f"[dim]{result['run_folder']}/grid.json, grid.csv[/dim]")


def search(
    cache: Path = typer.Option(
        ..., parser=path_of("--cache"), help="cache file from `featcache extract` (with a validation split)"
    ),
    algo: str = typer.Option(..., help="algorithm (see `featcache algos`), or a plug-in: path/to/file.py:Class"),
    space: list[str] = typer.Option(
        ..., "--space", help="key=v1,v2,... or key=KIND:low,high, KIND uniform|loguniform|int|logint (repeat)"
    ),
    trials: int = typer.Option(16, help="trials to train (each for every seed)"),
    sampler: str = typer.Option("random", help="random | tpe | grid (Optuna's, seeded by --sampler-seed)"),
    pruner: str = typer.Option("halving", help="none | halving (successive halving) | hyperband"),
    seeds: str = typer.Option("0,1,2", help="comma-separated seeds every trial trains"),
    rounds: Optional[int] = typer.Option(None, help="communication rounds (the pruner's budget)"),
    set: list[str] = typer.Option([], "--set", help="fixed setting key=value for every trial"),
    backbones: Optional[list[str]] = typer.Option(
        None, "--backbones", help="train on these cached backbones' features only (repeat; default: all, concatenated)"
    ),
    out_dir: Path = typer.Option(
        Path("runs"), "--out", parser=path_of("--out"), help="folder for the search's run folder"
    ),
    device: str = typer.Option("auto", help="auto | cpu | cuda[:N] (auto: cuda when available, else cpu)"),
    batch: Optional[int] = typer.Option(None, help="trials per batched run (default: all; a quarter for tpe)"),
    sampler_seed: int = typer.Option(0, help="the sampler's seed"),
    rungs: int = typer.Option(2, help="pruning rungs, the first at round ceil(rounds / reduction^rungs)"),
    reduction: int = typer.Option(4, help="the reduction factor η: the top 1/η of a rung's trials go on"),
    retrain: bool = typer.Option(
        True, help="retrain the best trial on the full train split and report its test accuracy"
    ),
    threads: Optional[int] = typer.Option(None, min=1, help="CPU threads torch runs on (default: torch's own)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Search sampled hyperparameters batched, pruning trials on validation; retrain the best, report test accuracy."""
    from ..algorithms import load  # lazy: `featcache --help` skips the algorithm registry
    from ..runs.select import run_search
    from ..runs.space import parse_space, search_options  # lazy: `featcache --help` loads no torch
    from ..runs.spec import RunSpec, given_once
    from ..threads import check_threads, use_threads

    algo = load(algo)  # a plug-in spec: registered here, shown by its name
    options = search_options(trials, sampler, pruner, batch, sampler_seed, rungs, reduction)
    spec = RunSpec.resolve(algo, rounds, _seeds(seeds), set, backbones)
    dims = parse_space(spec.algo, space)
    given_once(spec.algo, dims, set, rounds, "--space setting")
    with progress_bar(not as_json) as progress, use_threads(check_threads(threads)):
        result = run_search(spec, dims, cache, out_dir, device, retrain, progress, **options)
    if as_json:
        emit(result, True)
        return
    keys = list(result["space"])
    table = Table(
        "trial",
        *keys,
        "val acc % mean(std)",
        "stopped",
        title=f"{algo} search: {result['trials']} trials x {len(result['seeds'])} seeds, {result['sampler']} sampler, "
        f"{result['pruner']} pruner; {result['model_rounds']} of {result['model_rounds_unpruned']} model-rounds",
    )
    for row in result["selection"]:
        stopped = "-" if row["state"] == "complete" else f"round {row['rounds_trained']}"
        table.add_row(
            str(row["trial"]),
            *(
                f"{row['config'][k]:.4g}" if isinstance(row["config"][k], float) else str(row["config"][k])
                for k in keys
            ),
            "-" if row["val_mean"] is None else f"{row['val_mean']:.2f}({row['val_std']:.2f})",
            stopped if row["state"] != "failed" else f"failed, round {row['rounds_trained']}",
        )
    out.print(table)
    for row in result["selection"]:
        if row.get("reason"):
            out.print(f"trial {row['trial']} failed: {escape(row['reason'])}", soft_wrap=True, highlight=False)
    if "retrain" in result:
        r = result["retrain"]
        out.print(f"best {result['best']} retrained on full train: test acc {r['mean_acc']:.2f}({r['std_acc']:.2f})")
    out.print(f"[dim]{result['run_folder']}/search.json, search.csv[/dim]")


def algos_markdown() -> str:
    """The built-in algorithms and the unavailable methods as the Markdown table of featcache/algorithms/README.md
    (`featcache algos --markdown` prints it; tests/test_docs.py fails when the committed copy differs)."""
    from ..algorithms import UNAVAILABLE, list_algorithms, objective_text  # lazy: `featcache --help`
    from ..algorithms.plugins import BUILTIN

    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    rows = ["| algorithm | reference | a client uploads | note |", "|---|---|---|---|"]
    for key, cls in list_algorithms().items():
        if not cls.__module__.startswith(BUILTIN):
            continue  # plug-ins loaded in this process are not part of the package's table
        objective = objective_text(cls)
        note = "; ".join(filter(None, [cls.limitation, objective and f"training loss {objective}"]))
        rows.append(f"| `{key}` | {cell(cls.paper)} | {cell(cls.uploads)} | {cell(note)} |")
    for key, why in UNAVAILABLE.items():
        rows.append(f"| `{key}` | — | — | not available: {cell(why)} |")
    return "\n".join(rows) + "\n"


def algos(
    name: Optional[str] = typer.Argument(None, help="show one algorithm's settings (a name or file.py:Class)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    markdown: bool = typer.Option(
        False,
        "--markdown",
        help="print the built-in algorithms as the Markdown table of featcache/algorithms/README.md",
    ),
) -> None:
    """List the registered algorithms with their paper reference and what a client uploads; with a NAME, its
    settings as the algorithm declares them."""
    from ..algorithms import UNAVAILABLE, create, list_algorithms, objective_text  # lazy: `featcache --help`
    from ..training.config import describe  # lazy: `featcache --help` loads no torch

    if markdown:
        if name or as_json:
            raise UserError("--markdown prints the whole registry: give it without NAME or --json")
        print(algos_markdown(), end="")
        return
    if as_json:
        if name:
            algo = create(name)
            emit(
                {
                    "algo": algo.name,
                    "paper": algo.paper,
                    "uploads": algo.uploads,
                    "limitation": getattr(algo, "limitation", ""),
                    "objective": objective_text(algo),
                    "settings": describe(algo),
                },
                True,
            )
            return
        emit(
            {
                "algorithms": {
                    key: {
                        "paper": cls.paper,
                        "uploads": cls.uploads,
                        "limitation": getattr(cls, "limitation", ""),
                        "objective": objective_text(cls),
                        "settings": describe(cls),
                    }
                    for key, cls in list_algorithms().items()
                },
                "unavailable": dict(UNAVAILABLE),
            },
            True,
        )
        return
    if name:
        algo = create(name)
        table = Table("setting", "default", "type", "range", "batched", "help", title=f"{algo.name} — {algo.paper}")
        for k, s in describe(algo).items():
            table.add_row(k, repr(s["default"]), s["type"], s["range"], "yes" if s["batched"] else "no", s["help"])
        out.print(table)
        out.print("batched: a grid over it trains its values as one batched run (other settings: one run per value)")
        if objective_text(algo):
            out.print(f"training loss: {escape(objective_text(algo))}", highlight=False)
        return
    table = Table("algorithm", "reference", "uploads", "limitation / training loss")
    for key, cls in list_algorithms().items():
        note = objective_text(cls)
        table.add_row(
            key,
            cls.paper,
            cls.uploads,
            "; ".join(filter(None, [getattr(cls, "limitation", ""), note and f"training loss {note}"])),
        )
    for key, why in UNAVAILABLE.items():
        table.add_row(key, "", "—", f"not available on cached features: {why}")
    out.print(table)
