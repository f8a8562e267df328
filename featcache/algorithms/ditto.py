"""Ditto (Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021,
eq. 2, Alg. 1).

Each client k keeps a personal model v_k beside the global model w, which is trained and averaged as FedAvg's. The
personal model solves h_k(v_k; w^t) = F_k(v_k) + λ/2 ||v_k − w^t||² (eq. 2), w^t the global model the round started
from (Alg. 1: v_k ← v_k − η (∇F_k(v_k) + λ (v_k − w^t)) for s local iterations). Differences from FedAvg:
- the head holds a second copy, v_k, under "pers." (its parameters and BN statistics), starting as the initial global
  model (v_k^0 = w^0, as the released codes start it) and never uploaded;
- local loss: F_k(w) + F_k(v_k), on the same minibatches; the proximal term is a `penalty` on v_k's parameters with
  the closed-form gradient λ (v_k − w^t) (w^t read from the context, `uses_global`), added to F_k's gradient before
  the optimizer's step (FL-bench's way; PFLlib's PerturbedGradientDescent takes the same SGD step);
- w trains `local_epochs` epochs and v_k `pers_epochs` (s, counted in epochs); in the epochs past one model's count
  it is frozen and its loss and BN statistics are left out;
- each client predicts with v_k; absent clients keep theirs.
Choices the paper leaves open: w and v_k share the minibatches of each epoch (the released codes draw a shuffle for
each); the two are trained by the engine's optimizer (the paper and PFLlib: SGD; --set optimizer=sgd); λ = 1 by default
(FL-bench's; the paper tunes λ per data set) and pers_epochs = 1 (PFLlib's and FL-bench's). λ is a per-configuration
value that a grid varies. w is averaged with FedAvg's n_k / n weights, BN statistics included (PFLlib's server keeps the
first upload's statistics).
Global model: the averaged w, predicting with w itself (the paper's G(·) solution, which Ditto personalises).
The training loss is F_k(w) + F_k(v_k) + λ/2 ||v_k − w^t||².
"""

from __future__ import annotations

import torch

from ..training.config import Setting
from .base import FedAvg, bcast, laid_like
from .registry import register

PERS = "pers."  # prefix of the personal model v_k's parameters and buffers


def personal(tree: dict) -> dict:
    """v_k's entries of a params or buffers dict, under w's names."""
    return {k[len(PERS) :]: v for k, v in tree.items() if k.startswith(PERS)}


def common(tree: dict) -> dict:
    """w's entries of a params or buffers dict."""
    return {k: v for k, v in tree.items() if not k.startswith(PERS)}


@register
class Ditto(FedAvg):
    name = "ditto"
    paper = (
        "Li, Hu, Beirami and Smith, Ditto: Fair and Robust Federated Learning Through Personalization, ICML 2021, "
        "eq. 2, Alg. 1"
    )
    uploads = "all parameters of the global model w (the personal model v_k stays on the client)"
    settings = {
        "lam": Setting(1.0, "λ, weight of the personal model's proximal term to the round's global model", lo=0),
        "pers_epochs": Setting(1, "local epochs on the personal model per round (Alg. 1's s, in epochs)", lo=1),
    }
    uses_global = True  # w^t: ctx["global"]
    personal_predict = True  # v_k changes only in the client's own training
    clients_hold_global = False  # the clients predict with v_k

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        copy = lambda tree: tree | {PERS + k: v.clone() for k, v in tree.items()}
        return copy(params), copy(buffers)

    def shared(self, name):
        return not name.startswith(PERS)

    def local_epochs(self):
        return max(self.cfg["local_epochs"], self.cfg["pers_epochs"])

    def trainable(self, name, rnd):
        return rnd.epoch < self.cfg["pers_epochs" if name.startswith(PERS) else "local_epochs"]

    def context(self, state, rnd):
        on = lambda key: torch.full((rnd.H, rnd.C), float(rnd.epoch < self.cfg[key]), device=rnd.device)  # [H, C]
        return super().context(state, rnd) | {"train_w": on("local_epochs"), "train_v": on("pers_epochs")}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        loss, new = 0.0, {}
        for part, on, name in ((common, ctx["train_w"], ""), (personal, ctx["train_v"], PERS)):
            f, stats = FedAvg.local_loss(self, part(params), part(buffers), x, y, mask, ctx)
            old = part(buffers)
            loss = loss + on * f
            new |= {name + k: torch.where(on > 0, v, old[k]) for k, v in stats.items()}  # frozen: statistics kept
        return loss, new

    def penalty(self, params, ctx):
        """λ/2 ||v_k − w^t||² [H, C] (0 while v_k is frozen) and its gradient λ (v_k − w^t) on v_k's parameters."""
        lam, on, sq, grads = ctx["hp"]["lam"], ctx["train_v"], 0.0, {}  # [H, C], [H, C]
        for k, v in personal(params).items():
            d = v - laid_like(ctx["global"][k], v)  # v_k − w^t [H, C, ...] in v's layout
            sq = sq + torch.linalg.vector_norm(d, dim=tuple(range(2, d.dim()))).square()  # [H, C]
            grads[PERS + k] = d.mul_(bcast(lam, d))  # λ (v_k − w^t), in d's memory
        return lam / 2 * sq * on, grads

    def predict(self, params, buffers, x, ctx):
        return FedAvg.predict(self, personal(params), personal(buffers), x, ctx)

    def global_model(self, state, rnd):
        """The averaged w (shared, so every client holds the server's copy after the download)."""
        pick = lambda tree: {k: v[:, 0] for k, v in common(tree).items()}  # [H, ...]
        return pick(state.params), pick(state.buffers)

    def predict_global(self, params, buffers, x, ctx):
        return FedAvg.predict(self, params, buffers, x, ctx)  # w itself
