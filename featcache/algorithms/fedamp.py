"""FedAMP / HeurFedAMP (Huang et al., "Personalized Cross-Silo Federated Learning on Non-IID Data", AAAI 2021,
arXiv:2007.03797): federated attentive message passing.

Objective: min_W Σ_i F_i(w_i) + λ Σ_{i<j} A(||w_i − w_j||²), every client keeps its own model w_i. Each round:
- server (message passing, U = W − α_k ∇A(W)): for every client a personalized cloud model
  u_i = Σ_j ξ_ij w_j (ξ_i1 + … + ξ_im = 1) from all clients' latest uploads;
    attention="cosine" (HeurFedAMP, the paper's heuristic for deep networks, default):
        ξ_ij = (1 − ξ_ii) · exp(σ cos(w_i, w_j)) / Σ_{h≠i} exp(σ cos(w_i, w_h)) for j ≠ i, ξ_ii = `self_attention`;
    attention="distance" (FedAMP with A(x) = 1 − exp(−x/σ), so A'(x) = exp(−x/σ)/σ):
        ξ_ij = α_k A'(||w_i − w_j||²) for j ≠ i, ξ_ii = 1 − Σ_{j≠i} ξ_ij (as the paper writes it, the factor 2 of
        ∇A absorbed into α_k);
- client: w_i = argmin_w F_i(w) + λ/(2α_k) ||w − u_i||², approximated by the engine's local epochs from the client's
  current w_i; the loss is CE + λ/(2α_k) ||w − u_i||² over every parameter.
Nothing else differs from FedAvg except that w_i is never overwritten: it is the personalized model each client is
evaluated with, and what it uploads. The server keeps every client's latest upload; clients that sit a round out
still enter the attention with their last model (the initial model before their first round), and every client gets
a fresh u_i each round (the paper's cross-silo setting has all clients take part). α_k is constant over rounds.
Defaults λ = α_k = σ = 1 follow PFLlib's FedAMP (TsingZ0/PFLlib `system/main.py`, `flcore/servers/serveramp.py`,
which implements the distance attention only); ξ_ii = 0.5 (equal weight to the own model and the attended others) is
our choice, fixed by no released code: tune it.
Global model: none. The server holds one personalized cloud model u_i per client and no shared model; the paper
evaluates the personalized models only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..training.config import Setting
from .registry import register
from .base import FedAvg, proximal


def cosine_attention(flat: torch.Tensor, hp: dict) -> torch.Tensor:
    """HeurFedAMP's ξ [H, C, C] from flattened models [H, C, P]; rows sum to 1."""
    H, C, _ = flat.shape
    if C == 1:
        return torch.ones(H, 1, 1, dtype=flat.dtype, device=flat.device)  # no one else to attend to: u = w
    unit = F.normalize(flat, dim=-1)
    logits = hp["sigma"][:, None, None] * unit @ unit.transpose(1, 2)  # [H, C, C] σ cos(w_i, w_j)
    eye = torch.eye(C, dtype=torch.bool, device=flat.device)
    others = logits.masked_fill(eye, float("-inf")).softmax(-1)  # [H, C, C] over h ≠ i
    self_w = hp["self_attention"][:, None, None]  # [H, 1, 1]
    return torch.where(eye, self_w, (1 - self_w) * others)


def distance_attention(flat: torch.Tensor, hp: dict) -> torch.Tensor:
    """FedAMP's ξ [H, C, C] from flattened models [H, C, P] with A(x) = 1 − exp(−x/σ); rows sum to 1."""
    sigma, alpha = hp["sigma"][:, None, None], hp["alpha_k"][:, None, None]  # [H, 1, 1]
    d2 = torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist") ** 2  # [H, C, C] ||w_i − w_j||²
    eye = torch.eye(flat.shape[1], dtype=torch.bool, device=flat.device)
    xi = (alpha * torch.exp(-d2 / sigma) / sigma).masked_fill(eye, 0)  # α_k A'(·), j ≠ i
    return xi + torch.diag_embed(1 - xi.sum(-1))


ATTENTION = {"cosine": cosine_attention, "distance": distance_attention}


@register
class FedAMP(FedAvg):
    name = "fedamp"
    across_clients = "aggregate returns one model per client [H, C, ...] that download indexes by client"
    paper = "Huang et al., Personalized Cross-Silo Federated Learning on Non-IID Data, AAAI 2021 (HeurFedAMP default)"
    uploads = "all head parameters (the personalized model w_i)"
    personal_predict = True  # w_i changes only in its own local training; the cloud models only steer it
    fedavg_server = False  # each client downloads its own attention-weighted cloud model u_i (aggregate, download)
    clients_hold_global = False  # the clients hold personalized models
    # λ, α_k, σ: PFLlib's FedAMP defaults; ξ_ii: our choice (see the module docstring)
    settings = {
        "attention": Setting(
            "cosine", "HeurFedAMP's cosine attention or FedAMP's distance attention", choices=tuple(ATTENTION)
        ),
        "lam": Setting(1.0, "λ, weight of the attentive proximal term", lo=0),
        "alpha_k": Setting(1.0, "α_k, the server's message-passing step", lo=0, lo_open=True),
        "sigma": Setting(1.0, "σ, the attention's scale", lo=0, lo_open=True),
        "self_attention": Setting(0.5, "ξ_ii, the weight of a client's own model in its cloud model", lo=0, hi=1),
    }

    def init_state(self, state, rnd):
        state.client["cloud"] = {k: v.clone() for k, v in state.params.items()}  # u_i before round 1 = w_i

    def context(self, state, rnd):
        return super().context(state, rnd) | {"cloud": state.client["cloud"]}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        ce, new_buffers = super().local_loss(params, buffers, x, y, mask, ctx)
        hp = ctx["hp"]
        return ce + hp["lam"] / (2 * hp["alpha_k"]) * proximal(params, ctx["cloud"]), new_buffers

    def aggregate(self, uploads, weights, state, rnd):
        """Personalized cloud models u_i = Σ_j ξ_ij w_j for every client: name -> [H, C, ...]."""
        flat = torch.cat([v.flatten(2) for v in uploads.values()], -1)  # [H, C, P]
        xi = ATTENTION[self.cfg["attention"]](flat, rnd.hp)  # [H, C, C]
        return {k: torch.einsum("hij,hj...->hi...", xi, v) for k, v in uploads.items()}

    def download(self, state, server, rnd):
        state.client["cloud"] = server

    def global_model(self, state, rnd):
        return None  # every client keeps its own w_i; the server's u_i are per client (see the module docstring)
