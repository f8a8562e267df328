"""FedCAC (Wu et al., "Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through
Cautiously Aggressive Collaboration", ICCV 2023): parameter-wise critical-parameter selection.

Differences from FedAvg:
- after local training each client scores every parameter's sensitivity to its non-IID data,
  s = |(θ^{t,E} − θ^{t,0}) ⊙ θ^{t,E}| (the change of local training times the trained value), and marks the top
  `tau` fraction of each parameter tensor (layer) as critical (mask m_i, 1 = critical); a layer whose threshold is
  ~0 (≤ 1e-10) takes its smallest non-zero score instead, as the released code does. It uploads its model and m_i;
- server: the overlap of clients i and j is 1 − ||m_i − m_j||₁ / (2 ||m_i||₁); the threshold is
  avg + (t+1)/β·(max − avg) over the round's participant pairs (t = 0-based round): it grows with the rounds, so
  critical parameters collaborate less and less (from round β on, with no one);
  client i's customized model is the uniform mean of its own model and those of the participants j whose overlap
  with i reaches the threshold; the global model is FedAvg's n_k / n mean of the participants, BN statistics included;
- download: θ_i = m_i ⊙ customized_i + (1 − m_i) ⊙ global (critical parameters from the collaborators, the rest
  from everyone), parameters only: with bn=True each client keeps its own BN running statistics, as the released
  group's `sync` does (the paper is silent). Each client is evaluated with θ_i as trained (its own model after local
  training is what it uploads; after download it holds the mixed model).
Choices on cached features (the paper leaves them to the network): the "layers" are the head's parameter tensors
(proj0.weight, proj0.bias, [proj0.bn.weight, proj0.bn.bias,] cls0.weight, cls0.bias).
Partial participation is our choice: the released code (FLAIR-Community/Fling) aggregates every client every round
and fails on a client that has not trained yet; here overlap average/max are taken over the participating pairs,
and a client that has not trained yet has no critical parameters (m = 0: it takes the global model whole).
Defaults τ = 0.5, β = 100 are Fling's CIFAR-10 values (flzoo/cifar10/cifar10_fedcac_resnet_config.py), the dataset
the offline pipelines stand in for; its CIFAR-100 values τ = 0.4, β = 170 (flzoo/cifar100/
cifar100_fedcac_resnet_config.py) are set by pipelines/fedpft-table2.toml.
Global model: the FedAvg mean of the participants the server computes every round (kept in state.server["global"]),
the model the non-critical parameters come from.
"""

from __future__ import annotations

import torch

from ..training.config import Setting
from .registry import register
from .base import FedAvg, bcast

CRIT = "critical."  # upload prefix of the critical-parameter masks


def critical_mask(new: torch.Tensor, old: torch.Tensor, tau: float) -> torch.Tensor:
    """m [H, C, ...]: the top-τ fraction of |(new − old) ⊙ new| within each model's tensor (1 = critical)."""
    score = ((new - old) * new).abs().flatten(2)  # [H, C, P]
    k = int(tau * score.shape[-1])
    if k == 0:
        return torch.zeros_like(new)
    thresh = score.topk(k, dim=-1).values[..., -1:]  # [H, C, 1] the k-th largest score
    nonzero = score.masked_fill(score <= 1e-20, float("inf")).amin(-1, keepdim=True)  # smallest non-zero score
    thresh = torch.where((thresh <= 1e-10) & torch.isfinite(nonzero), nonzero, thresh)
    return (score >= thresh).to(new.dtype).reshape(new.shape)


def overlap(masks: torch.Tensor) -> torch.Tensor:
    """1 − ||m_i − m_j||₁ / (2 ||m_i||₁) for flattened masks [H, C, P] -> [H, C, C]."""
    diff = (masks[:, :, None] - masks[:, None]).abs().sum(-1)  # [H, C, C]
    return 1 - diff / (2 * masks.sum(-1, keepdim=True)).clamp(min=1e-12)


