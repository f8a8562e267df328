"""The `featcache` command: a thin typer layer over the library; the only package that imports rich.

Every command is one library call with the same argument names. A `UserError` becomes one red line on stderr and
exit code 2; `--json` prints one JSON object on stdout and nothing else there. The commands are grouped by the half
of the library they call (`extraction`, `training`, `results`); `app` holds what they share.
"""

from __future__ import annotations

import os
import sys
import warnings

from rich.markup import escape

from .. import provenance
from ..errors import UserError, first_line
from ..memory import keep_freed_memory
from . import extraction, results, training
from .app import app, err

# The command owns its process: freed tensors' pages stay in it for the next step to reuse (featcache/memory.py).
keep_freed_memory()

# The commands in the order `featcache --help` lists them.
COMMANDS = (extraction.extract, extraction.info, extraction.gc, extraction.verify, extraction.migrate, training.train,
            training.grid, training.algos, results.report, results.plot, extraction.datasets, results.reproduce)
for command in COMMANDS:
    app.command()(command)


def _warn_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    err.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)


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


def _error(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(' '.join(message.splitlines()))}", highlight=False, soft_wrap=True,
              emoji=False)  # `--algo file.py:X: ...` is no :x: emoji


def _interrupt(e: SystemExit) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt behind typer's exit code 130, if that is what `e` is."""
    seen = e.__context__ or e.__cause__
    while seen is not None and not isinstance(seen, KeyboardInterrupt):
        seen = seen.__cause__ or seen.__context__
    return seen if e.code == 130 else None


def _main() -> None:
    try:
        app()
    except UserError as e:
        _error(str(e))
        sys.exit(2)
    except SystemExit as e:
        if "featcache.algorithms" not in sys.modules:  # no algorithm, no plug-in was loaded (`featcache --help`)
            plugin_exit = plugin_failure = lambda _: None
        else:
            from ..algorithms import plugin_exit, plugin_failure

        interrupt = _interrupt(e)
        if interrupt is not None:  # Ctrl-C, or a KeyboardInterrupt raised in a plug-in's hook: one line, exit 130
            where = plugin_failure(interrupt)
            at = f" (KeyboardInterrupt raised at {where.partition(': KeyboardInterrupt')[0]})" if where else ""
            _error(f"interrupted{at}: run the same command again")
            sys.exit(130)
        error = plugin_exit(e)
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
            err.print(f"[red]error:[/red] plug-in failed at {escape(where)} (FEATCACHE_DEBUG=1 shows the traceback)",
                      highlight=False, soft_wrap=True, emoji=False)
            sys.exit(2)
        if _out_of_memory(e):  # the up-front estimate was too low: still the user's setting, still one line
            err.print(f"[red]error:[/red] out of memory ({detail}): lower batch_size or the widths "
                      "(proj_dim, ...), use fewer --seeds, or a smaller --chunk", highlight=False, soft_wrap=True)
            sys.exit(2)
        err.print(f"[red]internal error:[/red] {detail}; run with FEATCACHE_DEBUG=1 for the "
                  "traceback, and please report it", highlight=False, soft_wrap=True)
        sys.exit(1)
