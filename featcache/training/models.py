"""Stacks of models: every tensor leads with [H, C] (H configurations x C clients); per-client functions run on all
of them at once through two nested vmaps."""

from __future__ import annotations

import torch
from torch.func import vmap

Params = dict[str, torch.Tensor]


def map_models(fn, model_args: tuple, client_args: tuple = (), shared_args: tuple = ()):
    """Apply a per-client function to every model: model_args lead with [H, C], client_args with [C] (data shared
    by all configurations, never copied H times), shared_args are passed unchanged."""
    n_m, n_c, n_s = len(model_args), len(client_args), len(shared_args)
    inner = vmap(fn, in_dims=(0,) * (n_m + n_c) + (None,) * n_s)
    outer = vmap(inner, in_dims=(0,) * n_m + (None,) * (n_c + n_s))
    return outer(*model_args, *client_args, *shared_args)


def expand_hc(t: torch.Tensor, C: int) -> torch.Tensor:
    """[H, ...] -> [H, C, ...] (a view)."""
    return t[:, None].expand(t.shape[0], C, *t.shape[1:])
