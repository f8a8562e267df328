"""Algorithm registry, like timm's model registry: `@register` on a class, `create(name, cfg)`, `list_algorithms()`.

Every algorithm is a subclass of `base.FedAvg` that overrides only the hooks where it differs.

A name may also be a plug-in spec, `path/to/my_algo.py:MyAlgo` or `package.module:MyAlgo`: `load(spec)` imports the
class (a FedAvg subclass), registers it under its own `name` and returns that name; `create(spec)` does the same.
Installed packages can declare theirs in the `featcache.algorithms` entry-point group (`name = "module:Class"`).
An exception raised inside a plug-in's code is named by `plugin_failure` (file, line, hook) for the CLI's one line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import pkgutil
import re
import sys
import warnings
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path

from ..training.config import shared_settings
from ..errors import UserError, first_line, suggest

_ALGOS: dict[str, type] = {}

# Methods whose mechanism needs something a feature cache cannot give: listed, never faked.
UNAVAILABLE = {
    "pfedpt": "pFedPT (Li et al., 2023) learns visual prompts added to the input pixels, before the backbone; "
    "cached features come after the frozen backbone, so its prompts have nothing to act on. "
    "FedPFT's feature-space prompts (fedpft) are the cached-feature counterpart.",
}


def plugin_failure(exc: BaseException) -> str | None:
    """'path/to/my_algo.py:42, in local_loss: ZeroDivisionError: division by zero' when `exc` was raised in (or below)
    the code of an algorithm loaded from outside featcache (the innermost frame in a plug-in's file names the hook);
    None when no plug-in's code is on its traceback."""
    files = set()
    for cls in _ALGOS.values():
        module = sys.modules.get(cls.__module__)
        if not cls.__module__.startswith(f"{__name__}.") and getattr(module, "__file__", None):
            files.add(str(Path(module.__file__).resolve()))
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


def objective_note(algo, cfg: dict) -> str:
    """The algorithm's `objective` note when it holds under the resolved settings `cfg` (its `objective_when`),
    else ""."""
    when = getattr(algo, "objective_when", {})
    return getattr(algo, "objective", "") if all(cfg.get(k) == v for k, v in when.items()) else ""


def objective_text(algo) -> str:
    """The algorithm's note on its training loss, with the settings under which it holds ("" when it has none)."""
    note, when = getattr(algo, "objective", ""), getattr(algo, "objective_when", {})
    return f"{note} (with {', '.join(f'{k}={v}' for k, v in when.items())})" if note and when else note


def markdown_table() -> str:
    """The built-in algorithms and the unavailable methods as the Markdown table of featcache/algorithms/README.md
    (`featcache algos --markdown` prints it; tests/test_docs.py fails when the committed copy differs)."""

    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    rows = ["| algorithm | reference | a client uploads | note |", "|---|---|---|---|"]
    for key, cls in list_algorithms().items():
        if not cls.__module__.startswith(f"{__name__}."):
            continue  # plug-ins loaded in this process are not part of the package's table
        objective = objective_text(cls)
        note = "; ".join(filter(None, [getattr(cls, "limitation", ""), objective and f"training loss {objective}"]))
        rows.append(f"| `{key}` | {cell(cls.paper)} | {cell(cls.uploads)} | {cell(note)} |")
    for key, why in UNAVAILABLE.items():
        rows.append(f"| `{key}` | — | — | not available: {cell(why)} |")
    return "\n".join(rows) + "\n"


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+-]{0,63}")  # names result files and scopes --set ALGO.key


def name_problem(name) -> str | None:
    """Why `name` cannot name an algorithm (None when it can): it is part of every result file's name and the scope
    of `--set ALGO.key`, so 1 to 64 letters, digits, '_', '+' or '-', starting with a letter or digit."""
    if isinstance(name, str) and NAME.fullmatch(name):
        return None
    shown = f"{name[:40]!r}... ({len(name)} characters)" if isinstance(name, str) and len(name) > 40 else repr(name)
    return (
        f"{shown} cannot name an algorithm: use 1 to 64 letters, digits, '_', '+' or '-' (it is part of result "
        "file names and of --set NAME.key)"
    )


def register(cls):
    """Class decorator: make `cls` creatable by its `name`; a name can be registered once."""
    if (problem := name_problem(cls.name)) is not None:
        raise UserError(f"{cls.__qualname__}.name {problem}")
    old = _ALGOS.get(cls.name)
    if old is not None and old is not cls:
        raise UserError(f"algorithm name {cls.name!r} is already registered by {old.__module__}.{old.__qualname__}")
    _ALGOS[cls.name] = cls
    return cls


ENTRY_POINT_GROUP = "featcache.algorithms"  # installed packages: [project.entry-points."featcache.algorithms"]
_entry_points_loaded = False


def _import_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")
    _load_entry_points()


def _load_entry_points() -> None:
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


def list_algorithms() -> dict[str, type]:
    _import_all()
    return dict(sorted(_ALGOS.items()))


def is_plugin(spec: str) -> bool:
    """Whether `spec` names a plug-in class (`file.py:Class` or `package.module:Class`) rather than a registered
    name."""
    return isinstance(spec, str) and ":" in spec


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
    _import_all()
    where, _, cls_name = spec.rpartition(":")
    if not where or not cls_name:
        raise UserError(f"--algo {spec}: write path/to/file.py:ClassName or package.module:ClassName")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _import_file(Path(where), spec) if is_file else _import_module(where, spec)
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise UserError(f"--algo {spec}: {where} has no class {cls_name!r}")
    from .base import FedAvg  # cycle: base imports `register` from here

    if not (isinstance(cls, type) and issubclass(cls, FedAvg)):
        raise UserError(
            f"--algo {spec}: {cls_name} is not an algorithm (a subclass of featcache.algorithms.base.FedAvg)"
        )
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise UserError(
            f"--algo {spec}: {cls_name} needs a `name` of its own (a class attribute, e.g. name = "
            f"{cls_name.lower()!r}); it would otherwise run as {getattr(cls, 'name', None)!r}"
        )
    if (problem := name_problem(name)) is not None:
        raise UserError(f"--algo {spec}: {cls_name}.name {problem}")
    if name in UNAVAILABLE:
        raise UserError(f"--algo {spec}: {cls_name}.name {name!r} is a reserved algorithm name: pick another")
    from ..training.config import settings_of

    try:
        settings_of(cls)
    except UserError as e:
        raise UserError(f"--algo {spec}: {e}") from None
    register(cls)
    return name


def create(name: str, cfg: dict | None = None):
    """A new instance of algorithm `name` (a registered name or a plug-in spec, see `load`), bound to the shared
    (structural) settings of `cfg` when given (the engine binds its own copy to the run's settings)."""
    _import_all()
    name = load(name)
    if name in UNAVAILABLE:
        raise UserError(f"{name} cannot run on cached features: {UNAVAILABLE[name]}")
    if name not in _ALGOS:
        raise UserError(f"unknown algorithm {name!r}{suggest(name, _ALGOS)}: see `featcache algos`")
    algo = _ALGOS[name]()
    if cfg is None:
        return algo
    return algo.bind(shared_settings(cfg, algo))
