"""What every dataset reader returns: labelled image sets per domain and split, with a content fingerprint.

A reader never decodes all images up front: an `ImageSet` hands out one RGB `PIL.Image` at a time (or, when it holds
equal-size arrays, a batch of them as one uint8 array), so extraction streams with flat memory. The fingerprint covers
what determines the pixels and their labels, never where the data lies: array bytes, or each file's name relative
to the dataset folder with its size and sha256 (`contents.Contents` remembers those by stat). A changed byte gives a
new key; the same files moved, copied, linked or named another way give the same one.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ...errors import UserError, first_line
from ..contents import Contents, require_regular


class ImageSet:
    """A labelled, indexable set of images. Subclasses implement `image(i)` and `fingerprint()`."""

    labels: np.ndarray  # [N] int64

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, i: int) -> Image.Image:  # RGB
        raise NotImplementedError

    def batch(self, rows: np.ndarray) -> np.ndarray | None:
        """Images `rows` as one uint8 array [B, H, W, 3] when the set holds equal-size arrays, else None (then
        `image(i)` decodes them one by one)."""
        return None

    def fingerprint(self, root: str | Path | None = None, contents: Contents | None = None) -> str:
        """sha256 of the set's content: labels in order and the images' bytes (files: their names relative to the
        dataset folder `root`, sizes and sha256s, found through `contents`)."""
        raise NotImplementedError

    def side(self) -> int:
        """The largest side, in pixels, of the first image (0 for an empty set)."""
        return max(self.image(0).size) if len(self) else 0


class ArrayImages(ImageSet):
    """Images held in a uint8 array [N, H, W] (grey) or [N, H, W, 3] (RGB)."""

    def __init__(self, images: np.ndarray, labels) -> None:
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            raise ValueError(f"expected uint8 images [N,H,W] or [N,H,W,3], got {images.dtype} {images.shape}")
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        if len(self.images) != len(self.labels):
            raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels")

    def image(self, i: int) -> Image.Image:
        return Image.fromarray(self.images[i]).convert("RGB")

    def side(self) -> int:
        return max(self.images.shape[1:3]) if len(self) else 0

    def batch(self, rows: np.ndarray) -> np.ndarray:
        x = self.images[rows]  # [B, H, W] grey or [B, H, W, 3]
        return np.repeat(x[..., None], 3, axis=-1) if x.ndim == 3 else x

    def fingerprint(self, root: str | Path | None = None, contents: Contents | None = None) -> str:
        h = hashlib.sha256()
        h.update(str(self.images.shape).encode())
        h.update(np.ascontiguousarray(self.images).tobytes())
        h.update(self.labels.tobytes())
        return h.hexdigest()


class PathImages(ImageSet):
    """Images read from files on disk (any format PIL opens); grey, palette, RGBA and 16-bit become RGB."""

    def __init__(self, paths, labels) -> None:
        self.paths = [Path(p) for p in paths]
        self.labels = np.asarray(labels, dtype=np.int64)
        if len(self.paths) != len(self.labels):
            raise ValueError(f"{len(self.paths)} paths but {len(self.labels)} labels")

    def image(self, i: int) -> Image.Image:
        try:
            with open_regular(self.paths[i]) as fh, Image.open(fh) as im:
                if im.mode in ("I;16", "I;16B", "I;16L", "I"):
                    arr = np.asarray(im, dtype=np.float64)  # [H, W]
                    arr = (255.0 * arr / max(arr.max(), 1.0)).astype(np.uint8)
                    return Image.fromarray(arr).convert("RGB")
                return im.convert("RGB")
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # PIL's ways to say "damaged"
            raise self._unreadable(i, e) from None

    def side(self) -> int:
        """The largest side of the first image, read from its header: the one decode of each image is the
        embedding pass's."""
        if not len(self):
            return 0
        try:
            with open_regular(self.paths[0]) as fh, Image.open(fh) as im:
                return max(im.size)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise self._unreadable(0, e) from None

    def _unreadable(self, i: int, e: BaseException) -> UserError:
        if isinstance(e, OSError) and e.strerror and e.filename:
            reason = e.strerror  # the path is in the line already
        else:  # PIL names the file it could not identify, as a path or as a file object: the line names it once
            reason = re.sub(r"\s+(<[^<>]*>|'[^']*')$", "", first_line(e))
        return UserError(f"cannot read image {self.paths[i]} ({reason}): repair or delete the file")

    def fingerprint(self, root: str | Path | None = None, contents: Contents | None = None) -> str:
        root = _common_folder(self.paths) if root is None else root
        names = relative_names(root, self.paths)
        h = hashlib.sha256()
        for name, (size, digest), y in zip(
            names, (contents or Contents()).hashes(root, self.paths, names), self.labels
        ):
            h.update(f"{name}|{size}|{digest}|{int(y)}\n".encode())
        return h.hexdigest()


def relative_names(root: str | Path, paths: list[Path]) -> list[str]:
    """Each path relative to the folder `root` ('/'-separated, '..' where it lies outside), as os.path.relpath
    gives it; a path that starts with `root`'s spelling is cut without touching the file system."""
    prefix = os.path.join(str(root), "")
    out = []
    for p in paths:
        text = str(p)
        rest = text[len(prefix) :] if text.startswith(prefix) else None
        if rest is None or ".." in rest.split(os.sep):
            rest = os.path.relpath(text, root)
        out.append(rest.replace(os.sep, "/"))
    return out


def _common_folder(paths: list[Path]) -> str:
    """The deepest folder holding every file of `paths` (the dataset folder of a set built without one)."""
    return os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths]) if paths else "."


def open_regular(path: Path):
    """`path` opened for binary reading when it is a regular file (after symlinks), else a UserError: opened without
    blocking and then checked, so a named pipe cannot hang the read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        require_regular(path, os.fstat(fd))
    except UserError:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


@dataclass
class Dataset:
    """Domains -> splits ('train', 'test') -> ImageSet, plus class names shared by all domains."""

    name: str
    classes: list[str]
    domains: dict[str, dict[str, ImageSet]]
    source: str = ""  # where the data came from, for provenance
    extra: dict = field(default_factory=dict)
    root: Path | None = None  # the folder the files' names in the fingerprint are relative to (None: their common one)

    def side(self) -> int | None:
        """The largest side, in pixels, of the first image of each domain and split (None when all are empty)."""
        return max((s.side() for splits in self.domains.values() for s in splits.values()), default=0) or None

    def fingerprint(self, contents: Contents | None = None) -> str:
        """sha256 of the name, the class names and every domain's and split's content (`ImageSet.fingerprint`); the
        files' hashes come from `contents` (default: read them all)."""
        contents = contents or Contents()
        paths = [
            p for splits in self.domains.values() for s in splits.values() if isinstance(s, PathImages) for p in s.paths
        ]
        root = self.root if self.root is not None else _common_folder(paths)
        h = hashlib.sha256(f"{self.name}|{self.classes}".encode())
        for d in sorted(self.domains):
            for s in sorted(self.domains[d]):
                h.update(f"{d}/{s}:{self.domains[d][s].fingerprint(root, contents)}\n".encode())
        return h.hexdigest()
