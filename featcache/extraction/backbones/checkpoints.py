"""PyTorch checkpoints (.pth, .pt, .tar, .safetensors, ...) as timm feature models: read without running pickled
code, classifier heads dropped, known foreign stems rebuilt, every key checked unless a partial load is asked for."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from featcache.errors import UserError, first_line

from .models import seeded_model

# Classifier modules dropped from checkpoints when the feature model has no such keys (`cls_fn`: SUR's ResNets).
_CLASSIFIER_MODULES = {"fc", "classifier", "head", "cls_fn"}

# First-conv shapes that differ from timm's, and how to rebuild the conv for them. SUR / URT ResNet18s (and FedPCL,
# which loads them) use a 5x5 stride-2 stem with padding 1 (dvornikita/SUR models/resnet18.py, FedPCL
# lib/models/resnet.py); FedPCL keeps the max-pool after it, as timm's resnet18 does.
_STEMS = {(64, 3, 5, 5): {"stride": 2, "padding": 1}}

# SUR checkpoints store numpy scalars (best_val_acc) beside the state dict. Rebuilding a numeric numpy scalar or
# dtype runs no code, so they are admitted (the scalar constructor under both module paths numpy has used).
_NP_SCALAR = np.float64(0).__reduce__()[0]  # numpy's scalar constructor, wherever this numpy keeps it
_NUMPY_SAFE = [
    np.dtype,
    *{type(np.dtype(code)) for code in "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"]},
    (_NP_SCALAR, "numpy.core.multiarray.scalar"),
    (_NP_SCALAR, "numpy._core.multiarray.scalar"),
]


def state_dict_model(name: str, path: Path, image_size: int | None, allow_partial: bool) -> torch.nn.Module:
    """timm feature model with the checkpoint's weights; keys must match unless `allow_partial`."""
    state = read_state_dict(path)
    model = seeded_model(name, image_size)
    expected = model.state_dict()
    classifiers = _CLASSIFIER_MODULES | {c.split(".")[0] for c in _as_tuple(model.pretrained_cfg.get("classifier"))}
    state = {k: v for k, v in state.items() if k in expected or k.split(".")[0] not in classifiers}
    if _rebuild_stem(model, state):
        expected = model.state_dict()

    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]  # unused in eval
    unexpected = [k for k in state if k not in expected]
    wrong_shape = [k for k in state if k in expected and state[k].shape != expected[k].shape]
    problems = "; ".join(
        f"{label}: {listing(keys)}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape))
        if keys
    )
    if problems and not allow_partial:
        raise UserError(
            f"checkpoint {path} does not fit {name} ({problems}): check that {name} is the checkpoint's "
            "architecture, or pass --allow-partial to load what fits (the rest stays seeded random)"
        )
    if problems:  # stacklevel: past the source's build, resolve_weights and create_backbone to their caller
        warnings.warn(f"partial load of {path} into {name}, rest left random: {problems}", UserWarning, stacklevel=5)
    model.load_state_dict({k: v for k, v in state.items() if k in expected and k not in wrong_shape}, strict=False)
    return model


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file (state dict possibly under 'state_dict', 'module.' prefixes stripped), read
    without running any pickled code."""
    require_file(path)
    try:
        if path.suffix == ".safetensors":
            loaded = load_file(path)
        else:
            with torch.serialization.safe_globals(_NUMPY_SAFE):
                loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if unsafe := _unsafe_globals(path) or re.findall(r"GLOBAL (\S+) was not an allowed global", str(err)):
            raise UserError(
                f"checkpoint {path} pickles objects other than tensors ({', '.join(unsafe)}) and was not loaded, "
                "as that could run code: re-save its state_dict alone with torch.save"
            ) from err
        reason = str(err).partition("WeightsUnpickler error:")[2] or str(err)
        raise UserError(f"cannot read checkpoint {path}: {first_line(reason)}") from err
    except Exception as err:  # a damaged file trips the (weights-only) unpickler in many ways: IndexError, KeyError...
        raise UserError(f"cannot read checkpoint {path}: {first_line(err)}") from err
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(
            f"checkpoint {path} holds no state dict: expected tensors by name, optionally under 'state_dict'"
        )
    return {k.removeprefix("module."): v for k, v in state.items()}


def require_file(path: Path) -> None:
    """Refuse a checkpoint path that names no file."""
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist: pass NAME=PATH with the path of a weight file")


def _unsafe_globals(path: Path) -> list[str]:
    """Names of the code objects a zip-format checkpoint pickles; [] when there are none or it cannot be inspected."""
    try:
        with torch.serialization.safe_globals(_NUMPY_SAFE):
            return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, ValueError, OSError, pickle.UnpicklingError):  # legacy (non-zip) or damaged files
        return []


def _rebuild_stem(model: torch.nn.Module, state: dict) -> bool:
    """Swap the first conv for one of the checkpoint's shape when that shape is a known stem; True if swapped."""
    first = model.pretrained_cfg.get("first_conv")
    weight = state.get(f"{first}.weight")
    if weight is None or tuple(weight.shape) not in _STEMS:
        return False
    old = model.get_submodule(first)
    if old.weight.shape == weight.shape:
        return False
    out_channels, in_channels, *kernel = weight.shape
    conv = torch.nn.Conv2d(
        in_channels, out_channels, tuple(kernel), bias=old.bias is not None, **_STEMS[tuple(weight.shape)]
    )
    parent, _, attr = first.rpartition(".")
    setattr(model.get_submodule(parent), attr, conv)
    return True


def listing(keys: list[str], shown: int = 6) -> str:
    """The first `shown` keys, comma-separated, and how many more there are."""
    more = f" (+{len(keys) - shown} more)" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def _as_tuple(value) -> tuple:
    return (value,) if isinstance(value, str) else tuple(value or ())
