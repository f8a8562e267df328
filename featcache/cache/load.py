"""Reading a client cache: `load_clients`, one split of every client as padded tensors. The first load of a file version
in a process checks it as `verify` does, the feature arrays on the very read that fills the tensors, so every feature
byte is read once."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from typing import TYPE_CHECKING

import h5py
import numpy as np

from ..errors import UserError, as_list, as_path, first_line
from .check import _check_structure, _feature_problems, _is_features, _stale
from .h5 import Node, dataset_id, read_attrs, read_into, rows_per_slice
from .open import open_cache, read_meta
from .write import SPLITS

if TYPE_CHECKING:  # torch loads with the first load: `info`, `verify` and `migrate` never need it
    import torch

# (path, size, mtime, inode) of each cache file version whose structure passed the checks in this process -> what
# the check found (`_Seen`)
_VERIFIED: dict[tuple, "_Seen"] = {}
# the index arrays a load reads, kept from the check's read of them for the later loads of the same file version
_KEPT = ("labels", "offsets", "val_index", "val_offsets")


@dataclass
class _Seen:
    """What the structure check of one file version found that a later load uses: the index arrays it reads
    (`_KEPT`), each feature array's dtype, shape and attributes (no open id), and the feature arrays checked since
    (each on the read that loaded it)."""

    datasets: dict[str, Node]
    checked: set[str] = field(default_factory=set)


@dataclass
class ClientData:
    """All clients of one split as padded tensors, with a leading client axis C, and the cache's metadata."""

    features: torch.Tensor  # [C, Nmax, D] float32 (zeros past counts)
    labels: torch.Tensor  # [C, Nmax] int64 (-1 past counts)
    counts: torch.Tensor  # [C] int64
    num_classes: int
    views: torch.Tensor | None = None  # [C, Nmax, V, D] float32 augmented views, when cached and asked for
    meta: dict = field(default_factory=dict)  # root attributes and backbone_info (`read_meta`); {} when not loaded

    def to(self, device) -> "ClientData":
        move = lambda t: None if t is None else t.to(device)
        return ClientData(
            move(self.features), move(self.labels), move(self.counts), self.num_classes, move(self.views), self.meta
        )

    @property
    def mask(self) -> torch.Tensor:  # [C, Nmax] bool
        import torch

        return torch.arange(self.features.shape[1], device=self.counts.device) < self.counts[:, None]


def load_clients(
    path: str | Path,
    split: str = "train",
    backbones: Sequence[str] | None = None,
    views: bool = False,
    holdout: str = "none",
) -> ClientData:
    """Read one split of every client as padded tensors, with the cache's metadata in `.meta`.

    `backbones` picks a subset of cached backbones, in the order given (default: all, i.e. the stored `concat`).
    `holdout` uses the validation positions of the train split: 'none' = all of train, 'fit' = train without the
    validation rows, 'val' = only the validation rows (split must be 'train' for the last two). The first load of a
    file in a process checks it as `verify` does (the feature arrays on the read that fills the tensors), and refuses
    a damaged cache in one line.
    """
    import torch

    path = as_path(path, "cache")
    backbones = as_list(backbones, "backbones")  # a lone name is one backbone
    if split not in SPLITS:
        raise UserError(f"split must be one of {', '.join(SPLITS)} (got {split!r})")
    with open_cache(path) as f:
        checked, found, walked = _checked(path, f)
        meta = read_meta(f)
        ranges = columns(meta, path, backbones, views)
        at = _datasets(f, found, walked)
        starts = at(f"{split}/offsets").read()  # [C + 1]
        y = at(f"{split}/labels").read()  # [N]
        rows = _rows(starts, at, holdout, split)  # C x [n_c] positions in each client's rows
        counts = [len(r) for r in rows]
        labels = np.full((len(rows), max(counts, default=0)), -1, np.int64)  # [C, Nmax]
        for c, r in enumerate(rows):
            labels[c, : len(r)] = y[starts[c] + r]
        read = lambda group: _read_padded(path, f"{split}/{group}/concat", at, starts, rows, ranges, checked)
        return ClientData(
            features=read("features"),
            labels=torch.from_numpy(labels),
            counts=torch.tensor(counts, dtype=torch.int64),
            num_classes=len(meta["classes"]),
            views=read("views") if views else None,
            meta=meta,
        )


def _refused(path: Path, problems: list[str]) -> UserError:
    more = f" (+{len(problems) - 1} more: run `featcache verify {path}`)" if len(problems) > 1 else ""
    return UserError(f"cache {path} failed verification: {problems[0]}{more}; delete it and re-run `featcache extract`")


def _checked(path: Path, f: h5py.File) -> tuple[set[str], dict[str, Node], bool]:
    """(the feature arrays of this version of the file (path, size, mtime, inode) already checked in this process,
    its datasets by path (`_Seen`), whether they are the open ones the structure check just walked). A version not
    seen before has its structure checked first (everything `verify` checks but the feature bytes): one UserError
    line when it fails, one warning when it was extracted with other library versions."""
    st = path.stat()
    ident = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if ident in _VERIFIED:
        return _VERIFIED[ident].checked, _VERIFIED[ident].datasets, False
    problems: list[str] = []
    try:
        found = _check_structure(f, problems)
        stale = _stale(read_attrs(f)["versions"])
    except Exception as e:  # a damaged file fails in many ways inside HDF5 and JSON; each one means "damaged"
        problems.append(f"unreadable ({type(e).__name__}: {first_line(e)})")
    if problems:
        raise _refused(path, problems)
    if stale:
        warnings.warn(
            f"cache {path} was extracted with {', '.join(stale)}: a fresh `featcache extract` may give other features",
            UserWarning,
            stacklevel=3,
        )
    kept = {name: replace(n, id=None) for name, n in found.items() if name.endswith(_KEPT) or _is_features(name)}
    _VERIFIED[ident] = _Seen(kept)
    return _VERIFIED[ident].checked, found, True


