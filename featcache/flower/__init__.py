"""Every featcache algorithm as a Flower app (`pip install 'featcache[flower]'`): a `ServerApp` and a `ClientApp`
built from a registered algorithm (plug-ins included) and its resolved settings, giving `featcache train`'s numbers.

    from featcache.flower import server_app, client_app
    server, client = server_app("fedpcl", rounds=5), client_app("fedpcl", rounds=5, cache="cache/….h5")

federation.py holds the split of a run into a server (the engine's round loop over messages) and its clients
(torch only), apps.py the Flower apps, project.py the `flwr run` project `featcache flower new` writes, results.py
their result files. Only this package imports flwr, and only when one of its apps is asked for.
"""

from __future__ import annotations

from ..errors import UserError

INSTALL = "pip install 'featcache[flower]'"


def require() -> None:
    """Flower importable, or one line naming the install."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise UserError(f"featcache.flower needs Flower (flwr), which is not installed: {INSTALL}") from None


def server_app(*args, **kwargs):
    """`apps.server_app`: the ServerApp of a run."""
    require()
    from .apps import server_app as make

    return make(*args, **kwargs)


def client_app(*args, **kwargs):
    """`apps.client_app`: the ClientApp of a run's clients."""
    require()
    from .apps import client_app as make

    return make(*args, **kwargs)
