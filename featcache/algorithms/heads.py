"""Learnable heads as pure functions of a parameter dict, written for ONE client and vectorized with torch.func.vmap.

A head is a list of layers; `init` returns (params, buffers) for one model, `apply` maps features [N, D] to
outputs [N, H_out]. Batch normalisation uses the statistics of the valid (masked) rows while training and returns
its updated running statistics instead of mutating buffers, so it is vmap-safe.
"""

from __future__ import annotations

import math

import torch

Params = dict[str, torch.Tensor]


def linear_init(params: Params, name: str, d_in: int, d_out: int, gen: torch.Generator) -> None:
    """torch.nn.Linear's default init (Kaiming-uniform weight, uniform bias), from an explicit generator."""
    bound = 1 / math.sqrt(d_in)
    params[f"{name}.weight"] = (torch.rand(d_out, d_in, generator=gen) * 2 - 1) * bound  # [d_out, d_in]
    params[f"{name}.bias"] = (torch.rand(d_out, generator=gen) * 2 - 1) * bound  # [d_out]


def linear(params: Params, name: str, x: torch.Tensor) -> torch.Tensor:
    return x @ params[f"{name}.weight"].T + params[f"{name}.bias"]  # [N, d_out]


def bn_init(params: Params, buffers: Params, name: str, d: int) -> None:
    params[f"{name}.weight"] = torch.ones(d)
    params[f"{name}.bias"] = torch.zeros(d)
    buffers[f"{name}.running_mean"] = torch.zeros(d)
    buffers[f"{name}.running_var"] = torch.ones(d)


def batch_norm(
    params: Params,
    buffers: Params,
    name: str,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    train: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, Params]:
    """BatchNorm1d over the rows where mask is True; returns (output [N, d], updated running statistics)."""
    mean_key, var_key = f"{name}.running_mean", f"{name}.running_var"
    if train:
        w = (torch.ones(x.shape[0], device=x.device) if mask is None else mask.float())[:, None]  # [N, 1]
        n = w.sum().clamp(min=1)
        mean = (w * x).sum(0) / n  # [d]
        var = (w * (x - mean) ** 2).sum(0) / n  # [d] biased, used to normalise
        unbiased = var * n / (n - 1).clamp(min=1)
        new = {
            mean_key: (1 - momentum) * buffers[mean_key] + momentum * mean,
            var_key: (1 - momentum) * buffers[var_key] + momentum * unbiased,
        }
    else:
        mean, var, new = buffers[mean_key], buffers[var_key], {}
    y = (x - mean) / torch.sqrt(var + eps) * params[f"{name}.weight"] + params[f"{name}.bias"]
    return y, new


def mlp_init(dims: list[int], gen: torch.Generator, prefix: str = "fc", bn: bool = False) -> tuple[Params, Params]:
    """Linear layers dims[0] -> dims[1] -> ... with ReLU between (and BN after each ReLU when bn=True)."""
    params: Params = {}
    buffers: Params = {}
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        linear_init(params, f"{prefix}{i}", a, b, gen)
        if bn and i < len(dims) - 2:
            bn_init(params, buffers, f"{prefix}{i}.bn", b)
    return params, buffers


def mlp(
    params: Params,
    buffers: Params,
    x: torch.Tensor,
    layers: int,
    prefix: str = "fc",
    mask: torch.Tensor | None = None,
    train: bool = False,
    final_relu: bool = False,
) -> tuple[torch.Tensor, Params]:
    """Apply `layers` linear layers (ReLU between; BN after the ReLU where initialised)."""
    new: Params = {}
    for i in range(layers):
        x = linear(params, f"{prefix}{i}", x)
        if i < layers - 1 or final_relu:
            x = torch.relu(x)
        if f"{prefix}{i}.bn.weight" in params:
            x, upd = batch_norm(params, buffers, f"{prefix}{i}.bn", x, mask, train)
            new.update(upd)
    return x, new
