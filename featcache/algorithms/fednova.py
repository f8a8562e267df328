"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization",
NeurIPS 2020, §4 eq. 6–7, Alg. 1 and App. B).

Differs from FedAvg only on the server side: clients take different numbers of local steps τ_i (featcache's uneven
clients: τ_i = local_epochs × the client's minibatches), and FedAvg's mean of their updates then optimises an
objective weighted by τ_i rather than by p_i. FedNova normalises each client's update by the steps it took:

    d_i = (x − y_i) / ‖a_i‖₁            (eq. 6: x − y_i = η G_i a_i, the local solver's accumulated gradients)
    x ← x − τ_eff Σ_i p_i d_i,  τ_eff = Σ_i p_i ‖a_i‖₁      (eq. 7, App. B's default τ_eff)

p_i = n_i / Σ_{j∈S} n_j over the round's participants S. ‖a_i‖₁ for the local solver (App. B): plain SGD τ_i;
SGD with momentum ρ, [τ_i − ρ(1 − ρ^τ_i)/(1 − ρ)] / (1 − ρ). With equal τ_i the update is FedAvg's.
Choices the paper leaves open: weight decay is left out of ‖a_i‖₁ (as in the released code the test transcribes);
Adam has no a_i in the paper and counts as plain SGD, ‖a_i‖₁ = τ_i; BN running statistics (bn=True) are not
updates and are averaged by p_i. A client uploads d_i and ‖a_i‖₁ (one float more than FedAvg).
Defaults: optimizer=sgd, momentum=0, lr=0.01 (the paper's local solver is SGD, its plain case without momentum; the
engine's other defaults, weight_decay=1e-4 included).
Global model: the server's x, which every client downloads.

Against the released code transcribed in tests (Xtra-Computing/NIID-Bench @ fa47720d, experiments.py
`train_net_fednova` and the fednova round loop, is_same_initial=1; neither PFLlib nor FL-bench releases FedNova): the
same equations; the release also applies the normalized update to BN running statistics, which here are averaged.
"""

from __future__ import annotations

import torch

from .base import FedAvg, bcast, remember_global, weighted_mean
from .registry import register


@register
class FedNova(FedAvg):
    name = "fednova"
    paper = "Wang et al., Tackling the Objective Inconsistency Problem in Heterogeneous FL, NeurIPS 2020, eq. 6–7"
    uploads = "normalized update (x − y_i)/‖a_i‖₁ (head parameters) + ‖a_i‖₁ (one float)"
    fedavg_server = False  # normalized updates travel (upload, aggregate, download)
    settings = {"optimizer": "sgd", "momentum": 0.0, "lr": 0.01}

    def init_state(self, state, rnd):
        remember_global(state)  # x: state.server["global"]

    def norm(self, rnd) -> torch.Tensor:
        """‖a_i‖₁ [H, C] of every model's local solver over the τ_i steps it took this round."""
        tau = (self.local_epochs() * rnd.client_steps).to(torch.float64)[None]  # [1, C]
        if self.cfg["optimizer"] != "sgd":
            return tau.expand(rnd.H, -1).float()  # [H, C]
        rho = rnd.hp["momentum"].to(torch.float64)[:, None]  # [H, 1]
        return ((tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)).float()  # [H, C]

    def upload(self, state, rnd):
        x, norm = state.server["global"], self.norm(rnd)  # norm [H, C]
        d = {f"d:{k}": (rnd.expand(x[k]) - state.params[k]) / bcast(norm, x[k][:, None]) for k in x}  # [H, C, ...]
        stats = {k: v for k, v in state.buffers.items() if self.shared(k)}  # BN running statistics (bn=True)
        return d | stats | {"norm": norm}

    def aggregate(self, uploads, weights, state, rnd):
        x = state.server["global"]
        tau_eff = weighted_mean(uploads["norm"], weights)  # [H] Σ p_i ‖a_i‖₁
        model = {k: x[k] - bcast(tau_eff, x[k]) * weighted_mean(uploads[f"d:{k}"], weights) for k in x}  # [H, ...]
        stats = {k: weighted_mean(uploads[k], weights) for k in state.buffers if k in uploads}  # [H, ...]
        return model | stats

    def download(self, state, server, rnd):
        super().download(state, server, rnd)
        remember_global(state)
