"""The one Ray start-up that `extract --backend ray` and `grid --backend ray` share."""

from __future__ import annotations

import os

from .errors import UserError


def ray_module():
    """The `ray` module, initialised: `ray.init()` joins RAY_ADDRESS when set (a real cluster), else starts a local
    Ray; a missing Ray is one line."""
    try:
        import ray  # optional: only a Ray backend needs it
    except ImportError:
        raise UserError("--backend ray needs Ray: pip install 'featcache[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
    return ray
