"""JAX ViT checkpoints (`.npz` in Google's AugReg layout, FedPCL's ViT rows) as timm ViTs, read by timm's own
loader after the file is checked to be plain arrays of the model's patch size and depth, and with every tensor proved
to come from the file."""

from __future__ import annotations

import re
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch

from featcache.errors import UserError, first_line

from .checkpoints import listing, require_file
from .models import seeded_model


def npz_model(name: str, path: Path, image_size: int | None, allow_partial: bool) -> torch.nn.Module:
    """timm ViT holding a JAX `.npz` checkpoint (Google's AugReg layout: `embedding/kernel`, `cls`,
    `Transformer/encoderblock_N/...`), loaded by the model's own `load_pretrained`, which also resamples the position
    embeddings to the grid of `image_size`. Every tensor must come from the file unless `allow_partial`."""
    require_file(path)
    model = seeded_model(name, image_size)
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
        raise UserError(
            f"checkpoint {path} does not fit {name} ({first_line(err)}): name the ViT the checkpoint belongs to"
        ) from err
    _check_npz_complete(name, model, path, seeded, allow_partial)
    return model


def _read_npz(path: Path) -> dict[str, tuple[int, ...]]:
    """Shapes of the arrays in an `.npz`, after reading every one without unpickling (a damaged or pickling file is
    a UserError here, before timm reads it again)."""
    if not zipfile.is_zipfile(path):
        raise UserError(
            f"cannot read checkpoint {path}: it is not an .npz (zip) archive, or it is cut short; download it again"
        )
    try:
        with np.load(path, allow_pickle=False) as archive:
            shapes = {key: archive[key].shape for key in archive.files}
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise UserError(
                f"checkpoint {path} pickles objects other than arrays and was not loaded, as that could run code: "
                "re-save it with numpy.savez from plain arrays"
            ) from err
        raise UserError(f"cannot read checkpoint {path}: {first_line(err)}") from err
    except Exception as err:  # a damaged member: zipfile.BadZipFile (CRC), EOFError, zlib.error, OSError
        raise UserError(f"cannot read checkpoint {path}: {first_line(err)}") from err
    if not any(key.endswith("embedding/kernel") for key in shapes):
        raise UserError(
            f"checkpoint {path} lacks embedding/kernel: it is not a JAX ViT checkpoint in the AugReg "
            "layout (embedding/kernel, cls, Transformer/encoderblock_N/...)"
        )
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
            f"checkpoint {path} sets no value for {listing(unset)} of {name}: check that {name} is the "
            "checkpoint's architecture, or pass --allow-partial to load what fits (the rest stays seeded random)"
        )
    if unset:  # stacklevel: past npz_model, the source's build, resolve_weights and create_backbone to their caller
        warnings.warn(
            f"partial load of {path} into {name}, rest left random: {listing(unset)}", UserWarning, stacklevel=6
        )
        with torch.no_grad():
            for key in unset:
                state[key].copy_(seeded[key])
