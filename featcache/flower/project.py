"""The `flwr run` project of a featcache run (`featcache flower new`): a folder Flower builds and runs as it is.

    NAME/pyproject.toml          [project] and [tool.flwr.app]: the components and the run config (algo, settings,
                                 seed, rounds, clients, cache, out, timeout)
    NAME/<package>/server_app.py app = featcache.flower.server_app()  (every value from the run config)
    NAME/<package>/client_app.py app = featcache.flower.client_app()

A node's cache is its node config's `cache` (a per-client file of `featcache split`, or the whole cache with
`client=N`), else the run config's `cache` (Flower's simulation: the whole cache, the node's `partition-id`).
"""

from __future__ import annotations

import json
import re

from ..errors import UserError, as_path
from ..runs.spec import RunSpec

PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0.0"
description = "{algo} on a featcache cache, as a Flower app"
license = "Apache-2.0"
dependencies = ["featcache[flower]"]

[tool.hatch.build.targets.wheel]
packages = ["{package}"]

[tool.flwr.app]
publisher = "featcache"

[tool.flwr.app.components]
serverapp = "{package}.server_app:app"
clientapp = "{package}.client_app:app"

[tool.flwr.app.config]
algo = "{algo}"
settings = '{settings}'
seed = {seed}
rounds = {rounds}
clients = {clients}
cache = "{cache}"
out = "{out}"
timeout = {timeout}
"""

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
    """Write the project NAME into `folder`; returns {project, pyproject, clients}. The settings are resolved and
    checked here (an unknown or bad one is one line), the cache's metadata read for its number of clients."""
    from ..cache import info

    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name):
        raise UserError(f"project name {name!r}: use letters, digits, '-' and '_', starting with a letter")
    spec = RunSpec.resolve(algo, rounds, [seed], set)
    cache = as_path(cache, "cache").resolve()
    meta = info(cache)
    split = meta.get("split")
    clients = json.loads(split)["clients"] if isinstance(split, str) else len(meta["counts"]["clients"])
    root = as_path(folder, "dir") / name
    if root.exists():
        raise UserError(f"{root} exists: pick another NAME or remove it")
    package = name.replace("-", "_") + "_app"
    settings = {k: v for k, v in spec.config.items() if k not in ("rounds", "seed")}
    text = PYPROJECT.format(
        name=name,
        package=package,
        algo=spec.name,
        settings=json.dumps(settings, sort_keys=True),
        seed=seed,
        rounds=spec.config["rounds"],
        clients=clients,
        cache=cache,
        out=out,
        timeout=float(timeout),
    )
    (root / package).mkdir(parents=True)
    (root / "pyproject.toml").write_text(text)
    (root / package / "__init__.py").write_text("")
    (root / package / "server_app.py").write_text(SERVER)
    (root / package / "client_app.py").write_text(CLIENT)
    return {"project": str(root), "pyproject": str(root / "pyproject.toml"), "clients": clients}
