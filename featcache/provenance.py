"""Where a result came from: the machine, torch's threads, featcache's commit and the command, for every result file.

Only what is the same for repeated runs on one machine at one commit is recorded (no timestamps, no timings, no
hostnames), so the same seed and command still give the same result file there. Every probe is best-effort: a value
that cannot be read is None, never an error.
"""

from __future__ import annotations

import functools
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from . import __version__

# The command line, set by the CLI entry point (`featcache.cli.main`); None when featcache is used as a library.
COMMAND: list[str] | None = None


def set_command(argv: list[str]) -> None:
    """Record the command line of this process (the CLI calls this once, before any work)."""
    global COMMAND
    COMMAND = ["featcache", *argv[1:]]


@functools.lru_cache(maxsize=1)
def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo on Linux; platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """featcache's git commit when it runs from a checkout (the package's parent folder holds `.git`), with
    "-dirty" when featcache/ has uncommitted changes; None for an installed package or without git."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        run = lambda *args: subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        sha = run("rev-parse", "HEAD")
        dirty = bool(run("status", "--porcelain", "--untracked-files=no", "--", "featcache"))
        return f"{sha}-dirty" if dirty else sha or None
    except Exception:
        return None


def gpu_name(device) -> str | None:
    """The CUDA device's name when `device` is a CUDA device, else None."""
    try:
        import torch  # lazy: the CLI imports this module at start-up

        device = torch.device(device)
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
    except Exception:
        pass
    return None


def library_call(func: str, **kwargs) -> str:
    """`featcache.train(cache='c.h5', algo='fedavg', ...)`: how a library user made the result."""
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"{func}({args})"


def provenance(device="cpu", call: str | None = None) -> dict:
    """The provenance block of a result file. `call` describes the library call; the CLI's command line, when this
    process is the `featcache` command, is recorded instead."""
    import torch  # lazy: the CLI imports this module at start-up

    return {
        "featcache": __version__,
        "commit": git_commit(),
        "command": shlex.join(COMMAND) if COMMAND is not None else None,
        "call": None if COMMAND is not None else call,
        "cpu": cpu_model(),
        "machine": platform.machine() or None,
        "cpu_count": os.cpu_count(),
        "gpu": gpu_name(device),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": sys.platform,
    }
