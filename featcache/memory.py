"""Memory of the process and its device: how much is available (the one measure the memory checks of train and grid
use), and the allocator setting of the `featcache` command that keeps freed memory in the process.

torch takes CPU tensors from the C library's malloc. glibc serves large blocks with mmap and gives them back to the
kernel when they are freed, and trims the top of its heap the same way, so every training step that allocates its
gradient stacks again faults every page of them in afresh, which can cost more than the arithmetic on them.
`keep_freed_memory` asks glibc to serve every block from its heap and never to trim it, so a step reuses the pages
the previous step freed. The process keeps its peak memory until it exits, which suits a command that trains and
ends. The `featcache` command calls it when it starts a command that trains (featcache/cli: not extract, whose pass
would only keep its peak); importing featcache does not (a library user or a bench may call it).
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap and never give freed heap memory back (glibc's mallopt); returns whether
    it applied (False where the C library has no mallopt, e.g. macOS or musl)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def available_bytes(device) -> int:
    """Free memory of the (resolved) torch.device when it is a CUDA device, else the RAM the kernel reports as
    available (MemAvailable: free pages plus the cache it can reclaim), or the free pages where /proc/meminfo is
    missing."""
    if device.type == "cuda":
        import torch  # loaded already where a torch.device exists; the command imports this module before torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
