"""pFedMe (Dinh, Tran & Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020, Alg. 1).

Objective (eq. 2–3): min_w 1/N Σ_i F_i(w), F_i(w) = min_θ f_i(θ) + λ/2 ||θ − w||², the Moreau envelope of f_i; its
minimiser θ̂_i(w) is client i's personalized model. Differences from FedAvg:
- local step (Alg. 1, client loop): per minibatch D the client approximately solves the personalized problem
  h_i(θ; w, D) = f_i(θ; D) + λ/2 ||θ − w||² with K = `inner_steps` gradient steps θ ← θ − personal_lr ∇_θ h_i from
  θ = w, giving θ̃, then updates its local model w ← w − η λ (w − θ̃), η = the engine's lr. That update is the
  engine's optimizer step on the loss λ/2 ||w − sg(θ̃)||², whose gradient in w is λ (w − θ̃) (θ̃ is computed inside
  the loss with torch.func.grad and detached); with optimizer=sgd, momentum=0, weight_decay=0 it is exactly the
  paper's step, with Adam it is Adam on the same gradient;
- server (Alg. 1, global update): w ← (1 − β) w + β · (1/S) Σ_{i∈S} w_i, uniform over the S participants as in the
  paper (the released code, CharlieDinh/pFedMe `FLAlgorithms/servers/serverbase.py`, weights by sample counts);
  β = 1 gives plain averaging;
- evaluation uses the personalized model θ̃ of the client's last minibatch, as the released code reports
  (`persionalized_model_bar`). θ̃ is held in the client's buffers under "personal.<name>" (returned by the loss like
  BN statistics, so it is per model and kept while a client sits a round out); before a client first trains,
  θ̃ is the initial model.
Global model: the server's w, evaluated as it is (the paper reports both pFedMe's personalized model, PM, and its
global model, GM).
The inner loop starts each minibatch from θ = w (the released code warm-starts from the previous θ̃); each of the K
forward passes updates BN running statistics, as the released code's K train-mode passes do.
Defaults: λ = 15, K = 5, β = 1 (the paper's non-convex MNIST setting, official README "Effect of hyper-parameters")
and personal_lr = 0.01, its Synthetic and CIFAR-10 setting: MNIST's 0.09 (on 784 pixels in [0, 1]) makes the inner
loop diverge on 1,280–3,840-d backbone features.
"""

from __future__ import annotations

import torch
from torch.func import grad

from ..errors import UserError
from ..training.config import Setting
from .registry import register
from .base import FedAvg, proximal, remember_global, weighted_mean

PERSONAL = "personal."  # buffer prefix of the personalized model θ̃


def personal(params: dict, buffers: dict) -> dict:
    """The personalized model θ̃ held in a client's buffers."""
    return {k: buffers[PERSONAL + k] for k in params}


@register
class PFedMe(FedAvg):
    name = "pfedme"
    paper = "Dinh, Tran & Nguyen, Personalized Federated Learning with Moreau Envelopes, NeurIPS 2020, eq. 2–3, Alg. 1"
    uploads = "all head parameters (the local model w; θ̃ stays on the client)"
    fedavg_server = False  # the server moves w by β towards the participants' mean (aggregate)
    clients_hold_global = False  # the clients predict with their personalized θ̃
    # where each default comes from: the module docstring's last paragraph
    settings = {
        "lam": Setting(15.0, "λ, weight of the Moreau envelope's proximal term", lo=0),
        "inner_steps": Setting(5, "K, gradient steps on the personalized problem per minibatch", lo=1),
        "personal_lr": Setting(0.01, "the inner loop's step size", lo=0, lo_open=True),
        "beta": Setting(1.0, "β, the server's update weight (1: plain averaging)", lo=0, lo_open=True),
    }

    def init(self, cfg, d_in, num_classes, gen):
        if cfg["inner_steps"] < 1:
            raise UserError(f"pfedme: inner_steps must be >= 1 (got {cfg['inner_steps']}); the paper uses K = 5")
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        return params, buffers | {PERSONAL + k: v.clone() for k, v in params.items()}

    # -- client -----------------------------------------------------------------------------------------------
    def personalize(self, w: dict, buffers: dict, x, y, mask, ctx) -> tuple[dict, dict]:
        """K gradient steps on h(θ) = f(θ; D) + λ/2 ||θ − w||² from θ = w: (θ̃, BN statistics after the K passes)."""
        lam, lr = ctx["hp"]["lam"], ctx["hp"]["personal_lr"]

        def h(theta, stats):
            f, new = FedAvg.local_loss(self, theta, stats, x, y, mask, ctx)
            return f + lam / 2 * proximal(theta, w), new

        theta, stats, new = w, buffers, {}
        for _ in range(self.cfg["inner_steps"]):
            g, new = grad(h, has_aux=True)(theta, stats)
            theta = {k: theta[k] - lr * g[k] for k in theta}
            stats = stats | new
        return theta, {k: stats[k] for k in new}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        w = {k: v.detach() for k, v in params.items()}  # θ̃ is a constant of the outer loss
        theta, new_buffers = self.personalize(w, buffers, x, y, mask, ctx)
        loss = ctx["hp"]["lam"] / 2 * proximal(params, theta)  # ∇_w = λ (w − θ̃): the local update
        return loss, new_buffers | {PERSONAL + k: v for k, v in theta.items()}

    def predict(self, params, buffers, x, ctx):
        return super().predict(personal(params, buffers), buffers, x, ctx)

    def shared(self, name):
        return not name.startswith(PERSONAL)  # θ̃ (held in buffers) never leaves the client

    # -- server -----------------------------------------------------------------------------------------------
    def init_state(self, state, rnd):
        remember_global(state)

    def aggregate(self, uploads, weights, state, rnd):
        mean = {k: weighted_mean(v, rnd.part.float()) for k, v in uploads.items()}  # (1/S) Σ_{i∈S} w_i
        beta, old = rnd.hp["beta"], state.server["global"]  # [H], name -> [H, ...]
        return {k: torch.lerp(old[k], v, beta.reshape(-1, *[1] * (v.dim() - 1))) for k, v in mean.items()}

    def download(self, state, server, rnd):
        super().download(state, server, rnd)
        remember_global(state)

    def global_model(self, state, rnd):
        shared = {k: v[:, 0] for k, v in state.buffers.items() if self.shared(k)}  # BN statistics travel with w
        return dict(state.server["global"]), shared

    def predict_global(self, params, buffers, x, ctx):
        return FedAvg.predict(self, params, buffers, x, ctx)  # w itself, not a personalized θ̃
