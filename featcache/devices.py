"""One device check for every command: `--device auto | cpu | cuda[:N]` becomes a torch.device, or a one-line
UserError before any data or model is loaded.

`device_name` answers the same question as a string without importing torch where the answer cannot be CUDA
(`cpu`, or `auto` on a Linux machine with no GPU device file): a cache hit or a re-partition, which runs no model,
then never loads torch. Wherever a GPU could be there, torch decides, so both give the same device."""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    import torch

DEVICES = "auto | cpu | cuda[:N]"  # what --device accepts, for help texts and messages
# Device files one of which exists wherever Linux runs a CUDA (or ROCm) device: NVIDIA's driver, ROCm's, WSL's.
GPU_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def resolve_device(name: str | torch.device) -> torch.device:
    """'auto' -> cuda when CUDA is available, else cpu; 'cpu'; 'cuda' / 'cuda:N' only where that GPU exists."""
    import torch  # lazy: `device_name` answers without it where it can

    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise UserError(f"--device must be one of {DEVICES}, not {type(name).__name__} {name!r}")
    text = name.strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    found = re.fullmatch(r"cuda(?::(\d+))?", text)
    if not found:
        raise UserError(f"--device {name!r} is not a device: use {DEVICES}")
    if not torch.cuda.is_available():
        raise UserError(f"--device {name} asked for but CUDA is not available: use --device cpu or auto")
    index, count = found.group(1), torch.cuda.device_count()
    if index is not None and int(index) >= count:
        raise UserError(
            f"--device {name} asked for but this machine has {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}: pick one of those, or --device cuda"
        )
    return torch.device(text)


def device_name(name: str) -> str:
    """`str(resolve_device(name))`, found without importing torch for 'cpu', and for 'auto' where no GPU can be
    (torch not loaded yet, Linux, none of `GPU_FILES`)."""
    text = name.strip().lower() if isinstance(name, str) else None
    if text == "cpu" or (text == "auto" and "torch" not in sys.modules and not _gpu_possible()):
        return "cpu"
    return str(resolve_device(name))


def device_kind(device) -> str:
    """'cuda' for 'cuda:1' or torch.device('cuda', 1): the device's type, from its name or itself."""
    return str(device).partition(":")[0]


def _gpu_possible() -> bool:
    return not sys.platform.startswith("linux") or any(os.path.exists(f) for f in GPU_FILES)