def columns(
    meta: dict, path: Path, wanted: Sequence[str] | None = None, views: bool = False
) -> list[tuple[int, int]] | None:
    """The [start, stop) column ranges of the `wanted` backbones, in that order (None: all, in stored order), from
    the cache's metadata `meta`: what a load of it would refuse, a backbone it does not hold or augmented views where
    it has none, is refused before any array is read (train checks every cache of a sweep so)."""
    order = meta["backbones"]
    unknown = [b for b in wanted or () if b not in order]
    if unknown:
        raise UserError(f"cache {path} has no backbone {unknown[0]!r}; it holds {', '.join(order)}")
    if views and not int(meta["views"]):  # the structure check holds every client to the stored views
        raise UserError(f"cache {path} has no augmented views: re-extract with --views 2")
    if not wanted or list(wanted) == order:
        return None
    return [tuple(meta["backbone_info"][b]["columns"]) for b in wanted]


def _datasets(f: h5py.File, found: dict[str, Node], walked: bool):
    """Dataset path -> its `Node`: the structure check's (`walked`: open, its arrays read), or, on a later load of the
    same file version, the index arrays the check read and the features opened to be read (with the attributes the
    check found)."""
    if walked:
        return lambda name: found[name]

    def at(name: str) -> Node:
        seen = found[name]
        return seen if seen.data is not None else replace(seen, id=dataset_id(f, name))

    return at


def _read_padded(
    path: Path,
    name: str,
    at,
    starts: np.ndarray,
    rows: list[np.ndarray],
    ranges: list[tuple[int, int]] | None,
    checked: set[str],
) -> torch.Tensor:
    """[C, Nmax, ..., D'] float32, zeros past each client's rows: client c's `rows[c]` of the dataset `name` (`at`
    gives its `Node`; the client's rows start at row `starts[c]`), the columns of `ranges` side by side (all when
    None). The dataset is read once, in slices of rows whatever the clients (a client's rows are a span of them);
    unless `checked` already holds it, the same read checks it: its sha256 against the stored one, and that every
    value is finite."""
    import torch

    node = at(name)
    shape = node.shape
    width = shape[-1] if ranges is None else sum(b - a for a, b in ranges)
    n = max((len(r) for r in rows), default=0)
    out = np.zeros((len(rows), n, *shape[1:-1], width), np.float32)  # [C, Nmax, ..., D']
    flat = out.reshape(len(rows) * n, *out.shape[2:])  # [C * Nmax, ..., D'] the same memory
    # the rows asked for, in the dataset's order: where they are (pos) and where they go in `flat` (dest)
    pos = np.concatenate([starts[c] + r for c, r in enumerate(rows)] or [np.empty(0, np.int64)])  # [m]
    dest = np.concatenate([c * n + np.arange(len(r)) for c, r in enumerate(rows)] or [np.empty(0, np.int64)])  # [m]
    check = name not in checked
    digest, finite = hashlib.sha256(), True
    step = rows_per_slice(node.id)
    for r in range(0, shape[0], step):
        stop = min(r + step, shape[0])
        lo, hi = np.searchsorted(pos, (r, stop))  # pos[lo:hi] fall in this slice
        if not check and lo == hi:
            continue  # already checked, and none of its rows is asked for
        block = np.empty((stop - r, *shape[1:]), np.float32)  # [k, ..., D]
        read_into(node.id, r, block)
        if check:
            digest.update(block)
            finite = finite and bool(np.isfinite(block).all())
        picked = block if hi - lo == stop - r else block[pos[lo:hi] - r]  # [m', ..., D]
        flat[dest[lo:hi]] = picked if ranges is None else np.concatenate([picked[..., a:b] for a, b in ranges], -1)
    if check:
        problems = _feature_problems(name, node.attrs.get("sha256"), digest.hexdigest(), finite)
        if problems:
            raise _refused(path, problems)
        checked.add(name)
    return torch.from_numpy(out)


def _rows(starts: np.ndarray, at, holdout: str, split: str) -> list[np.ndarray]:
    """The positions of each client's rows of the split to load (`starts` [C + 1] its offsets, `at` the datasets'
    `Node`s)."""
    counts = np.diff(starts)  # [C]
    if holdout == "none":
        return [np.arange(n) for n in counts]
    if split != "train":
        raise UserError(f"holdout={holdout!r} needs split 'train', got {split!r}")
    if holdout not in ("fit", "val"):
        raise UserError(f"holdout must be one of none, fit, val (got {holdout!r})")
    val, bounds = at("train/val_index").read(), at("train/val_offsets").read()  # [v], [C + 1]
    vals = [val[bounds[c] : bounds[c + 1]] for c in range(len(counts))]
    if holdout == "val":
        return [np.sort(v) for v in vals]
    return [np.setdiff1d(np.arange(n), v) for n, v in zip(counts, vals)]


def client_rows(f: h5py.File, split: str, c: int, name: str = "features/concat") -> np.ndarray:
    """Client c's rows of the dataset `name` of `split` ('labels', 'features/concat', 'val_index' ...) in an open
    cache, read with plain h5py where the split's offsets say."""
    at = f[f"{split}/{'val_offsets' if name == 'val_index' else 'offsets'}"][c : c + 2]
    return f[f"{split}/{name}"][at[0] : at[1]]
