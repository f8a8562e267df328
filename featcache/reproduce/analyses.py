"""Paper analyses of a trained state, beyond a run's accuracies: what the `probe` and `protosim` pipeline metrics
(reproduce/metrics.py) compute right after training.

probe_match: FedPFT Table 1 (Wu et al., ICLR 2025 submission, App. A, Fig. 6): Origin / Probe / Match accuracy.
backbone_similarity: FedPCL Figure 3 (Tan et al., NeurIPS 2022, §5.5): how much each backbone shapes the fused
prototypes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..algorithms.base import masked_ce
from ..algorithms.protos import local_prototypes
from ..algorithms.heads import linear
from ..training.hparams import HParams
from ..training.models import map_models
from ..training.optim import Adam

Params = dict[str, torch.Tensor]


# -- FedPFT Table 1: Origin / Probe / Match accuracy (App. A, Fig. 6) -----------------------------------------------
def probe_match(algo, state, train, test, steps: int = 200, lr: float = 1e-2) -> dict[str, torch.Tensor]:
    """Per-model accuracies [H, C] on each client's test data, for algorithms that predict logits(embed(x)):

    origin: the trained model as it is (Fig. 6a);
    probe:  a fresh linear classifier (zero init) trained on the client's train data on top of the classifier's
            input features (Fig. 6b; for FedPFT that is f' = τ([ϕ(x), p_κ]), as Table 6's 'p_κ' row);
    match:  the model's own classifier, frozen, behind a linear layer (identity init) trained on the client's train
            data (Fig. 6c). Both are fitted full-batch with Adam (`steps`, `lr`: the paper gives neither).
    """
    embed = lambda p, b, x: algo.embed(p, b, x)[0]
    z_train = map_models(embed, (state.params, state.buffers), (train.features,))  # [H, C, N, m]
    z_test = map_models(embed, (state.params, state.buffers), (test.features,))  # [H, C, N', m]
    H, C, _, m = z_train.shape
    K = train.num_classes
    eye = torch.eye(m, device=z_train.device)
    heads = {
        "probe": (
            {"w.weight": torch.zeros(H, C, K, m), "w.bias": torch.zeros(H, C, K)},
            lambda w, p, z: linear(w, "w", z),
        ),
        "match": (
            {"w.weight": eye.expand(H, C, m, m).clone(), "w.bias": torch.zeros(H, C, m)},
            lambda w, p, z: algo.logits(p, linear(w, "w", z)),
        ),
    }
    out = {"origin": _accuracy(map_models(algo.logits, (state.params, z_test)), test)}
    for kind, (w, head) in heads.items():
        w = {k: v.to(z_train) for k, v in w.items()}
        w = _fit(
            w, lambda w_, p, z, y, mask: masked_ce(head(w_, p, z), y, mask), state.params, z_train, train, steps, lr
        )
        out[kind] = _accuracy(map_models(head, (w, state.params, z_test)), test)
    return out


def _fit(w: Params, loss, params: Params, z: torch.Tensor, data, steps: int, lr: float) -> Params:
    """Full-batch Adam on `w` (leaves [H, C, ...]), every model on its own client's rows."""
    H, C = z.shape[:2]
    opt = Adam(w, HParams.of({"lr": torch.full((H,), lr), "weight_decay": torch.zeros(H)}, z.device))
    active = torch.ones(H, C, dtype=torch.bool, device=z.device)
    for _ in range(steps):
        leaves = {k: v.detach().requires_grad_(True) for k, v in w.items()}
        total = map_models(loss, (leaves, params, z), (data.labels, data.mask)).sum()
        grads = dict(zip(leaves, torch.autograd.grad(total, list(leaves.values()))))
        with torch.no_grad():
            w = opt.step(grads, active)
    return w


def _accuracy(scores: torch.Tensor, data) -> torch.Tensor:
    """scores [H, C, N, K] -> accuracy [H, C] over each client's valid rows."""
    hit = (scores.argmax(-1) == data.labels) & data.mask  # [H, C, N]
    return hit.sum(-1) / data.counts.clamp(min=1)


# -- FedPCL Figure 3: how much each backbone shapes the fused prototypes --------------------------------------------
@torch.no_grad()
def backbone_similarity(algo, state, data, dims: list[int]) -> torch.Tensor:
    """FedPCL Figure 3 (Tan et al., NeurIPS 2022, §5.5) on one trained all-backbone model: per backbone k, each
    client's prototypes computed from backbone k's feature columns alone (the others zeroed; `dims` = the backbones'
    widths in concat order) against its fused prototypes: cosine, mean over the classes it holds. -> [H, C, B]."""
    fused, counts = local_prototypes(algo, state, data)  # [H, C, K, d], [H, C, K]
    held = (counts > 0).float()  # [H, C, K]
    edges = [0, *torch.tensor(dims).cumsum(0).tolist()]
    sims = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        keep = torch.zeros(data.features.shape[-1], device=data.features.device)  # [D]
        keep[lo:hi] = 1
        only_k = dataclasses.replace(data, features=data.features * keep)  # [C, N, D], other backbones zeroed
        alone, _ = local_prototypes(algo, state, only_k)  # [H, C, K, d]
        cos = F.cosine_similarity(alone, fused, dim=-1)  # [H, C, K]
        sims.append((cos * held).sum(-1) / held.sum(-1).clamp(min=1))  # [H, C]
    return torch.stack(sims, -1)  # [H, C, B]
