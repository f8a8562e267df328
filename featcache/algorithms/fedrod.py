"""FedRoD (Chen and Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification",
ICLR 2022, §4; linear personalized head).

Differences from FedAvg:
- a second, personal classifier ("pcls", starting as a copy of the generic one, as PFLlib's
  `system/flcore/clients/clientrod.py` does) next to the generic one; body (projection) and generic head are
  averaged, the personal head stays on the client;
- the body and the generic head g(z) learn with the balanced softmax (Ren et al., NeurIPS 2020), the class-count
  adjusted cross-entropy  L_BSM = −log( n_y exp(g_y) / Σ_c n_c exp(g_c) ),  n_c = the client's training samples of
  class c (classes it lacks get zero probability);
- the personal head p(z) learns with the cross-entropy of g(z) + p(z) with the body and g detached, so it only
  adapts the generic prediction to the client and does not change what is shared;
- each client predicts with g(z) + p(z).
Global model: the body with the generic head g, predicting with g(z) alone: the paper's generic-FL (G-FL)
evaluation, beside the personalized one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .heads import linear
from .registry import register
from .base import FedAvg, keep_class_counts, masked_ce, masked_mean


def balanced_softmax(logits: torch.Tensor, y: torch.Tensor, counts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid rows of −log(n_y e^{g_y} / Σ_c n_c e^{g_c}), logits [N, K], class counts [K]."""
    ce = F.cross_entropy(logits + counts.log(), y.clamp(min=0), reduction="none")  # [N]; log 0 = −inf: class absent
    return masked_mean(torch.where(mask, ce, 0.0), mask)  # padded rows may point at an absent class (ce = inf)


@register
class FedRoD(FedAvg):
    name = "fedrod"
    paper = "Chen and Chao, On Bridging Generic and Personalized FL for Image Classification, ICLR 2022, §4"
    uploads = "projection + generic classifier parameters"
    clients_hold_global = False  # clients predict with their personal heads; the global model has the generic one

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        personal = {k.replace("cls0", "pcls0"): v.clone() for k, v in params.items() if k.startswith("cls0")}
        return params | personal, buffers

    def shared(self, name):
        return not name.startswith("pcls")

    def init_state(self, state, rnd):
        keep_class_counts(state, rnd)

    def context(self, state, rnd):
        return super().context(state, rnd) | {"class_counts": state.client["class_counts"]}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        g = self.logits(params, z)  # [B, K] generic
        p = linear(params, "pcls0", z.detach())  # [B, K] personal
        loss = balanced_softmax(g, y, ctx["class_counts"], mask) + masked_ce(g.detach() + p, y, mask)
        return loss, new_buffers

    def predict(self, params, buffers, x, ctx):
        z, _ = self.embed(params, buffers, x)
        return self.logits(params, z) + linear(params, "pcls0", z)

    def global_model(self, state, rnd):
        """Body and generic head (shared, so every client holds the server's copy after the download)."""
        pick = lambda d: {k: v[:, 0] for k, v in d.items() if self.shared(k)}  # [H, ...]
        return pick(state.params), pick(state.buffers)

    def predict_global(self, params, buffers, x, ctx):
        return FedAvg.predict(self, params, buffers, x, ctx)  # g(z): no personal head