def collaborators(ov: torch.Tensor, part: torch.Tensor, t: int, beta: torch.Tensor) -> torch.Tensor:
    """[H, C, C] bool: j collaborates with i (i itself always) when overlap ≥ threshold; ov [H, C, C], part [H, C]."""
    C = ov.shape[-1]
    eye = torch.eye(C, dtype=torch.bool, device=ov.device)
    pairs = part[:, :, None] & part[:, None, :] & ~eye  # [H, C, C]
    n = pairs.sum((1, 2)).clamp(min=1)  # [H]
    avg = (ov * pairs).sum((1, 2)) / n  # [H]
    mx = ov.masked_fill(~pairs, float("-inf")).amax((1, 2))  # [H]
    thresh = avg + (t + 1) / beta * (mx - avg)  # [H]
    return (pairs & (ov >= thresh[:, None, None])) | eye


@register
class FedCAC(FedAvg):
    name = "fedcac"
    across_clients = "aggregate returns one model per client [H, C, ...] that download indexes by client"
    paper = (
        "Wu et al., Bold but Cautious: Unlocking the Potential of Personalized FL through Cautiously Aggressive "
        "Collaboration, ICCV 2023"
    )
    uploads = "all head parameters + their critical-parameter masks"
    fedavg_server = False  # masks travel and each client mixes its own model (after_local, ..., download)
    clients_hold_global = False  # the clients hold mixed models; the server's mean is the global one
    settings = {  # defaults: Fling's CIFAR-10 config (see the module docstring)
        "tau": Setting(
            0.5,
            "the fraction of each layer's parameters a client marks critical (Fling: 0.5 on "
            "CIFAR-10, 0.4 on CIFAR-100)",
            lo=0,
            hi=1,
            batched=False,
        ),  # the number of critical parameters per layer is a shape
        "beta": Setting(
            100.0,
            "β: from round β on, critical parameters collaborate with no one (Fling: 100 on "
            "CIFAR-10, 170 on CIFAR-100)",
            lo=0,
            lo_open=True,
        ),
    }
    limitation = "critical parameters are chosen per head tensor (the head's layers)"

    def init_state(self, state, rnd):
        state.client["start"] = {k: v.clone() for k, v in state.params.items()}  # θ^{t,0}
        state.client["critical"] = {k: torch.zeros_like(v) for k, v in state.params.items()}  # m = 0: none yet

    def after_local(self, state, rnd):
        part = rnd.part
        for k, v in state.params.items():
            new = critical_mask(v, state.client["start"][k], self.cfg["tau"])
            state.client["critical"][k] = torch.where(bcast(part, v), new, state.client["critical"][k])

    def upload(self, state, rnd):
        return super().upload(state, rnd) | {CRIT + k: m for k, m in state.client["critical"].items()}

    def aggregate(self, uploads, weights, state, rnd):
        models = {k: v for k, v in uploads.items() if not k.startswith(CRIT)}
        glob = super().aggregate(models, weights, state, rnd)  # name -> [H, ...]
        masks = torch.cat([uploads[CRIT + k].flatten(2) for k in state.params], -1)  # [H, C, P]
        collab = collaborators(overlap(masks), rnd.part, rnd.round, rnd.hp["beta"]).to(masks.dtype)  # [H, C, C]
        collab = collab / collab.sum(-1, keepdim=True)  # uniform mean over the collaborators
        custom = {k: torch.einsum("hij,hj...->hi...", collab, models[k]) for k in state.params}  # [H, C, ...]
        return {"global": glob, "custom": custom}

    def download(self, state, server, rnd):
        glob, custom = server["global"], server["custom"]
        state.server["global"] = glob  # name -> [H, ...]: the global model (global_model)
        for k in state.params:  # parameters only: BN running statistics stay the client's own
            m = state.client["critical"][k]  # [H, C, ...]
            state.params[k] = m * custom[k] + (1 - m) * rnd.expand(glob[k])
        state.client["start"] = {k: v.clone() for k, v in state.params.items()}

    def global_model(self, state, rnd):
        glob = state.server["global"]  # clients hold mixed models; the server's mean is the global one
        return {k: glob[k] for k in state.params}, {k: glob[k] for k in state.buffers}
