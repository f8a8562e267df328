"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, eq. 2).

Differs from FedAvg only in the local objective: client k minimises h_k(w; w^t) = F_k(w) + μ/2 ||w − w^t||² (eq. 2),
where w^t is the global model the round started from and the norm runs over every trainable parameter. The
proximal term is a `penalty`: its gradient μ (w − w^t) is added to F_k's, not derived by autograd.
μ = 0.01 by default, a value from the paper's search set {0.001, 0.01, 0.1, 0.5, 1}; the paper picks μ per data set
(§5), so tune it: μ is a continuous hyperparameter that a grid varies per configuration.
Global model: FedAvg's, the w^t every client starts the next round from.
μ = 0 trains FedAvg's model up to float rounding, not bit for bit (its steps add a zero penalty and run in FedProx's
own memory layouts). Under Adam (the default optimizer) a step is scaled per coordinate, not by the gradient's size,
so even a small μ pulls hard wherever F_k's gradient is small: the paper's μ values were tuned under SGD.
"""

from __future__ import annotations

import torch

from ..training.config import Setting
from .base import FedAvg, bcast, laid_like
from .registry import register


@register
class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020, eq. 2"
    uploads = "all head parameters"
    settings = {
        "mu": Setting(
            0.01,
            "μ, weight of the proximal term (the paper's search set, under SGD; tune per data set: under Adam a small "
            "μ still pulls hard)",
            lo=0,
        )
    }
    uses_global = True  # w^t: ctx["global"]

    def penalty(self, params, ctx):
        """μ/2 ||w − w^t||² [H, C] and its gradient μ (w − w^t), added to F_k's without autograd."""
        mu, sq, grads = ctx["hp"]["mu"], 0.0, {}  # mu [H, C]
        for k, w in params.items():
            d = w - laid_like(ctx["global"][k], w)  # [H, C, ...] in w's layout
            sq = sq + torch.linalg.vector_norm(d, dim=tuple(range(2, d.dim()))).square()  # [H, C]
            grads[k] = d.mul_(bcast(mu, d))  # μ (w − w^t), in d's memory
        return mu / 2 * sq, grads
