"""featcache: run frozen backbones once, train federated heads on the cached features."""

__version__ = "0.1.0"
