"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, eq. 2).

Differs from FedAvg only in the local objective: client k minimises h_k(w; w^t) = F_k(w) + μ/2 ||w − w^t||² (eq. 2),
where w^t is the global model the round started from and the norm runs over every trainable parameter. The
proximal term is a `penalty`: its gradient μ (w − w^t) is added to F_k's, not derived by autograd.
μ = 0.01 by default, a value from the paper's search set {0.001, 0.01, 0.1, 0.5, 1}; the paper picks μ per data set
(§5), so tune it: μ is a continuous hyperparameter that a grid varies per configuration.
Global model: FedAvg's, the w^t every client starts the next round from.
"""

from __future__ import annotations

from ..training.config import Setting
from .base import FedAvg, bcast
from .registry import register


@register
class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020, eq. 2"
    uploads = "all head parameters"
    settings = {"mu": Setting(0.01, "μ, weight of the proximal term (the paper's search set; tune per data set)", lo=0)}
    uses_global = True  # w^t: ctx["global"]

    def penalty(self, params, ctx):
        """μ/2 ||w − w^t||² [H, C] and its gradient μ (w − w^t), added to F_k's without autograd."""
        mu = ctx["hp"]["mu"]  # [H, C]
        diff = {k: params[k] - ctx["global"][k] for k in params}  # [H, C, ...]
        value = mu / 2 * sum(d.square().flatten(2).sum(-1) for d in diff.values())  # [H, C]
        return value, {k: bcast(mu, d) * d for k, d in diff.items()}
