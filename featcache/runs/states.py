"""A run's final trained state as a safetensors file, `<result stem>.state.safetensors` (`featcache train
--save-state`), for analyses of the trained heads without retraining (e.g. `featcache plot`).

Tensor names (S = seeds, C = clients; the `State`'s groups flattened with "/" by trees.py, each tensor a contiguous
copy: `trees.unflatten(tensors, "params")` gives a group back):

    params/<name>    [S, C, ...]  every client's head parameters
    buffers/<name>   [S, C, ...]  every client's buffers (BN statistics, personal models, MoCo queues, ...)
    client/<name>    [S, C, ...]  per-client algorithm state (local prototypes, control variates, ...)
    server/<name>    [S, ...]     per-seed server state (global prototypes, the global model, ...)

Metadata: one key, `featcache`, a JSON object (sorted keys) with `algo`, `algo_spec` (the algorithm's name, or for a
plug-in its `file.py:Class`, so the state can be used without registering it first), `config`, `seeds`, `cache_key`,
`backbones`, `result` (the result file's name) and `featcache_state` (the format version). One key, because safetensors
writes several metadata keys in a random order, and the same run must give the same bytes. (Files with those fields as
separate metadata keys, JSON-encoded where they are not strings, are read too.)
"""

from __future__ import annotations

import json
import sys
from typing import cast
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..atomic import write_atomic
from ..errors import UserError
from .trees import Unsupported, flatten

FORMAT = "1"
META_JSON = ("config", "seeds", "backbones")  # metadata values stored as JSON text
META_KEYS = ("algo", "config", "seeds", "cache_key", "backbones", "result")  # what a reader may rely on
SUFFIX = ".state.safetensors"


def state_bytes(trained, result: dict, result_name: str) -> bytes:
    """The safetensors bytes of `trained` (a `train.Trained`: its state has H = seeds) with the metadata of
    `result` (the result dict `train` writes, in the file named `result_name`)."""
    try:
        tensors = flatten(trained.state.groups())
    except Unsupported as e:
        raise UserError(
            f"--save-state: state entry {e.name} is a {e.kind}; a saved state holds tensors and numbers only"
        ) from None
    cls = type(trained.algo)
    builtin = cls.__module__.startswith("featcache.algorithms.")
    file = cast(str, sys.modules[cls.__module__].__file__)  # a plug-in's: loaded from its file
    spec = result["algo"] if builtin else f"{Path(file).resolve()}:{cls.__name__}"
    meta = {
        "algo": result["algo"],
        "algo_spec": spec,
        "config": result["config"],
        "seeds": result["seeds"],
        "cache_key": result["cache"]["key"],
        "backbones": result["backbones"],
        "result": result_name,
        "featcache_state": FORMAT,
    }
    return save(tensors, metadata={"featcache": json.dumps(meta, sort_keys=True)})


def save_state(path: str | Path, trained, result: dict) -> Path:
    """Write `trained` with the metadata of `result` to `path` atomically (`state_bytes`); the result file is
    `result["result_file"]`, by default the JSON named like `path`. Returns the path."""
    name = Path(result.get("result_file", Path(path).name.removesuffix(SUFFIX) + ".json")).name
    write_atomic(path, state_bytes(trained, result, name))
    return Path(path)


def load_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors name -> Tensor, metadata) of a saved state; config, seeds and backbones are decoded from JSON. A
    file that is missing, not safetensors or not a featcache state is one UserError line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such state file (write one with `featcache train --save-state`)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a damaged or foreign file
        raise UserError(
            f"{path} is not a safetensors file ({type(e).__name__}): pass a .state.safetensors file "
            "written by `featcache train --save-state`"
        ) from None
    try:
        meta = (
            json.loads(meta["featcache"])
            if "featcache" in meta
            else meta | {k: json.loads(meta[k]) for k in META_JSON if k in meta}
        )
    except (json.JSONDecodeError, TypeError):
        meta = {}  # unreadable: every key missing
    missing = list(META_KEYS) if not isinstance(meta, dict) else [k for k in META_KEYS if k not in meta]
    if missing:
        raise UserError(
            f"{path} is not a featcache state (metadata lacks {', '.join(missing)}): pass a file "
            "written by `featcache train --save-state`"
        )
    return tensors, meta
