"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, eq. 2).

Differs from FedAvg only in the local objective: client k minimises h_k(w; w^t) = F_k(w) + μ/2 ||w − w^t||² (eq. 2),
where w^t is the global model the round started from and the norm runs over every trainable parameter.
μ = 0.01 by default, a value from the paper's search set {0.001, 0.01, 0.1, 0.5, 1}; the paper picks μ per data set
(§5), so tune it: μ is a continuous hyperparameter that a grid varies per configuration.
Global model: FedAvg's, the w^t every client starts the next round from.
"""

from __future__ import annotations

from ..training.config import Setting
from .base import FedAvg, proximal
from .registry import register


@register
class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020, eq. 2"
    uploads = "all head parameters"
    settings = {"mu": Setting(0.01, "μ, weight of the proximal term (the paper's search set; tune per data set)", lo=0)}
    uses_global = True  # w^t: ctx["global"]

    def local_loss(self, params, buffers, x, y, mask, ctx):
        ce, new_buffers = super().local_loss(params, buffers, x, y, mask, ctx)
        return ce + ctx["hp"]["mu"] / 2 * proximal(params, ctx["global"]), new_buffers
