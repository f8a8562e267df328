"""FedProc (Mu et al., "FedProc: Prototypical Contrastive Federated Learning on Non-IID data", 2021;
arXiv:2109.12273; §3.3, eq. 2–5, Alg. 1). Official code: MuXutong/FedProc.

Differences from FedAvg:
- head = projection head (an MLP with one hidden layer, §3.3) + a linear output layer f_c. Adapted to cached
  features: the frozen backbone is the base encoder, so the learnable model is FC(D, D) → ReLU → FC(D, proj_dim)
  giving z (hidden width D as in the official/MOON `l1`), then f_c = FC(proj_dim, K) on z;
- local loss (eq. 2): α·ℓ_gpc + (1 − α)·ℓ_ce with α = 1 − t/T (t = 0-based round, T = rounds), ℓ_gpc (eq. 4) the
  cross-entropy of the cosine similarities of z to the global class prototypes (no temperature in eq. 4: τ = 1);
- clients also upload their local prototypes (eq. 5, class means of z after local training) and class counts; the
  server averages each class over the clients that own it (Alg. 1 line 9; a class a participant lacks is left out of
  its mean, the only reading of 1/m·Σ c_i that is defined) and keeps the last prototype of a class no participant
  owns. The initial prototypes c^0 (Alg. 1 line 2) are those of the initial model, as in the official code.
Variants (alpha_schedule, Table 4): "fixed" (α = 0.5); "two-stage" (first half of the rounds ℓ_gpc only with the
output layer frozen, then ℓ_ce only with the projection head frozen).

`fedproc-official` matches the released code (MuXutong/FedProc train.py, train_net_fedproc): z L2-normalised before
f_c, CE only in round 0, then CE weight min(t/100, 1) and ℓ_gpc weight 1 − min(t/100, 1) (the code's fixed 100
rounds, whatever `rounds` is: after round 100 only CE trains), sample-weighted prototype averaging, and class
centres (c^0 included) from one pass of the reshuffled drop_last training loader (get_global_class_center: ⌊n/B⌋·B
random rows, seeded from the run's seed: `protos.loader_rows`), not all rows.

Global model: the averaged head (projection head + f_c) every client downloads; FedProc reports it on the global
test set (§4, Tables 2–4: "the converged global model").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .heads import mlp, mlp_init
from ..training.config import Setting
from .registry import register
from .base import FedAvg, logsumexp, masked_mean, one_hot
from .protos import empty_global, loader_prototypes, local_prototypes, mean_prototypes, update_global

ALPHA = {  # weight of ℓ_gpc in round t of T (eq. 2; ℓ_ce gets 1 − α)
    "linear": lambda t, T: 1 - t / T,  # eq. 2
    "fixed": lambda t, T: 0.5,  # Table 4 "FedProc (α = 0.5)"
    "two-stage": lambda t, T: float(t < T / 2),  # Table 4 "Two-stage FL" (see trainable)
    "official": lambda t, T: 0.0 if t == 0 else 1 - min(t / 100, 1),  # released code: CE only in round 0, then
    # CE weight round/100 capped at 1 (a fixed 100, whatever the number of rounds)
}


def sample_mean(protos: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean of all samples' z per class (the official code's class centres): [H, C, K, d] -> [H, K, d]."""
    return (counts[..., None] * protos).sum(1) / counts.sum(1).clamp(min=1)[..., None]


AVERAGE = {"clients": mean_prototypes, "samples": sample_mean}


def gpc(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, tau) -> torch.Tensor:
    """Eq. 4 per row: −log exp(sim(z, c_y)) / Σ_k exp(sim(z, c_k)), sim = cosine / τ; protos [K, d] -> [N]."""
    s = F.normalize(z, dim=-1) @ F.normalize(protos, dim=-1).T / tau  # [N, K]
    return logsumexp(s) - (s * one_hot(y, protos.shape[0])).sum(-1)


