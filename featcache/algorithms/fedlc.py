"""FedLC (Zhang et al., "Federated Learning with Label Distribution Skew via Logits Calibration", ICML 2022).

Differs from FedAvg only in the local loss: client c subtracts a per-class offset from every logit before the
softmax cross-entropy,

    s_j = f_j(x) − τ · n_{c,j}^{−1/4},        ℓ_LC = −log( e^{s_y} / Σ_j e^{s_j} ),

n_{c,j} = the client's training rows of class j, so a rare class is pushed down less. Inference uses the raw logits
f(x); the server is FedAvg's. Global model: FedAvg's.

Choices the paper leaves open or that its released reproductions settle otherwise:
- the paper's equation sums the denominator over j ≠ y only; that loss is unbounded below (FL-bench's note on
  `src/server/fedlc.py` and its issue #5: training collapses), and every released version (FL-bench, PFLlib,
  bytedance/FedDecorr's `fedlogitcal`) keeps the target in it: so does `denominator=all` (default);
  `denominator=others` is the equation as printed;
- a class the client lacks counts 1e-8 (FL-bench's `counter.get(i, 1e-8)`): its offset is 100 τ;
- n_{c,j} are the client's own counts (FL-bench; PFLlib uses the counts summed over all clients);
- τ = 1 (FL-bench's default; bytedance/FedDecorr's run scripts use 0.1): tune it per data set.
"""

from __future__ import annotations

import torch

from ..training.config import Setting
from .base import FedAvg, keep_class_counts, logsumexp, masked_ce, masked_mean, one_hot
from .registry import register

ABSENT = 1e-8  # the count of a class the client lacks (FL-bench)


def calibrated(logits: torch.Tensor, counts: torch.Tensor, tau) -> torch.Tensor:
    """s = f − τ n^{−1/4}: logits [N, K] calibrated by one client's class counts [K]."""
    return logits - tau * counts.clamp(min=ABSENT).pow(-0.25)  # [N, K]


def others_loss(s: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The equation as printed: mean over valid rows of −s_y + log Σ_{j≠y} e^{s_j}, s [N, K]."""
    hit = one_hot(y, s.shape[-1])  # [N, K]
    rest = logsumexp(s.masked_fill(hit, float("-inf")))  # [N]
    return masked_mean(rest - (s * hit).sum(-1), mask)


@register
class FedLC(FedAvg):
    name = "fedlc"
    paper = "Zhang et al., Federated Learning with Label Distribution Skew via Logits Calibration, ICML 2022"
    uploads = "all head parameters"
    settings = {
        "tau": Setting(1.0, "τ, the calibration strength (FL-bench's default; tune per data set)", lo=0),
        "denominator": Setting(
            "all",
            "the softmax denominator over all classes (every release) or over j ≠ y (the paper's equation: unbounded)",
            choices=("all", "others"),
        ),
    }
    objective = (
        "unbounded below: the paper's equation leaves the target out of its denominator, so the loss falls without "
        "limit as f_y grows; judge runs by accuracy (denominator=all bounds it)"
    )
    objective_when = {"denominator": "others"}

    def init_state(self, state, rnd):
        super().init_state(state, rnd)
        keep_class_counts(state, rnd)

    def context(self, state, rnd):
        return super().context(state, rnd) | {"class_counts": state.client["class_counts"]}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        s = calibrated(self.logits(params, z), ctx["class_counts"], ctx["hp"]["tau"])  # [B, K]
        if self.cfg["denominator"] == "others":
            return others_loss(s, y, mask), new_buffers
        return masked_ce(s, y, mask), new_buffers
