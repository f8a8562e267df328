"""Algorithms from outside featcache: a plug-in spec `path/to/my_algo.py:MyAlgo` or `package.module:MyAlgo`, and the
`featcache.algorithms` entry-point group of installed packages (`name = "module:Class"`).

`load(spec)` imports the class (a FedAvg subclass), registers it under its own `name` (registry.register checks it)
and returns that name. An exception raised inside a plug-in's code is named by `plugin_failure` (file, line, hook)
for the CLI's one line; a plug-in hook's `sys.exit()` becomes a UserError (`plugin_exits`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import warnings
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path

from ..errors import UserError, first_line
from .base import FedAvg
from .registry import _ALGOS, register

ENTRY_POINT_GROUP = "featcache.algorithms"  # installed packages: [project.entry-points."featcache.algorithms"]
BUILTIN = __name__.rpartition(".")[0] + "."  # the modules of featcache's own algorithms
_entry_points_loaded = False


def is_plugin(spec: str) -> bool:
    """Whether `spec` names a plug-in class (`file.py:Class` or `package.module:Class`) rather than a registered
    name."""
    return isinstance(spec, str) and ":" in spec


def load_entry_points() -> None:
    """Register the algorithms installed packages declare in the `featcache.algorithms` entry-point group
    (`myprox = "mypkg.algo:MyProx"`), once per process. A broken one is skipped with a one-line warning: it must not
    stop the built-in algorithms from running."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            load(ep.value)
        except UserError as e:
            warnings.warn(f"installed algorithm {ep.name!r} skipped: {e}", stacklevel=2)


def load(spec: str) -> str:
    """Import the plug-in class of `spec` (`path/to/file.py:Class` or `package.module:Class`), register it under its
    `name` and return that name. A registered name is returned as it is."""
    if not isinstance(spec, str):
        raise UserError(
            f"algo must be one algorithm name or plug-in spec, not {type(spec).__name__} {spec!r}: "
            "call once per algorithm"
        )
    if not is_plugin(spec):
        return spec
    load_entry_points()
    where, _, cls_name = spec.rpartition(":")
    if not where or not cls_name:
        raise UserError(f"--algo {spec}: write path/to/file.py:ClassName or package.module:ClassName")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _import_file(Path(where), spec) if is_file else _import_module(where, spec)
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise UserError(f"--algo {spec}: {where} has no class {cls_name!r}")
    name = cls.__dict__.get("name") if isinstance(cls, type) else None
    if isinstance(cls, type) and issubclass(cls, FedAvg) and not (isinstance(name, str) and name):
        raise UserError(
            f"--algo {spec}: {cls_name} needs a `name` of its own (a class attribute, e.g. name = "
            f"{cls_name.lower()!r}); it would otherwise run as {getattr(cls, 'name', None)!r}"
        )
    try:
        register(cls)
    except UserError as e:
        raise UserError(f"--algo {spec}: {e}") from None
    return cls.name


def _import_file(path: Path, spec: str):
    """Import a plug-in file as a module of its own (once per resolved path: loading the same file twice gives the
    same classes)."""
    if not path.is_file():
        raise UserError(f"--algo {spec}: no file {path}")
    resolved = path.resolve()
    name = f"featcache_plugin_{resolved.stem}_{hashlib.sha256(str(resolved).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, resolved)
    if loader_spec is None or loader_spec.loader is None:
        raise UserError(f"--algo {spec}: {path} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except UserError:
        sys.modules.pop(name, None)
        raise
    except BaseException as e:
        sys.modules.pop(name, None)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise UserError(f"--algo {spec}: importing {path} failed: {type(e).__name__}: {first_line(e)}") from e
    return module


def _import_module(module_name: str, spec: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise UserError(f"--algo {spec}: no module {module_name!r} (write file.py:Class for a file)") from e
        raise UserError(f"--algo {spec}: importing {module_name} failed: {type(e).__name__}: {first_line(e)}") from e
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"--algo {spec}: importing {module_name} failed: {type(e).__name__}: {first_line(e)}") from e


def plugin_failure(exc: BaseException) -> str | None:
    """'path/to/my_algo.py:42, in local_loss: ZeroDivisionError: division by zero' when `exc` was raised in (or below)
    the code of an algorithm loaded from outside featcache (the innermost frame in a plug-in's file names the hook);
    None when no plug-in's code is on its traceback."""
    files = set()
    for cls in _ALGOS.values():
        source = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if not cls.__module__.startswith(BUILTIN) and source:
            files.add(str(Path(source).resolve()))
    hit, tb = None, exc.__traceback__
    while tb is not None:
        if str(Path(tb.tb_frame.f_code.co_filename).resolve()) in files:
            hit = tb  # the innermost one wins
        tb = tb.tb_next
    if hit is None:
        return None
    return (
        f"{hit.tb_frame.f_code.co_filename}:{hit.tb_lineno}, in {hit.tb_frame.f_code.co_name}: "
        f"{type(exc).__name__}: {first_line(exc, 200)}"
    )


def plugin_exit(e: SystemExit) -> UserError | None:
    """The one line for a plug-in hook's `sys.exit()` (a run that quietly stops with exit code 0 and no result would
    look like a success), or None when the exit is not a plug-in's."""
    where = plugin_failure(e)
    if where is None:
        return None
    return UserError(
        f"plug-in exited at {where.rpartition(': SystemExit')[0]} (sys.exit({e.code!r})): a hook must "
        "return its value or raise an exception"
    )


@contextmanager
def plugin_exits():
    """Inside: a plug-in hook's `sys.exit()` becomes its UserError line (`plugin_exit`); other exits pass through."""
    try:
        yield
    except SystemExit as e:
        error = plugin_exit(e)
        if error is None:
            raise
        raise error from None
