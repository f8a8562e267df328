"""One device check for every command: `--device auto | cpu | cuda[:N]` becomes a torch.device, or a one-line
UserError before any data or model is loaded."""

from __future__ import annotations

import re

import torch

from .errors import UserError

DEVICES = "auto | cpu | cuda[:N]"  # what --device accepts, for help texts and messages


def resolve_device(name: str | torch.device) -> torch.device:
    """'auto' -> cuda when CUDA is available, else cpu; 'cpu'; 'cuda' / 'cuda:N' only where that GPU exists."""
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
