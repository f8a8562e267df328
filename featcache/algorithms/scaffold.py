"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020,
Alg. 1 and eq. 4, option II).

Differences from FedAvg:
- local step y ← y − η (g(y) + c − c_i) (Alg. 1 line 10): the correction is the gradient of the extra loss term
  <y, c − c_i>, so the engine's optimizer applies it;
- after local training, option II: c_i⁺ = c_i − c + (x − y_i) / (K η) (line 12), K = the local steps that client
  took this round, η = the local learning rate;
- a client uploads Δy_i = y_i − x and Δc_i = c_i⁺ − c_i (line 13): twice the head's parameters;
- the server averages uniformly over the participants S (line 16) and applies global learning rate 1:
  x ← x + mean Δy_i, c ← c + |S|/N · mean Δc_i (line 17); N = all clients. c and every c_i start at zero.
  BN running statistics (bn=True) are not parameters: they travel and are averaged over S as they are.

Option II assumes plain SGD local steps, as in the paper: then (x − y_i)/(K η) is the client's mean corrected
gradient and c_i⁺ its mean gradient. With momentum or Adam (the engine's default, FedPCL's protocol) it measures the
optimizer's mean step instead and the correction is mis-scaled (on the synthetic test data SCAFFOLD with Adam learns
clearly slower than FedAvg); run `--set optimizer=sgd --set momentum=0.0` for the paper's algorithm.
"""

from __future__ import annotations

import torch

from ..engine import expand_hc
from . import register
from .base import FedAvg, weighted_mean
from .fedprox import remember_global


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast [H] or [H, C] against [H, ...] or [H, C, ...]."""
    return t.reshape(*t.shape, *[1] * (like.dim() - t.dim()))


@register
class Scaffold(FedAvg):
    name = "scaffold"
    paper = "Karimireddy et al., SCAFFOLD, ICML 2020, Alg. 1 with option II (eq. 4)"
    uploads = "model delta y_i − x + control delta c_i⁺ − c_i (2 × head parameters)"

    def init_state(self, state, engine):
        remember_global(state)
        state.server["control"] = {k: torch.zeros_like(v) for k, v in state.server["global"].items()}  # c [H, ...]
        state.client["control"] = {k: torch.zeros_like(v) for k, v in state.params.items()}  # c_i [H, C, ...]

    def context(self, state, engine):
        c, c_i = state.server["control"], state.client["control"]
        correction = {k: expand_hc(c[k], engine.C) - c_i[k] for k in c}  # c − c_i [H, C, ...]
        return super().context(state, engine) | {"correction": correction}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        ce, new_buffers = super().local_loss(params, buffers, x, y, mask, ctx)
        drift = sum((params[k] * ctx["correction"][k]).sum() for k in params)  # gradient: c − c_i
        return ce + drift, new_buffers

    # -- control variates -------------------------------------------------------------------------------------
    def local_steps(self, engine) -> torch.Tensor:
        """K per client [C]: minibatches per epoch (as the engine draws them) times local epochs."""
        B, counts = self.cfg["batch_size"], engine.train.counts
        n_eff = counts // B * B if self.cfg["drop_last"] else counts  # [C]
        return self.local_epochs() * ((n_eff + B - 1) // B)

    def deltas(self, state, engine) -> tuple[dict, dict]:
        """(Δy_i, Δc_i) of every model: Δc_i = c_i⁺ − c_i = −c + (x − y_i) / (K η) (option II)."""
        x, c = state.server["global"], state.server["control"]
        K_eta = self.local_steps(engine).clamp(min=1)[None] * state.hp["lr"][:, None]  # [H, C]
        dy = {k: state.params[k] - expand_hc(x[k], engine.C) for k in x}  # [H, C, ...]
        dc = {k: -expand_hc(c[k], engine.C) - dy[k] / _bcast(K_eta, dy[k]) for k in x}  # [H, C, ...]
        return dy, dc

    # -- server -----------------------------------------------------------------------------------------------
    def upload(self, state, engine):
        dy, dc = self.deltas(state, engine)
        stats = {k: v for k, v in state.buffers.items() if self.shared(k)}  # BN running statistics (bn=True)
        return {f"dy:{k}": v for k, v in dy.items()} | {f"dc:{k}": v for k, v in dc.items()} | stats

    def aggregate(self, uploads, weights, state, engine):
        part = (weights > 0).float()  # [H, C] uniform over S (line 16)
        frac = part.sum(1) / engine.C  # [H] |S| / N
        x, c = state.server["global"], state.server["control"]
        model = {k: x[k] + weighted_mean(uploads[f"dy:{k}"], part) for k in x}  # [H, ...]
        control = {k: c[k] + _bcast(frac, c[k]) * weighted_mean(uploads[f"dc:{k}"], part) for k in c}  # [H, ...]
        stats = {k: weighted_mean(uploads[k], part) for k in state.buffers if k in uploads}  # [H, ...]
        return {"model": model | stats, "control": control}

    def download(self, state, server, part, engine):
        _, dc = self.deltas(state, engine)  # before the new model overwrites y_i
        c_i = state.client["control"]
        state.client["control"] = {k: torch.where(_bcast(part, v), v + dc[k], v) for k, v in c_i.items()}
        super().download(state, server["model"], part, engine)
        state.server["control"] = server["control"]
        remember_global(state)
