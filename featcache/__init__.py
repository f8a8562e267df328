"""featcache: run frozen backbones once, train federated heads on the cached features."""

import os

# Transparent huge pages for torch's large CPU tensors (read once, at torch's first allocation; a user's own setting
# wins). A grid's stacked gradients and moments are hundreds of MB allocated afresh every step; page by page, the
# first touch of them costs more than the matmul that fills them (bench/grid.py, bench/train.py).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
