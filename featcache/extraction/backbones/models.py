"""timm and torch, imported on first use, and the seeded feature models every weight source starts from."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Lazy:
    """A module imported on first attribute access: torch and timm take seconds to import, and a cache hit or a
    re-partition never builds a model nor makes a tensor, so the key's `weights_identity` must not pay for them."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


timm = Lazy("timm")


def seeded_model(name: str, image_size: int | None, **kwargs) -> torch.nn.Module:
    """timm feature model (num_classes=0); fixed-size models (ViTs) are built for `image_size`. Initialised from a
    fixed seed, so random backbones, and what a partial checkpoint leaves out, are the same on every run."""
    cfg = timm.models.get_pretrained_cfg(name)
    if image_size and cfg is not None and cfg.fixed_input_size:
        kwargs["img_size"] = image_size
    import torch  # lazy: see Lazy

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return timm.create_model(name, num_classes=0, **kwargs)
