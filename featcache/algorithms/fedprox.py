"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, eq. 2).

Differs from FedAvg only in the local objective: client k minimises h_k(w; w^t) = F_k(w) + μ/2 ||w − w^t||² (eq. 2),
where w^t is the global model the round started from and the norm runs over every trainable parameter.
μ = 0.01 by default, a value from the paper's search set {0.001, 0.01, 0.1, 0.5, 1}; the paper picks μ per data set
(§5), so tune it: μ is a continuous hyperparameter that a grid varies per configuration.
"""

from __future__ import annotations

import torch

from ..engine import expand_hc
from . import register
from .base import FedAvg


def remember_global(state) -> None:
    """Keep the model every client starts the next round from, w^t [H, ...], in state.server["global"].

    Call it after the download of a FedAvg-style algorithm, when all clients of a configuration hold the same model.
    """
    state.server["global"] = {k: v[:, 0].clone() for k, v in state.params.items()}  # [H, ...]


def global_context(state, engine) -> dict:
    """The round's global model broadcast to every client: name -> [H, C, ...] (views)."""
    return {k: expand_hc(v, engine.C) for k, v in state.server["global"].items()}


def proximal(params: dict, anchor: dict) -> torch.Tensor:
    """||w − w^t||² summed over all parameters (a scalar for one client)."""
    return sum(((params[k] - anchor[k]) ** 2).sum() for k in params)


@register
class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020, eq. 2"
    uploads = "all head parameters"
    defaults = FedAvg.defaults | {"mu": 0.01}  # from the paper's μ search set (§5); tune per data set

    def init_state(self, state, engine):
        remember_global(state)

    def download(self, state, server, part, engine):
        super().download(state, server, part, engine)
        remember_global(state)

    def context(self, state, engine):
        return super().context(state, engine) | {"global": global_context(state, engine)}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        ce, new_buffers = super().local_loss(params, buffers, x, y, mask, ctx)
        return ce + ctx["hp"]["mu"] / 2 * proximal(params, ctx["global"]), new_buffers
