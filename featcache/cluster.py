"""The one Ray start-up that `extract --backend ray` and `grid --backend ray` share."""

from __future__ import annotations

import os
import socket

from .errors import UserError, first_line

CONNECT_TIMEOUT_S = 10.0  # how long a RAY_ADDRESS may take to accept a connection before it counts as not answering


def ray_module():
    """The `ray` module, initialised: `ray.init()` joins RAY_ADDRESS when set (a real cluster), else starts a local
    Ray; a missing Ray, or an address that does not answer (ray.init would wait for it forever), is one line."""
    try:
        import ray  # optional: only a Ray backend needs it
    except ImportError:
        raise UserError("--backend ray needs Ray: pip install 'featcache[ray]'") from None
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            check_answers(address)
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        except ConnectionError as e:  # something answers there, but not a Ray cluster (or not this Ray's version)
            raise UserError(
                f"RAY_ADDRESS={address}: cannot join a Ray cluster there ({first_line(e)}): start it "
                "(ray start --head) or fix or unset RAY_ADDRESS"
            ) from None
    return ray


def check_answers(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """One line unless the cluster at `address` (HOST:PORT or ray://HOST:PORT; 'auto' and 'local' are Ray's to
    find) accepts a TCP connection within `timeout` seconds."""
    if address in ("auto", "local"):
        return
    host, sep, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"RAY_ADDRESS={address!r} is not HOST:PORT, ray://HOST:PORT, auto or local: fix or unset it")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:  # unknown host, refused, unreachable, timed out
        reason = e.strerror or str(e) or type(e).__name__
        raise UserError(
            f"RAY_ADDRESS={address}: no Ray cluster answers there ({reason}; waited up to {timeout:g} s): "
            "start it (ray start --head) or fix or unset RAY_ADDRESS"
        ) from None
