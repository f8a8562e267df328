"""featcache: run frozen backbones once, train federated heads on the cached features.

Importing featcache changes nothing in the process's environment; the `featcache` command (featcache/cli.py) sets
torch's allocator option THP_MEM_ALLOC_ENABLE=1 before torch loads (see the README, "Training").
"""

__version__ = "0.1.0"
