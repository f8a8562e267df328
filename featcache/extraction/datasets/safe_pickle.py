"""Read pickles from strangers (FedBN's dataset files, CIFAR batches) without running code they name.

`pickle.load` calls whatever callable a file names, so a crafted `.pkl` can run `os.system`. `safe_load` admits only
what numpy needs to rebuild arrays, dtypes and scalars (under both the numpy 1 `numpy.core` and numpy 2 `numpy._core`
spellings), plus the two byte-string constructors that protocols <= 2 use for plain `bytes`. Tuples, lists, dicts,
strings and numbers are built by pickle opcodes and need no callable at all. Anything else is refused before it is
called. Python 2 pickles (CIFAR) are read with latin-1, as numpy recommends, so their str keys and data come back as
`str` and array bytes.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import UserError, first_line

try:  # numpy >= 2 (and the forward-compatibility shim in 1.26)
    from numpy._core import multiarray, numeric
except ImportError:  # numpy < 1.26 has only numpy.core
    from numpy.core import multiarray, numeric


def _latin1_encode(text: str, encoding: str = "latin1", errors: str = "strict") -> bytes:
    """Stand-in for `_codecs.encode`, which protocols <= 2 use to store bytes; only latin-1 is plain data."""
    if encoding.replace("-", "").lower() != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode with codec {encoding!r} is not plain data")
    return text.encode("latin1", errors)


# what each array pickle needs, under numpy 1's `numpy.core` and numpy 2's `numpy._core` module names
_NUMPY_CORE: dict[tuple[str, str], Any] = {
    ("multiarray", "_reconstruct"): multiarray._reconstruct,  # arrays, protocols <= 4
    ("multiarray", "scalar"): multiarray.scalar,  # numpy scalars such as np.int64(3)
    ("numeric", "_frombuffer"): numeric._frombuffer,  # arrays, protocol 5
}
_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
    ("builtins", "bytes"): bytes,
    ("__builtin__", "bytes"): bytes,  # protocol 2 written by Python 3 names the Python 2 module
    **{
        (f"{core}.{module}", name): fn
        for core in ("numpy.core", "numpy._core")
        for (module, name), fn in _NUMPY_CORE.items()
    },
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file, encoding="latin1")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise UserError(
                f"refusing to unpickle {module}.{name} from {self.path}: only numpy arrays and plain containers are "
                "allowed in dataset files (this one may be malicious or not a dataset pickle)"
            )
        return _ALLOWED[(module, name)]


MAX_DEPTH = 32  # containers nested deeper are no dataset's (FedBN's and CIFAR's files nest 2 or 3 deep)


def _depth_over(obj: Any, limit: int) -> bool:
    """Whether lists, tuples and dicts nest deeper than `limit` in `obj` (walked without recursion: 10^5 nested
    lists load without it, then overflow the stack of anything that recurses into them, str() included)."""
    stack = [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if depth >= limit:
                return True
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return False


def safe_load(path: str | Path) -> Any:
    """Unpickle `path`, admitting only numpy arrays/dtypes/scalars and plain containers nested at most `MAX_DEPTH`
    deep; else `UserError`."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(f, path).load()
        if _depth_over(obj, MAX_DEPTH):
            raise UserError(
                f"{path} nests lists, tuples or dicts more than {MAX_DEPTH} deep: not a dataset pickle; replace it "
                "with the data set's own file"
            )
        return obj
    except UserError:
        raise
    except FileNotFoundError:
        raise UserError(f"{path} not found") from None
    except Exception as e:  # a truncated or foreign file fails in many ways; all mean "not a readable pickle"
        raise UserError(f"cannot unpickle {path}: {type(e).__name__}: {first_line(e)}") from None
