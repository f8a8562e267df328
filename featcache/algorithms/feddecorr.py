"""FedDecorr (Shi et al., "Towards Understanding and Mitigating Dimensional Collapse in Heterogeneous Federated
Learning", ICLR 2023, §4).

Differs from FedAvg only in the local loss: ℓ = ℓ_CE + β L_FedDecorr, with

    L_FedDecorr = (1/d²) ||K||²_F,     K = Ẑᵀ Ẑ / N,     Ẑ_{:,j} = (z_{:,j} − mean_j) / sqrt(var_j + ε),

z [N, d] the representations of the minibatch (here the projection output, the input of the classifier), each
dimension z-scored over the batch so that K is its correlation matrix. Global model: FedAvg's.

Choices the paper leaves open:
- mean and variance over the minibatch's rows with 1/N (K_jj = var_j / (var_j + ε) ≈ 1); ε = 1e-8 as the release;
- β = 0.1, the release's `feddecorr_coef` default and run scripts; its β values were tuned on the release's scaling.

`feddecorr-official` is the released loss (bytedance/FedDecorr @ 973e4af2, `loss.py` `FedDecorrLoss`): variances with
1/(N − 1), K' = ẐᵀẐ unnormalised, and the mean of K'² over the d(d − 1) off-diagonal entries divided by N, which is
(N − 1)² d / (N (d − 1)) times the paper's term up to its constant diagonal (so β weighs a batch of 32 about 30 times
more); 0 for a batch of one row.
"""

from __future__ import annotations

import torch

from ..training.config import Setting
from .base import FedAvg, masked_ce
from .registry import register

EPS = 1e-8  # added to each dimension's variance before the z-score (the release's FedDecorrLoss.eps)


def decorrelation(z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The paper's (1/d²) ||K||²_F of one client's minibatch z [N, d] over its valid rows mask [N]."""
    m = mask.to(z.dtype)[:, None]  # [N, 1]
    n = m.sum().clamp(min=1)
    c = (z - (z * m).sum(0) / n) * m  # [N, d] centred, padding rows 0
    zs = c / ((c * c).sum(0) / n + EPS).sqrt()  # [N, d]
    k = zs.mT @ zs / n  # [d, d]
    return k.square().sum() / z.shape[-1] ** 2


def decorrelation_official(z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """FedDecorrLoss as released, on the valid rows mask [N] of z [N, d]: off-diagonal mean of K'² over N."""
    m = mask.to(z.dtype)[:, None]  # [N, 1]
    n = m.sum()
    c = (z - (z * m).sum(0) / n.clamp(min=1)) * m  # [N, d]
    zs = c / ((c * c).sum(0) / (n - 1).clamp(min=1) + EPS).sqrt()  # [N, d] unbiased variance
    k = zs.mT @ zs  # [d, d]
    d = z.shape[-1]
    off = k.square().sum() - k.diagonal().square().sum()
    return torch.where(n > 1, off / (d * (d - 1)) / n.clamp(min=1), 0.0)


@register
class FedDecorr(FedAvg):
    name = "feddecorr"
    paper = "Shi et al., Towards Understanding and Mitigating Dimensional Collapse in Heterogeneous FL, ICLR 2023, §4"
    uploads = "all head parameters"
    settings = {"beta": Setting(0.1, "β, weight of the decorrelation term (the release's default)", lo=0)}

    def decorrelation(self, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return decorrelation(z, mask)

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)  # [B, proj_dim]
        reg = self.decorrelation(z, mask)
        return masked_ce(self.logits(params, z), y, mask) + ctx["hp"]["beta"] * reg, new_buffers


@register
class FedDecorrOfficial(FedDecorr):
    name = "feddecorr-official"
    paper = "FedDecorr released code (bytedance/FedDecorr, loss.py FedDecorrLoss, approach/fedavg.py)"
    uploads = "all head parameters"

    def decorrelation(self, z, mask):
        return decorrelation_official(z, mask)
