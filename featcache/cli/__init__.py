"""The `featcache` command: a thin typer layer over the library; the only package that imports rich.

Every command is one library call with the same argument names. A `UserError` becomes one red line on stderr and
exit code 2; `--json` prints one JSON object on stdout and nothing else there. The commands are grouped by the half
of the library they call (`extraction`, `training`, `results`); `app` holds what they share.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import warnings
from contextlib import contextmanager

import typer
from rich.markup import escape

from .. import provenance
from ..errors import UserError, first_line
from ..memory import keep_freed_memory
from ..threads import passive_wait
from . import extraction, flower, results, training  # noqa: F401  (each registers its commands on the app)
from .app import app, err, help_style, json_stdout

# Its idle torch threads sleep instead of spinning (featcache/threads.py): set before torch loads (nothing above
# imports it), as OpenMP reads it then.
passive_wait()

# The commands in the order `featcache --help` lists them.
COMMANDS = (
    extraction.extract,
    extraction.info,
    extraction.gc,
    extraction.verify,
    extraction.migrate,
    training.train,
    training.grid,
    training.search,
    training.algos,
    results.report,
    results.plot,
    extraction.datasets,
    results.reproduce,
)
# The commands that run training steps: each keeps freed memory (featcache/memory.py) for the next step to reuse.
# The others leave the C library as it is: extract's embedding pass reuses nothing from step to step and would only
# keep its peak.
TRAINING = ("train", "grid", "search", "reproduce")


def _warn_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    err.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)


def _out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return (
        isinstance(e, MemoryError)
        or type(e).__name__ == "OutOfMemoryError"
        or (isinstance(e, RuntimeError) and ("can't allocate memory" in text or "CUDA out of memory" in text))
    )


def main() -> None:
    """Console entry point: user errors are one line and exit code 2, never a traceback; warnings are one line.

    Last resort: any other exception is a bug of featcache; it is one line too ("internal error: ...") with exit code
    1. FEATCACHE_DEBUG=1 re-raises it with its traceback."""
    warnings.showwarning = _warn_one_line
    provenance.set_command(sys.argv)  # result files record the command line (for this call only)
    _RUNNING.clear()
    try:
        with CTRL_C, stoppable():
            _main()
    finally:
        provenance.COMMAND = None


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops as Ctrl-C does: the training commands save where they are


@contextmanager
def stoppable():
    """SIGTERM (what SLURM, `timeout`, `docker stop` and Kubernetes send) and SIGINT (also where a background launch
    inherited it ignored) stop the command as Ctrl-C does: one line, a checkpoint where training ran, exit code 143
    for SIGTERM (128 + 15), 130 for SIGINT."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    except SystemExit as e:
        raise SystemExit(128 + signal.SIGTERM if e.code == 130 and CTRL_C.got(signal.SIGTERM) else e.code) from None
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _error(message: str) -> None:
    err.print(
        f"[red]error:[/red] {escape(' '.join(message.splitlines()))}", highlight=False, soft_wrap=True, emoji=False
    )  # `--algo file.py:X: ...` is no :x: emoji


class _CtrlC:
    """Whether a SIGINT arrived while the command ran: `signal.set_wakeup_fd` records every signal beside whatever
    handler runs it, so a KeyboardInterrupt with no SIGINT behind it is known to be raised by code (a plug-in's
    hook), not by the user's Ctrl-C."""

    def __init__(self) -> None:
        self.read = self.write = None
        self.old, self.seen = -1, set()

    def __enter__(self):
        self.seen = set()
        if threading.current_thread() is threading.main_thread():
            read, write = os.pipe()
            for fd in (read, write):
                os.set_blocking(fd, False)
            try:
                self.old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            except ValueError:  # not the main interpreter: unknown, so a KeyboardInterrupt counts as a Ctrl-C
                os.close(read)
                os.close(write)
            else:
                self.read, self.write = read, write
        return self

    def __exit__(self, *exc) -> None:
        if self.write is not None:
            signal.set_wakeup_fd(self.old)
            os.close(self.read)
            os.close(self.write)
            self.read = self.write = None

    def got(self, sig: int) -> bool:
        """Whether signal `sig` arrived while the command ran."""
        try:
            while self.read is not None and (chunk := os.read(self.read, 512)):
                self.seen.update(chunk)
        except BlockingIOError:
            pass
        return sig in self.seen

    def pressed(self) -> bool:
        """True once a SIGINT or SIGTERM arrived (also when it cannot be known: outside the main thread)."""
        return self.read is None or self.got(signal.SIGINT) or self.got(signal.SIGTERM)


CTRL_C = _CtrlC()


def _original(e: KeyboardInterrupt) -> KeyboardInterrupt:
    """The KeyboardInterrupt itself: a training run re-raises it as `training.checkpoint.Interrupted`."""
    checkpoint = sys.modules.get("featcache.runs.checkpoint")  # loaded only where training ran
    stopped = checkpoint is not None and isinstance(e, checkpoint.Interrupted)
    return e.__context__ if stopped and isinstance(e.__context__, KeyboardInterrupt) else e


