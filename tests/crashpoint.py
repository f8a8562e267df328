"""Run the featcache CLI in this process with a fault injected at a chosen point (driven by test_faults.py).

    python tests/crashpoint.py [--kill SPEC] [--sigint SPEC] [--sigterm SPEC] [--pause SPEC:FILE] [--log FILE] -- ...

SPEC is WHEN:FUNCTION:N:PATTERN, e.g. `after:os.replace:3:b*.npy`: the N-th call of FUNCTION (a dotted path:
`os.replace`, `featcache.extraction.embed._forward`, `featcache.cache.h5._new_dataset`) that has an argument whose file
name matches PATTERN (`*` counts every call) triggers, `before` or `after` the call runs.

--kill   the process sends itself SIGKILL: a real kill -9, no exception handler, finally block or atexit hook runs.
--sigint the process sends itself SIGINT: a real Ctrl-C, handled by whatever SIGINT handler is installed then (the
         CLI's own: this driver installs none, so a driver started with SIGINT ignored runs as `nohup` does).
--sigterm the process sends itself SIGTERM, as SLURM, `timeout` and Kubernetes stop a job.
--pause  the process waits until FILE exists (holding whatever locks it holds), then goes on.
--log    appends JSON lines to FILE: {"replace": "folder/name"} for every os.replace destination, {"forward": images}
         for every forward pass, and {"parts": {"folder/name": [inode, mtime_ns]}} of a store's finished blocks each
         time a fill commits them.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable


def resolve(dotted: str) -> tuple[object, str]:
    """(owner, attribute) for a dotted path: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ValueError(f"cannot resolve {dotted}")


def wrap(dotted: str, hook: Callable[[tuple], None], when: str = "after") -> None:
    """Replace FUNCTION by a wrapper that calls `hook(args)` before or after each call."""
    owner, attr = resolve(dotted)
    original = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        if when == "before":
            hook(args)
        result = original(*args, **kwargs)
        if when == "after":
            hook(args)
        return result

    setattr(owner, attr, wrapper)


def trigger(spec: str, action: Callable[[], None]) -> None:
    when, dotted, n, pattern = spec.split(":", 3)
    calls = 0

    def hook(args: tuple) -> None:
        nonlocal calls
        names = [os.path.basename(os.fspath(a)) for a in args if isinstance(a, (str, os.PathLike))]
        if pattern == "*" or any(fnmatch.fnmatch(name, pattern) for name in names):
            calls += 1
            if calls == int(n):
                action()

    wrap(dotted, hook, when)


def log_to(path: str) -> None:
    def write(record: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def where(file) -> str:
        file = Path(os.fspath(file))
        return f"{file.parent.name}/{file.name}"

    wrap("os.replace", lambda args: write({"replace": where(args[1])}))
    wrap("featcache.extraction.embed._forward", lambda args: write({"forward": args[2]}))  # (model, x, n, dev)
    wrap(
        "featcache.extraction.store.Store.commit",
        lambda args: write(
            {"parts": {where(p): [p.stat().st_ino, p.stat().st_mtime_ns] for p in sorted(args[0].work.glob("*.npy"))}}
        ),
        when="before",
    )


def wait_for(flag: str) -> None:
    while not Path(flag).exists():
        time.sleep(0.01)


def main() -> None:
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill")
    parser.add_argument("--sigint")
    parser.add_argument("--sigterm")
    parser.add_argument("--pause")
    parser.add_argument("--log")
    opts = parser.parse_args(sys.argv[1:split])
    if opts.kill:
        trigger(opts.kill, lambda: os.kill(os.getpid(), signal.SIGKILL))
    if opts.sigint:
        trigger(opts.sigint, lambda: os.kill(os.getpid(), signal.SIGINT))
    if opts.sigterm:
        trigger(opts.sigterm, lambda: os.kill(os.getpid(), signal.SIGTERM))
    if opts.pause:
        spec, _, flag = opts.pause.rpartition(":")
        trigger(spec, lambda: wait_for(flag))
    if opts.log:
        log_to(opts.log)
    from featcache.cli import main as cli

    sys.argv = ["featcache", *sys.argv[split + 1 :]]
    cli()


if __name__ == "__main__":
    main()
