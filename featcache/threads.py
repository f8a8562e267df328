"""featcache's thread policy: how torch's CPU threads wait, and how many each command runs on.

torch's CPU ops run on OpenMP threads (GNU libgomp in PyPI's wheels). By default a thread that finishes its share
of an op spins, waiting for the others, before it sleeps. When another process holds a core, the thread on that core
is descheduled in the middle of an op and every op waits for it while the others spin: two threads can run a round
several times slower than one (`bench/threads.py`). So:

- waiting: the `featcache` command starts torch with `WAIT` (OMP_WAIT_POLICY=PASSIVE: an idle thread sleeps at
  once) unless the environment sets it. OpenMP reads it once, when torch loads: a library user exports it, or calls
  `passive_wait()` before anything imports torch. It changes how threads wait, never what they compute.
- counting: `train` and `grid` run on torch's count (OMP_NUM_THREADS, `torch.set_num_threads`, or torch's default:
  the cores); `extract`'s forward on one fewer than the cores this process may use (`pipeline.forward_threads`).
  `threads=N` (`--threads N`) runs the command on N instead (at most the cores, capped with a warning), restored
  afterwards; a command that runs no model loads no torch for it. The count follows the machine and the option,
  never the momentary load: float sums split across threads round differently, so a result's bytes, and a checkpoint
  (refused at another count), hold for one count.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from contextlib import contextmanager
from contextvars import ContextVar

from .errors import UserError

WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}  # the environment the `featcache` command starts torch with (unless set)
_ASKED: ContextVar[int | None] = ContextVar("featcache_threads", default=None)  # the `threads` option in force


def asked() -> int | None:
    """The `threads` option of the command running (None: the policy's count)."""
    return _ASKED.get()


def passive_wait() -> bool:
    """Set `WAIT` in this process's environment where the user has not set it; returns whether torch's threads will
    wait passively (False where torch was imported before: its OpenMP has read the environment already)."""
    for name, value in WAIT.items():
        os.environ.setdefault(name, value)
    return "torch" not in sys.modules and all(os.environ[name].upper() == value for name, value in WAIT.items())


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_threads(threads) -> int | None:
    """The `threads` option checked: None (the policy's count) or a number of threads >= 1, capped at `cores()` with
    a one-line warning (more threads than cores only wait for each other)."""
    if threads is None:
        return None
    if not (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
        raise UserError(f"--threads must be a whole number >= 1 (got {threads!r}); leave it out for featcache's choice")
    if threads > (most := cores()):
        warnings.warn(
            f"--threads {threads} is more than the {most} cores this process may run on: running on {most}",
            UserWarning,
            stacklevel=2,
        )
        return most
    return threads


@contextmanager
def use_threads(threads: int | None, load: bool = False):
    """torch runs on `threads` threads inside (None: as it was), restored on exit. Where torch is not loaded it is
    loaded for this only with `load` (a pass about to run a model): a command that runs no model (a cache hit, a
    re-partition) never loads it, and extract sets the count again around its embedding pass (`asked()`)."""
    token = _ASKED.set(threads)
    if "torch" not in sys.modules and not (load and threads is not None):
        try:
            yield
        finally:
            _ASKED.reset(token)
        return
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        _ASKED.reset(token)
        torch.set_num_threads(before)


def threaded(command):
    """`command` (a library function with a `threads` argument) run inside `use_threads(threads)`, checked first."""
    signature = inspect.signature(command)

    @functools.wraps(command)
    def run(*args, **kwargs):
        threads = signature.bind(*args, **kwargs).arguments.get("threads")
        with use_threads(check_threads(threads)):
            return command(*args, **kwargs)

    return run
