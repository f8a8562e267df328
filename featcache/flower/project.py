"""The `flwr run` project of a featcache run (`featcache flower new`): a folder Flower builds and runs as it is.

    NAME/pyproject.toml          [project] and [tool.flwr.app]: the components and the run config (algo, settings,
                                 seed, rounds, clients, cache, out, timeout)
    NAME/<package>/server_app.py app = featcache.flower.server_app()  (every value from the run config)
    NAME/<package>/client_app.py app = featcache.flower.client_app()

A node's cache is its node config's `cache` (a per-client file of `featcache split`, or the whole cache with
`client=N`), else the run config's `cache` (Flower's simulation: the whole cache, the node's `partition-id`).

The project declares no dependencies: Flower's runtime `uv sync`s them into a fresh environment from an index, and
the apps run where featcache is installed (Flower leaves its own `flwr` out of that install for the same reason).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

from ..errors import UserError, as_path
from ..runs.spec import RunSpec
from ..training.config import batched
from .federation import refuse

SERVER = '''"""The ServerApp: featcache's server of the run config's algorithm."""

from featcache.flower import server_app

app = server_app()
'''

CLIENT = '''"""The ClientApp: one featcache client, its rows from the node config's (or the run config's) cache."""

from featcache.flower import client_app

app = client_app()
'''


def new_project(
    name: str,
    algo: str,
    cache,
    rounds: int | None = None,
    seed: int = 0,
    set=None,
    folder=".",
    out: str = "runs",
    timeout: float = 600.0,
) -> dict:
    """Write the project NAME into `folder`; returns {project, pyproject, clients, run} (`run`: the `flwr run`
    command of Flower's simulation, one SuperNode per client). The settings are resolved and
    checked here (an unknown or bad one is one line), the cache's metadata read for its number of clients."""
    from ..cache import info

    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", name):
        raise UserError(f"project name {name!r}: use 1 to 64 letters, digits, '-' and '_', starting with a letter")
    try:
        import tomli_w  # Flower's own TOML writer: every value the project holds is written by a serializer
    except ImportError:
        raise UserError("featcache flower new needs Flower: pip install 'featcache[flower]'") from None
    spec = RunSpec.resolve(algo, rounds, [seed], set)
    shared, _ = batched([spec.config | {"seed": seed}], spec.algo)
    refuse(spec.algo.bind(shared))  # what cannot run as a Flower app is refused here, not at `flwr run`
    cache = as_path(cache, "cache").resolve()
    meta = info(cache)
    split = meta.get("split")
    clients = json.loads(split)["clients"] if isinstance(split, str) else len(meta["counts"]["clients"])
    root = as_path(folder, "dir") / name
    runs = Path(out)  # relative: from where the SuperLink starts (here, for a local one)
    if (runs.exists() or runs.is_symlink()) and not runs.is_dir():  # a file, or a link to nothing, here
        raise UserError(f"--out {out} is not a folder here (a file or a broken link): pass a folder for the results")
    if root.exists() or root.is_symlink():
        raise UserError(f"{root} exists: pick another NAME or remove it")
    package = name.replace("-", "_") + "_app"
    settings = {k: v for k, v in spec.config.items() if k not in ("rounds", "seed")}
    project = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {
            "name": name,
            "version": "1.0.0",
            "description": f"{spec.name} on a featcache cache, as a Flower app",
            "license": "Apache-2.0",
            "dependencies": [],
        },
        "tool": {
            "hatch": {"build": {"targets": {"wheel": {"packages": [package]}}}},
            "flwr": {
                "app": {
                    "publisher": "featcache",
                    "components": {"serverapp": f"{package}.server_app:app", "clientapp": f"{package}.client_app:app"},
                    "config": {
                        "algo": spec.name,
                        "settings": json.dumps(settings, sort_keys=True),
                        "seed": seed,
                        "rounds": spec.config["rounds"],
                        "clients": clients,
                        "cache": str(cache),
                        "out": str(out),
                        "timeout": float(timeout),
                    },
                }
            },
        },
    }
    files = {
        "pyproject.toml": tomli_w.dumps(project),
        f"{package}/__init__.py": "",
        f"{package}/server_app.py": SERVER,
        f"{package}/client_app.py": CLIENT,
    }
    try:
        (root / package).mkdir(parents=True)
        for rel, text in files.items():
            (root / rel).write_text(text)
    except OSError as e:
        shutil.rmtree(root, ignore_errors=True)
        why = e.strerror or e
        raise UserError(f"cannot write the project into {root} ({why}): pick a --dir you can write") from None
    run = f"flwr run {shlex.quote(str(root))} --stream --federation-config num-supernodes={clients}"
    return {"project": str(root), "pyproject": str(root / "pyproject.toml"), "clients": clients, "run": run}
