"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020,
Alg. 1 and eq. 4, option II).

Differences from FedAvg:
- local step y ← y − η (g(y) + c − c_i) (Alg. 1 line 10): the engine's optimizer steps on the loss gradient g,
  then the per-step hook `after_step` applies the correction y ← y − η (c − c_i) to the models that stepped;
- after local training, option II: c_i⁺ = c_i − c + (x − y_i) / (K η) (line 12), K = the local steps that client
  took this round, η = the local learning rate;
- a client uploads Δy_i = y_i − x and Δc_i = c_i⁺ − c_i (line 13): twice the head's parameters;
- the server averages uniformly over the participants S (line 16) and applies global learning rate 1:
  x ← x + mean Δy_i, c ← c + |S|/N · mean Δc_i (line 17); N = all clients. c and every c_i start at zero.
  BN running statistics (bn=True) are not parameters: they travel and are averaged over S as they are.
Global model: the server's x, which every client downloads.

Every optimizer: the local step is y ← y − η (d(y) + c − c_i), d = the optimizer's direction for the loss gradient
(d = g with optimizer=sgd, momentum=0, weight_decay=0: Alg. 1 line 10 exactly). Option II then gives
c_i⁺ = c_i − c + (x − y_i)/(K η) = the mean of d over the client's K steps, the same quantity the correction
subtracts, so the control variates stay consistent under SGD with momentum and under Adam (FedPCL's protocol).
Defaults: optimizer=sgd, momentum=0, lr=0.01 (the engine's other defaults, weight_decay=1e-4 included; the rate is
explained beside `settings`). The correction is applied after the optimizer's step rather than added to the gradient,
where Adam would rescale it and momentum smear it over later steps.
"""

from __future__ import annotations

import torch

from .registry import register
from .base import FedAvg, bcast, remember_global, weighted_mean


@register
class Scaffold(FedAvg):
    name = "scaffold"
    paper = "Karimireddy et al., SCAFFOLD, ICML 2020, Alg. 1 with option II (eq. 4)"
    uploads = "model delta y_i − x + control delta c_i⁺ − c_i (2 × head parameters)"
    fedavg_server = False  # model and control deltas travel (upload, aggregate, download)
    # Plain SGD by default (Alg. 1 line 10 is an SGD step; weight decay only adds to the gradient) at lr 0.01 (the
    # engine's 1e-3 is Adam's; 0.1 is unstable on the demo cache). Adam or momentum: --set optimizer=... --set
    # momentum=...
    settings = {"optimizer": "sgd", "momentum": 0.0, "lr": 0.01}

    def init_state(self, state, rnd):
        remember_global(state)  # x: state.server["global"]
        state.server["control"] = {k: torch.zeros_like(v) for k, v in state.server["global"].items()}  # c [H, ...]
        state.client["control"] = {k: torch.zeros_like(v) for k, v in state.params.items()}  # c_i [H, C, ...]

    def context(self, state, rnd):
        c, c_i = state.server["control"], state.client["control"]
        correction = {k: rnd.expand(c[k]) - c_i[k] for k in c}  # c − c_i [H, C, ...]
        return super().context(state, rnd) | {"correction": correction}

    def after_step(self, params, ctx, active, rnd):
        """Alg. 1 line 10's correction after the optimizer's step: y ← y − η (c − c_i) for the models that stepped."""
        eta = rnd.hp["lr"][:, None] * active  # [H, C], 0 where a model sat the step out
        for k, corr in ctx["correction"].items():  # [H, C, ...]
            params[k].addcmul_(bcast(eta, corr), corr, value=-1)

    # -- control variates -------------------------------------------------------------------------------------
    def deltas(self, state, rnd) -> tuple[dict, dict]:
        """(Δy_i, Δc_i) of every model: Δc_i = c_i⁺ − c_i = −c + (x − y_i) / (K η) (option II), K = the local steps
        the client took (rnd.client_steps per epoch)."""
        x, c = state.server["global"], state.server["control"]
        K = self.local_epochs() * rnd.client_steps  # [C]
        K_eta = K.clamp(min=1)[None] * rnd.hp["lr"][:, None]  # [H, C]
        dy = {k: state.params[k] - rnd.expand(x[k]) for k in x}  # [H, C, ...]
        dc = {k: -rnd.expand(c[k]) - dy[k] / bcast(K_eta, dy[k]) for k in x}  # [H, C, ...]
        return dy, dc

    # -- server -----------------------------------------------------------------------------------------------
    def upload(self, state, rnd):
        dy, dc = self.deltas(state, rnd)
        stats = {k: v for k, v in state.buffers.items() if self.shared(k)}  # BN running statistics (bn=True)
        return {f"dy:{k}": v for k, v in dy.items()} | {f"dc:{k}": v for k, v in dc.items()} | stats

    def aggregate(self, uploads, weights, state, rnd):
        part = rnd.part.float()  # [H, C] uniform over S (line 16)
        frac = part.sum(1) / rnd.C  # [H] |S| / N
        x, c = state.server["global"], state.server["control"]
        model = {k: x[k] + weighted_mean(uploads[f"dy:{k}"], part) for k in x}  # [H, ...]
        control = {k: c[k] + bcast(frac, c[k]) * weighted_mean(uploads[f"dc:{k}"], part) for k in c}  # [H, ...]
        stats = {k: weighted_mean(uploads[k], part) for k in state.buffers if k in uploads}  # [H, ...]
        return {"model": model | stats, "control": control}

    def download(self, state, server, rnd):
        _, dc = self.deltas(state, rnd)  # before the new model overwrites y_i
        c_i = state.client["control"]
        state.client["control"] = {k: torch.where(bcast(rnd.part, v), v + dc[k], v) for k, v in c_i.items()}
        super().download(state, server["model"], rnd)
        state.server["control"] = server["control"]
        remember_global(state)
