"""The typer app, its two consoles and what every command shares: progress on stderr, one JSON object or a table
on stdout."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import contextmanager, redirect_stdout
from typing import TYPE_CHECKING

import click
import typer
from rich.console import Console

from ..atomic import output_error
from ..errors import as_path

if TYPE_CHECKING:
    from rich.table import Table as RichTable

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Run frozen backbones once, cache embeddings in HDF5, train federated heads on them.",
)
RICH_HELP = app.rich_markup_mode
RICH_HELP_COLUMNS = 100  # rich's boxed help cuts long option names (`--classes-per-cl…`) on narrower screens


def help_style() -> None:
    """`--help` boxed by rich on a terminal at least RICH_HELP_COLUMNS wide; elsewhere (a pipe, a log, a narrow
    terminal) click's plain help, which wraps the descriptions and never cuts an option name."""
    wide = sys.stdout.isatty() and shutil.get_terminal_size().columns >= RICH_HELP_COLUMNS
    app.rich_markup_mode = RICH_HELP if wide else None
    click.Context.formatter_class = PlainHelp


class PlainHelp(click.HelpFormatter):
    """click's help formatter without the rich markup escape typer leaves in it (`\\[default: ...]`): rich's help
    never reaches this formatter, so the plain help alone is unescaped."""

    def write_dl(self, rows, *args, **kwargs) -> None:
        super().write_dl([(term, text.replace("\\[", "[")) for term, text in rows], *args, **kwargs)


# Off a terminal (a pipe, a log file) rich would wrap tables at 80 columns and cut their cells: give it room.
out = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 120)


def _version(asked: bool) -> None:
    if asked:
        from .. import __version__

        print(f"featcache {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print featcache's version and exit"
    ),
) -> None:
    pass  # the options of `featcache` itself (the app's help above describes it)


def path_of(name: str):
    """The parser of a path option or argument: '' is refused in one line naming it (typer would make it Path('.'),
    the current folder)."""

    def path(text: str):
        return as_path(text, name)

    return path  # its name is the metavar `--help` shows: PATH (a lambda showed <LAMBDA>)


PLAIN_EVERY_S = 30.0  # when stderr is not a terminal: a line per label at least every 30 s ...
PLAIN_STEP = 0.1  # ... and at every 10 % of its total


def live_text(live: dict | None) -> str:
    """An evaluation round's numbers (`evaluate.live_metrics`) as one short text: the mean over seeds of the test
    accuracy and training loss, then each seed's, e.g. `acc 92.10% loss 0.3101 | seed 0 91.93% 0.305, seed 1 ...`."""
    if not live:
        return ""
    acc, loss, seeds = live["test_acc"], live["train_loss"], live["seeds"]
    known = [x for x in loss if x == x]  # NaN: a configuration none of whose clients took part
    mean_loss = sum(known) / len(known) if known else float("nan")
    text = f"acc {sum(acc) / len(acc):.2f}% loss {mean_loss:.4g}"
    if len(seeds) == 1:
        return f"{text} (seed {seeds[0]})"
    return f"{text} | " + ", ".join(f"seed {s} {a:.2f}% {x:.4g}" for s, a, x in zip(seeds, acc, loss))


def plain_progress(write=None, clock=time.monotonic):
    """A `(label, done, total, note="")` callback for logs (stderr not a terminal: nohup, SLURM, CI): plain lines
    such as `progress: fedavg 10/50 (20 %) 12 s` at every 10 % of a label's total, at least every 30 s while it
    advances, and at its end; an update with a `note` (an evaluation round's metrics) always gets its line, the note
    after a `·`. Nothing before the first update."""
    write = write or (lambda line: print(line, file=sys.stderr, flush=True))
    start, last = {}, {}  # label -> first update time; label -> (time, fraction) of the last line

    def update(label: str, done: int, total: int, note: str = "") -> None:
        now = clock()
        start.setdefault(label, now)
        frac = done / total if total else 1.0
        t, f = last.get(label, (None, None))
        if (
            note
            or t is None
            or frac >= 1.0
            and f < 1.0
            or int(frac / PLAIN_STEP) > int(f / PLAIN_STEP)
            or now - t >= PLAIN_EVERY_S
            and frac > f
        ):
            last[label] = (now, frac)
            write(
                f"progress: {label} {done}/{total} ({100 * frac:.0f} %) {now - start[label]:.0f} s"
                + (f" · {note}" if note else "")
            )

    return update


@contextmanager
def progress_bar(enabled: bool = True):
    """Yield a `(label, done, total, note="")` callback that drives one rich bar per label (on stderr), the latest
    note (an evaluation round's metrics) beside it, or, when stderr is not a terminal, prints plain periodic lines
    (`plain_progress`). The bars appear with the first update, so a command
    refused before any work prints its one error line and nothing else."""
    if not enabled:
        yield None
        return
    if not err.is_terminal:
        yield plain_progress()
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
        console=err,
        transient=False,
    )
    tasks: dict[str, int] = {}

    def update(label: str, done: int, total: int, note: str = "") -> None:
        if not tasks:
            bar.start()
        if label not in tasks:
            tasks[label] = bar.add_task(label, total=total, note="")
        bar.update(tasks[label], completed=done, total=total, **({"note": note} if note else {}))

    try:
        yield update
    except BaseException:
        bar.live.transient = True  # on an error, its one-line message is all that stays on screen
        raise
    finally:
        if tasks:
            bar.stop()


_JSON_OUT: list = []  # the real stdout while a --json command runs with sys.stdout sent to stderr


@contextmanager
def json_stdout(as_json: bool):
    """Under --json, whatever the library or a plug-in prints goes to stderr while the command runs: stdout holds
    the one JSON object `emit` writes, nothing else."""
    if not as_json:
        yield
        return
    _JSON_OUT.append(sys.stdout)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        _JSON_OUT.pop()


def Table(*columns, **options) -> RichTable:  # noqa: N802 - stands in for rich's class
    """rich's `Table(*columns, **options)`, its module imported by the first table a command builds (a command
    under --json builds its table and drops it, and a cache hit should not wait for the import)."""
    from rich.table import Table as RichTable  # noqa: F811 - the class itself, at run time

    return RichTable(*columns, **options)


def emit(result: dict, as_json: bool, table: RichTable | None = None) -> None:
    """The command's answer on stdout: one JSON object (as_json) or the table."""
    if as_json:
        write_stdout(json.dumps(result, sort_keys=True) + "\n", _JSON_OUT[-1] if _JSON_OUT else None)
    elif table is not None:
        with out.capture() as captured:
            out.print(table)
        write_stdout(captured.get())


def write_stdout(text: str, stream=None) -> None:
    """Write `text` to stdout (or `stream`) whole, or raise one error line: a stdout that fills up (a full disk,
    ulimit -f) must not end in a cut JSON object and exit code 0. Python's buffered writer drops what a short write
    left over without an error, so a real file descriptor is written with os.write until every byte is out."""
    stream = stream or sys.stdout
    try:
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):  # a StringIO (tests), pytest's capture: plain writes
            stream.write(text)
            stream.flush()
            return
        stream.flush()
        data = memoryview(text.encode(getattr(stream, "encoding", None) or "utf-8", "replace"))
        while data:
            data = data[os.write(fd, data) :]
    except OSError as e:
        mapped = output_error(e, "standard output")
        if mapped is None:
            raise
        raise mapped from None
