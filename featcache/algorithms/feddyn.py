"""FedDyn (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021, Alg. 1).

Differences from FedAvg:
- local objective of client k in round t (Alg. 1 line 5), from the round's global model θ^{t−1}:

      R_k(θ) = L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + α/2 ||θ − θ^{t−1}||²,

  the linear and quadratic terms a `penalty` with the closed-form gradient −∇L_k(θ_k^{t−1}) + α (θ − θ^{t−1});
- after training, each participant updates its linear term (line 6): ∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α (θ_k^t −
  θ^{t−1}), kept per client (`state.client["grad"]`, zero at the start); absent clients keep theirs;
- the server keeps h (zero at the start) and, over the participants P_t of the m clients (lines 9–10):
  h^t = h^{t−1} − α/m Σ_{k∈P_t} (θ_k^t − θ^{t−1}),  θ^t = 1/|P_t| Σ_{k∈P_t} θ_k^t − h^t / α.
Choices the paper leaves open: line 9's sum is read as the sum of the participants' changes θ_k^t − θ^{t−1}, as PFLlib
computes it; the mean over P_t is uniform (n_k ignored); BN running statistics (bn=True) are
not parameters and are averaged with FedAvg's n_k / n weights; the local problem is solved inexactly by the engine's
local epochs and optimizer (Adam by default; the paper uses SGD: --set optimizer=sgd). α = 0.01 by default, from the
paper's search set {0.1, 0.01, 0.001}; it is a per-configuration value that a grid varies.
Global model: θ^t, which every client downloads.
The training loss is R_k, whose linear term has no sign: not a fit measure (`objective`).

`feddyn-official` matches PFLlib (TsingZ0/PFLlib @ d832e76f, system/flcore/clients/clientdyn.py and
servers/serverdyn.py), which writes the quadratic term as α/2 ||θ − θ^{t−1}||, the norm of the whole parameter vector
unsquared (its gradient α/2 (θ − θ^{t−1}) / ||θ − θ^{t−1}||, 0 at θ = θ^{t−1}); its line 6 and server are the paper's.
With bn=True PFLlib's server keeps the first upload's BN statistics; both variants here average them.
"""

from __future__ import annotations

import torch

from ..training.config import Setting
from .base import FedAvg, bcast, laid_like, weighted_mean
from .registry import register


def sq_norm(d: dict) -> torch.Tensor:
    """Σ over parameters of ||d_k||² for name -> [H, C, ...]: [H, C]."""
    norms = [torch.linalg.vector_norm(v, dim=tuple(range(2, v.dim()))).square() for v in d.values()]  # [H, C] each
    return torch.stack(norms).sum(0)  # [H, C]


@register
class FedDyn(FedAvg):
    name = "feddyn"
    paper = "Acar et al., Federated Learning Based on Dynamic Regularization, ICLR 2021, Alg. 1"
    uploads = "all head parameters"
    settings = {
        "alpha": Setting(
            0.01, "α, weight of the dynamic regularizer (the paper's search set {0.1, 0.01, 0.001})", lo=0, lo_open=True
        )
    }
    objective = "holds the linear term −⟨∇L_k(θ_k^{t−1}), θ⟩, which has no sign: judge runs by accuracy"
    uses_global = True  # θ^{t−1}: ctx["global"]
    fedavg_server = False  # per-client linear terms (after_local), the server's h (aggregate, download)

    def init_state(self, state, rnd):
        super().init_state(state, rnd)  # θ^0: state.server["global"]
        state.client["grad"] = {k: torch.zeros_like(v) for k, v in state.params.items()}  # ∇L_k(θ_k) [H, C, ...]
        state.server["h"] = {k: torch.zeros_like(v) for k, v in state.server["global"].items()}  # h [H, ...]

    def context(self, state, rnd):
        return super().context(state, rnd) | {"grad": state.client["grad"]}

    def quadratic(self, d: dict, alpha: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """α/2 ||d||² [H, C] and its gradient α d, d = θ − θ^{t−1} name -> [H, C, ...] (overwritten)."""
        value = alpha / 2 * sq_norm(d)  # [H, C]
        return value, {k: v.mul_(bcast(alpha, v)) for k, v in d.items()}

    def penalty(self, params, ctx):
        """−⟨∇L_k(θ_k^{t−1}), θ⟩ + α/2 ||θ − θ^{t−1}||² [H, C] and its gradient, added to L_k's without autograd."""
        alpha, lin = ctx["hp"]["alpha"], ctx["grad"]  # [H, C], name -> [H, C, ...]
        d = {k: w - laid_like(ctx["global"][k], w) for k, w in params.items()}  # θ − θ^{t−1} [H, C, ...]
        value, grads = self.quadratic(d, alpha)
        for k, w in params.items():
            value = value - (w * lin[k]).sum(dim=tuple(range(2, w.dim())))  # [H, C]
            grads[k].sub_(lin[k])
        return value, grads

    def after_local(self, state, rnd):
        """Line 6 for the participants: ∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α (θ_k^t − θ^{t−1})."""
        alpha, x = rnd.hp["alpha"], state.server["global"]  # [H], name -> [H, ...]
        for k, g in state.client["grad"].items():  # [H, C, ...]
            new = g - bcast(alpha, g) * (state.params[k] - rnd.expand(x[k]))  # [H, C, ...]
            state.client["grad"][k] = torch.where(bcast(rnd.part, g), new, g)

    def aggregate(self, uploads, weights, state, rnd):
        part = rnd.part.float()  # [H, C] uniform over P_t
        alpha, frac = rnd.hp["alpha"], part.sum(1) / rnd.C  # [H], [H] |P_t| / m
        x, h = state.server["global"], state.server["h"]  # name -> [H, ...]
        mean = {k: weighted_mean(uploads[k], part) for k in x}  # 1/|P_t| Σ θ_k^t [H, ...]
        # h^t = h^{t−1} − α/m Σ_{k∈P_t} (θ_k^t − θ^{t−1}) = h^{t−1} − α |P_t|/m (mean − θ^{t−1})
        h = {k: h[k] - bcast(alpha * frac, h[k]) * (mean[k] - x[k]) for k in h}  # [H, ...]
        model = {k: mean[k] - h[k] / bcast(alpha, h[k]) for k in x}  # θ^t [H, ...]
        stats = {k: weighted_mean(uploads[k], weights) for k in state.buffers if k in uploads}  # [H, ...]
        return {"model": model | stats, "h": h}

    def download(self, state, server, rnd):
        super().download(state, server["model"], rnd)  # θ^t to every client; it becomes the next θ^{t−1}
        state.server["h"] = server["h"]


@register
class FedDynOfficial(FedDyn):
    name = "feddyn-official"
    paper = "FedDyn as PFLlib releases it (TsingZ0/PFLlib, clientdyn.py, serverdyn.py)"
    uploads = "all head parameters"
    objective = (
        "holds the linear term −⟨∇L_k(θ_k^{t−1}), θ⟩, which has no sign, and is unbounded below once "
        "||∇L_k(θ_k^{t−1})|| > α/2 (the release's norm is not squared): judge runs by accuracy"
    )

    def quadratic(self, d, alpha):
        """α/2 ||d|| [H, C] (the whole vector's norm, unsquared) and its gradient α/2 d / ||d|| (0 where d = 0)."""
        norm = sq_norm(d).sqrt()  # [H, C]
        scale = torch.where(norm > 0, alpha / 2 / norm.clamp(min=torch.finfo(norm.dtype).tiny), 0.0)  # [H, C]
        return alpha / 2 * norm, {k: v.mul_(bcast(scale, v)) for k, v in d.items()}