@register
class FedProc(FedAvg):
    name = "fedproc"
    across_clients = "init_state reads every client's prototypes from state.client rather than through upload"
    paper = "Mu et al., FedProc: Prototypical Contrastive FL on Non-IID data, arXiv:2109.12273, §3.3 eq. 2–5, Alg. 1"
    uploads = "all head parameters + local prototypes [K, proj_dim] + class counts [K]"
    fedavg_server = False  # local prototypes travel with the parameters (after_local, ..., download)
    settings = {
        "bn": None,  # the projection head has no BatchNorm
        "tau": Setting(1.0, "τ, temperature of ℓ_gpc (eq. 4 has none: 1)", lo=0, lo_open=True),
        "alpha_schedule": Setting(
            "linear", "the weight α of ℓ_gpc over the rounds (eq. 2, Table 4)", choices=tuple(ALPHA)
        ),
        "normalize": Setting(False, "L2-normalise z before f_c (official code: True)"),
        "proto_average": Setting(
            "clients", "average prototypes over clients (Alg. 1) or samples (official code)", choices=tuple(AVERAGE)
        ),
    }

    # -- model ------------------------------------------------------------------------------------------------
    def init(self, cfg, d_in, num_classes, gen):
        proj, _ = mlp_init([d_in, d_in, cfg["proj_dim"]], gen, prefix="proj")
        out, _ = mlp_init([cfg["proj_dim"], num_classes], gen, prefix="cls")
        return proj | out, {}

    def embed(self, params, buffers, x, mask=None, train=False):
        z, _ = mlp(params, buffers, x, 2, prefix="proj")  # [N, proj_dim], no ReLU on the output
        return (F.normalize(z, dim=-1) if self.cfg["normalize"] else z), {}

    # -- client -----------------------------------------------------------------------------------------------
    def context(self, state, rnd):
        ctx = super().context(state, rnd)
        alpha = ALPHA[self.cfg["alpha_schedule"]](rnd.round, rnd.rounds)
        ctx["alpha"] = torch.full((rnd.H, rnd.C), alpha, device=rnd.device)  # [H, C]
        ctx["prototypes"] = rnd.expand(state.server["prototypes"])  # [H, C, K, d]
        return ctx

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, _ = self.embed(params, buffers, x)
        ce = F.cross_entropy(self.logits(params, z), y.clamp(min=0), reduction="none")  # [B]
        a = ctx["alpha"]
        return masked_mean(a * gpc(z, y, ctx["prototypes"], ctx["hp"]["tau"]) + (1 - a) * ce, mask), {}

    def trainable(self, name, rnd):
        """Two-stage: the projection head trains in the first half of the rounds, the output layer in the second."""
        if self.cfg["alpha_schedule"] != "two-stage":
            return True
        first_stage = rnd.round < rnd.rounds / 2
        return name.startswith("proj") == first_stage

    # -- prototypes: state.server = {"prototypes": [H, K, d], "has": [H, K]} ----------------------------------------
    def init_state(self, state, rnd):
        self.after_local(state, rnd)  # c^0: the initial model's prototypes (Alg. 1 line 2), from every client
        state.server = update_global(
            state.client["protos"],
            state.client["counts"],
            rnd.part,
            empty_global(rnd, self.cfg["proj_dim"]),
            AVERAGE[self.cfg["proto_average"]],
        )

    def after_local(self, state, rnd):
        state.client["protos"], state.client["counts"] = local_prototypes(self, state, rnd.data)

    def upload(self, state, rnd):
        return super().upload(state, rnd) | {"protos": state.client["protos"], "counts": state.client["counts"]}

    def aggregate(self, uploads, weights, state, rnd):
        params = super().aggregate({k: uploads[k] for k in state.params}, weights, state, rnd)
        protos = update_global(
            uploads["protos"], uploads["counts"], rnd.part, state.server, AVERAGE[self.cfg["proto_average"]]
        )
        return {"params": params, "protos": protos}

    def download(self, state, server, rnd):
        super().download(state, server["params"], rnd)
        state.server = server["protos"]


@register
class FedProcOfficial(FedProc):
    name = "fedproc-official"
    paper = "FedProc released code (MuXutong/FedProc, train.py train_net_fedproc, get_global_class_center)"
    settings = {"normalize": True, "alpha_schedule": "official", "proto_average": "samples"}

    def after_local(self, state, rnd):
        state.client["protos"], state.client["counts"] = loader_prototypes(self, state, rnd)