def _plugin_interrupt(e: KeyboardInterrupt) -> UserError | None:
    """The one line for a KeyboardInterrupt a plug-in's hook raised itself, with no Ctrl-C pressed (a plug-in bug,
    exit code 2, not an interruption); None for a real Ctrl-C, wherever it landed."""
    algorithms = sys.modules.get("featcache.algorithms")  # loaded only where an algorithm (or plug-in) was
    where = algorithms.plugin_failure(_original(e)) if algorithms is not None else None
    if where is None or CTRL_C.pressed():
        return None
    return UserError(
        f"plug-in failed at {where.partition(': KeyboardInterrupt')[0]}: it raised KeyboardInterrupt "
        "with no Ctrl-C pressed; a hook must return its value or raise an ordinary exception "
        "(FEATCACHE_DEBUG=1 shows the traceback)"
    )


def _tell_interrupt(e: KeyboardInterrupt) -> None:
    """One line for a Ctrl-C: where a training run stopped and how to resume it (`training.checkpoint.Interrupted`)."""
    checkpoint = sys.modules.get("featcache.runs.checkpoint")  # loaded only where training ran
    stopped = checkpoint is not None and isinstance(e, checkpoint.Interrupted)
    what = e if stopped else "run the same command again"
    err.print(f"[yellow]interrupted:[/yellow] {escape(str(what))}", highlight=False, soft_wrap=True)


_RUNNING: list[str] = []  # the command this call of `main` runs (its function's name): an out-of-memory line's advice
_TRAINING = "lower batch_size or the widths (proj_dim, ...), use fewer --seeds, or a smaller --chunk"
_OOM_ADVICE = {
    "extract": "lower --batch-size or --image-size",
    "train": _TRAINING,
    "grid": _TRAINING,
    "search": _TRAINING,
    "reproduce": "lower the pipeline's batch_size or image_size, or run on a machine with more memory",
}


def _wrapped(command):
    """`command` with its KeyboardInterrupt told in one line (typer then exits 130 and keeps the exception), a
    plug-in's own KeyboardInterrupt made its error line, under --json stdout kept for the one JSON object, and a
    training command's allocator setting (`TRAINING`)."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        _RUNNING.append(command.__name__)
        if command.__name__ in TRAINING:
            keep_freed_memory()
        try:
            with json_stdout(bool(kwargs.get("as_json"))):
                return command(*args, **kwargs)
        except KeyboardInterrupt as e:
            error = _plugin_interrupt(e)
            if error is not None:
                raise error from None
            _tell_interrupt(e)
            raise

    return run


# typer's usage errors (click's ClickException: typer vendors click in newer versions, re-exports it in older ones).
CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def usage_error(e: Exception) -> str:
    """typer's usage errors (an unknown option, a missing value, an extra argument) as one line: what is wrong, how
    to fix it and where the help is."""
    ctx = getattr(e, "ctx", None)
    where = ctx.command_path if ctx is not None else "featcache"
    message = e.format_message().rstrip(".")
    takes_set = ctx is not None and any(p.name == "set" for p in ctx.command.params)
    hint = " (an option takes one value: --set key=value)" if takes_set and "extra argument" in message else ""
    return f"{where}: {message}{hint}; see {where} --help"


for command in COMMANDS:
    app.command()(_wrapped(command))


def _main() -> None:
    help_style()
    try:
        code = app(standalone_mode=False)  # usage errors reach the handler below, not typer's boxed message
        if isinstance(code, int):  # --help, --version, Ctrl-C (130)
            sys.exit(code)
    except CLICK_ERROR as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `featcache` alone: its help (rich's is printed already)
            if e.format_message().strip():
                print(e.format_message().rstrip("\n"))
            sys.exit(2)
        _error(usage_error(e))
        sys.exit(2)
    except typer.Abort:  # end of input at a prompt
        sys.exit(1)
    except UserError as e:
        _error(str(e))
        sys.exit(2)
    except SystemExit as e:
        algorithms = sys.modules.get("featcache.algorithms")  # a plug-in's sys.exit() needs them loaded
        error = algorithms.plugin_exit(e) if algorithms is not None else None
        if error is None:
            raise
        _error(str(error))
        sys.exit(2)
    except Exception as e:
        detail = escape(f"{type(e).__name__}: {first_line(e)}")
        if os.environ.get("FEATCACHE_DEBUG", "").strip() not in ("", "0"):
            raise
        from ..algorithms import plugin_failure  # lazy: `featcache --help` skips the algorithm registry

        where = plugin_failure(e)
        if where:  # a bug in the user's own algorithm: their input, so one `error:` line naming the file and hook
            err.print(
                f"[red]error:[/red] plug-in failed at {escape(where)} (FEATCACHE_DEBUG=1 shows the traceback)",
                highlight=False,
                soft_wrap=True,
                emoji=False,
            )
            sys.exit(2)
        if _out_of_memory(e):  # the up-front estimate was too low: still the user's setting, still one line
            advice = _OOM_ADVICE.get(_RUNNING[-1] if _RUNNING else "", _OOM_ADVICE["train"])
            err.print(f"[red]error:[/red] out of memory ({detail}): {advice}", highlight=False, soft_wrap=True)
            sys.exit(2)
        err.print(
            f"[red]internal error:[/red] {detail}; run with FEATCACHE_DEBUG=1 for the traceback, and please report it",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
