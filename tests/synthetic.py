"""A small, separable synthetic federated feature set (Gaussian class centres) shared by the trainer tests."""

from __future__ import annotations

import torch

from featcache.cache import ClientData


def synthetic_clients(C: int = 4, n: tuple[int, int] = (30, 60), D: int = 16, K: int = 5, seed: int = 0,
                      spread: float = 1.0, views: int = 0) -> ClientData:
    centres = torch.randn(K, D, generator=torch.Generator().manual_seed(1234)) * 2  # same classes for every split
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(n[0], n[1] + 1, (C,), generator=g)  # [C] clients of different sizes
    N = int(counts.max())
    x, y = torch.zeros(C, N, D), torch.full((C, N), -1)
    v = torch.zeros(C, N, views, D) if views else None
    shift = torch.randn(C, D, generator=g) * 0.3  # a little feature shift per client
    for c in range(C):
        labels = torch.randint(0, K, (int(counts[c]),), generator=g)
        base = centres[labels] + shift[c]
        x[c, : len(labels)] = base + spread * torch.randn(len(labels), D, generator=g)
        y[c, : len(labels)] = labels
        if views:
            v[c, : len(labels)] = base[:, None] + spread * torch.randn(len(labels), views, D, generator=g)
    return ClientData(x, y, counts, K, v)
