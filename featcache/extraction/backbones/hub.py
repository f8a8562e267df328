"""Whether timm's hub can serve a model's pretrained weights now, answered in a few seconds before the model is built:
offline, the hub's own lookup retries for about a minute before it fails.

Weights already in the local Hugging Face or torch hub cache are served offline. Otherwise HF_HUB_OFFLINE (set:
offline, no lookup) is honoured, and one TCP connection to the hub's host (or to the HTTPS proxy) is tried.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from .models import Lazy

TIMEOUT_S = 3.0  # for the name lookup and the connection together
_TRUE = ("1", "true", "yes", "on")


def cached_file(cfg) -> Path | None:
    """The weight file of timm's pretrained `cfg` in the local Hugging Face (or torch hub) cache, when it is there."""
    if cfg.hf_hub_id:
        for filename in filter(None, (cfg.hf_hub_filename, "model.safetensors", "pytorch_model.bin")):
            found = Lazy("huggingface_hub").try_to_load_from_cache(cfg.hf_hub_id, filename)
            if isinstance(found, str):
                return Path(found)
        return None
    if cfg.url:
        import torch  # lazy: only a URL weight asks for torch's hub folder

        file = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(cfg.url).path).name
        return file if file.is_file() else None
    return None


def unavailable(cfg) -> str | None:
    """Why the hub cannot serve `cfg`'s weights now ('HF_HUB_OFFLINE is set', 'the hub is unreachable (...)'), or
    None when they are cached or the hub answers."""
    if cfg.file or cached_file(cfg) is not None:
        return None
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        return "HF_HUB_OFFLINE is set"
    url = os.environ.get("HF_ENDPOINT", "https://huggingface.co") if cfg.hf_hub_id else cfg.url
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or os.environ.get("ALL_PROXY")
    where = urlparse(proxy or url)
    host, port = where.hostname or "", where.port or (80 if where.scheme == "http" else 443)
    if not reachable(host, port, TIMEOUT_S):
        return f"the hub is unreachable (no connection to {host}:{port} within {TIMEOUT_S:g} s)"
    return None


@functools.lru_cache(maxsize=8)
def reachable(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to host:port opens within `timeout` seconds, its name lookup included (a thread,
    since a name lookup takes no timeout of its own)."""
    opened = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            opened.append(True)
        except OSError:
            pass

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout)
    return bool(opened)
