"""FedNTD (Lee et al., "Preservation of the Global Knowledge by Not-True Distillation in Federated Learning",
NeurIPS 2022, §4 eq. 5–6).

Differs from FedAvg only in the local objective: ℓ = ℓ_CE(q, y) + β ℓ_NTD (eq. 6), with the not-true distillation
loss (eq. 5), a KL divergence over the classes other than the sample's label y,

    q̃_τ(c) = exp(z_c/τ) / Σ_{c'≠y} exp(z_{c'}/τ)   (c ≠ y; z = logits, the same for the global model's z^g)
    ℓ_NTD = Σ_{c≠y} q̃^g_τ(c) log( q̃^g_τ(c) / q̃_τ(c) ),

averaged over the minibatch; z^g are the logits of the round's global model w^t (frozen, in inference mode: its BN
statistics as downloaded), ctx["global"]. The true class's logit is left out of both softmaxes, so the local model
learns its own data's labels freely while keeping the global model's view of the other classes.
τ = 1 and β = 1 (Lee-Gihun/FedNTD's config/fedntd.json, the paper's setting). ℓ_NTD is scaled by τ², as the
released criterion does (Hinton et al.'s distillation scaling; at τ = 1 the paper's equation exactly).
Global model: FedAvg's, the w^t every client starts the next round from; the server averages by n_k (FedAvg).

`fedntd-official` matches PFLlib's transcription of the release (TsingZ0/PFLlib @ d832e76f,
system/flcore/clients/clientntd.py, servers/serverntd.py), whose server averages the participants uniformly
(serverntd.add_parameters: 1/num_join_clients), not by their sizes. Its BN running statistics (bn=True) are
averaged the same way; PFLlib averages `parameters()` only and keeps the first uploader's buffers.
"""

from __future__ import annotations

import torch

from ..training.config import Setting
from .base import FedAvg, logsumexp, masked_ce, masked_mean, one_hot, weighted_mean
from .registry import register


def not_true_distillation(logits: torch.Tensor, logits_g: torch.Tensor, y: torch.Tensor, tau) -> torch.Tensor:
    """Eq. 5 per sample, τ²-scaled, from the local and global logits [N, K] and labels [N]: [N]."""
    nt = ~one_hot(y, logits.shape[-1])  # [N, K] the not-true classes
    s = (logits / tau).masked_fill(~nt, float("-inf"))  # [N, K]
    s_g = (logits_g.detach() / tau).masked_fill(~nt, float("-inf"))  # [N, K]
    log_q = s - logsumexp(s, keepdim=True)  # [N, K] log q̃_τ, −inf at y
    log_q_g = s_g - logsumexp(s_g, keepdim=True)  # [N, K] log q̃^g_τ
    kl = torch.where(nt, log_q_g.exp() * (log_q_g - log_q), 0.0)  # [N, K]
    return tau**2 * kl.sum(-1)


@register
class FedNTD(FedAvg):
    name = "fedntd"
    paper = "Lee et al., Preservation of the Global Knowledge by Not-True Distillation in FL, NeurIPS 2022, eq. 5–6"
    uploads = "all head parameters"
    settings = {  # Lee-Gihun/FedNTD config/fedntd.json
        "beta": Setting(1.0, "β, weight of the not-true distillation loss", lo=0),
        "tau": Setting(1.0, "τ, the distillation temperature", lo=0, lo_open=True),
    }
    uses_global = True  # the round's global model: ctx["global"], ctx["global_buffers"]

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        z_g, _ = self.embed(ctx["global"], ctx["global_buffers"], x)
        logits = self.logits(params, z)  # [N, K]
        ntd = masked_mean(not_true_distillation(logits, self.logits(ctx["global"], z_g), y, ctx["hp"]["tau"]), mask)
        return masked_ce(logits, y, mask) + ctx["hp"]["beta"] * ntd, new_buffers


@register
class FedNTDOfficial(FedNTD):
    name = "fedntd-official"
    paper = "FedNTD as PFLlib releases it (TsingZ0/PFLlib, clientntd.py, serverntd.py: uniform server mean)"
    uploads = "all head parameters"
    fedavg_server = False  # the server's mean is uniform over the participants (aggregate)

    def aggregate(self, uploads, weights, state, rnd):
        part = rnd.part.to(weights.dtype)  # [H, C] 1 for each participant
        return {k: weighted_mean(v, part) for k, v in uploads.items()}
