"""MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021, eq. 3–4).

Differs from FedAvg only in the local objective: ℓ = ℓ_sup + μ ℓ_con (eq. 4), with the model-contrastive loss
(eq. 3)

    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) ),

sim = cosine similarity, z / z_glob / z_prev = the projection output of the model being trained, of the round's
global model and of the client's own model after its previous local training (one previous model: the paper's
model buffer size 1). The two frozen models run in inference mode, each with its own BN running statistics (the
global model's as downloaded, the previous model's as its training left them; matters only with bn=True).
τ = 0.5 and μ = 1 (§4.1; the paper tunes μ per data set and reports μ = 5 best on CIFAR-10). Before its first local
training a client's previous model is the initial model; in round 1 that equals the global model, so ℓ_con is the
constant log 2 with zero gradient there (plain FedAvg, as when there is no negative pair yet).
Global model: FedAvg's; MOON reports the global model's test accuracy (§4).

`moon-official` matches the released code (QinbinLi/MOON @ 8fcba3c, main.py: `init_nets`, `train_net_fedcon`
and the moon branch of the round loop) where it differs at partial participation: the pool of previous models is
empty in round 0, so the contrastive logits are the positive alone and ℓ_con = 0 (`moon` reports μ·log 2 there, with
the same zero gradient); from round 1 on every client's previous model is a copy of its own network (`nets`), which
for a client that has not trained yet is its own initial network, drawn for each client apart from the global one
(init_nets), not the global model. Here the clients' own initial heads are the draws that follow the global one
from the configuration's generator (`own_models`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..training.config import Setting
from .base import FedAvg, bcast, masked_ce, masked_mean
from .registry import register


def model_contrast(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau) -> torch.Tensor:
    """Eq. 3 per sample, from projections [N, d]: [N]."""
    pos = F.cosine_similarity(z, z_glob, dim=-1) / tau  # [N]
    neg = F.cosine_similarity(z, z_prev, dim=-1) / tau  # [N]
    return torch.logaddexp(pos, neg) - pos


@register
class Moon(FedAvg):
    name = "moon"
    paper = "Li, He and Song, Model-Contrastive Federated Learning, CVPR 2021, eq. 3–4"
    uploads = "all head parameters"
    settings = {  # §4.1 / released code defaults
        "mu": Setting(1.0, "μ, weight of the model-contrastive loss", lo=0),
        "tau": Setting(0.5, "τ, the contrastive temperature", lo=0, lo_open=True),
    }
    uses_global = True  # the round's global model: ctx["global"], ctx["global_buffers"]
    fedavg_server = False  # each client keeps its own trained model (the previous model) in its state

    def init_state(self, state, rnd):
        super().init_state(state, rnd)
        state.client["prev"] = {k: v.clone() for k, v in state.params.items()}  # [H, C, ...]
        state.client["prev_buffers"] = {k: v.clone() for k, v in state.buffers.items()}  # [H, C, ...]

    def after_local(self, state, rnd):
        # participants' previous model := their model after this round's training, BN statistics included
        for key, now in (("prev", state.params), ("prev_buffers", state.buffers)):
            state.client[key] = {k: torch.where(bcast(rnd.part, v), now[k], v) for k, v in state.client[key].items()}

    def context(self, state, rnd):
        return super().context(state, rnd) | {
            "prev": state.client["prev"],
            "prev_buffers": state.client["prev_buffers"],
        }

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        z_glob, _ = self.embed(ctx["global"], ctx["global_buffers"], x)
        z_prev, _ = self.embed(ctx["prev"], ctx["prev_buffers"], x)
        con = masked_mean(model_contrast(z, z_glob, z_prev, ctx["hp"]["tau"]), mask)
        return masked_ce(self.logits(params, z), y, mask) + ctx["hp"]["mu"] * con, new_buffers


def own_models(algo, cfg, d_in: int, num_classes: int, seed: int, clients: int) -> list:
    """Each client's own initial head (params, buffers): the draws that follow the configuration's global model from
    its generator (the engine's init draws the global one first), so every client's differs from it and from each
    other's."""
    gen = torch.Generator().manual_seed(seed)
    algo.init(cfg, d_in, num_classes, gen)  # the global model's draws
    return [algo.init(cfg, d_in, num_classes, gen) for _ in range(clients)]


@register
class MoonOfficial(Moon):
    name = "moon-official"
    paper = "MOON released code (QinbinLi/MOON, main.py init_nets, train_net_fedcon, the moon round loop)"
    uploads = "all head parameters"

    def init_state(self, state, rnd):
        super().init_state(state, rnd)
        d_in, K = rnd.data.features.shape[-1], rnd.data.num_classes
        own = [own_models(self, self.cfg, d_in, K, int(s), rnd.C) for s in rnd.seeds]  # [H][C] init_nets' parties
        for key, at, like in (("prev", 0, state.params), ("prev_buffers", 1, state.buffers)):
            state.client[key] = {
                k: torch.stack([torch.stack([m[at][k] for m in row]) for row in own]).to(
                    v.device, v.dtype
                )  # [H, C, ...]
                for k, v in like.items()
            }

    def context(self, state, rnd):
        pooled = torch.full((rnd.H, rnd.C), float(rnd.round > 0), device=rnd.device)  # [H, C] a previous model exists
        return super().context(state, rnd) | {"pooled": pooled}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        z_glob, _ = self.embed(ctx["global"], ctx["global_buffers"], x)
        z_prev, _ = self.embed(ctx["prev"], ctx["prev_buffers"], x)
        con = masked_mean(model_contrast(z, z_glob, z_prev, ctx["hp"]["tau"]), mask) * ctx["pooled"]
        return masked_ce(self.logits(params, z), y, mask) + ctx["hp"]["mu"] * con, new_buffers
