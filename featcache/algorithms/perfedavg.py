"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", NeurIPS 2020, eq. 3 and Alg. 1).

Objective (eq. 3): min_w 1/n Σ_i f_i(w − α ∇f_i(w)), a shared initialisation that one gradient step adapts to each
client. Differences from FedAvg:
- local step (Alg. 1, MAML step on two independent batches D, D'): w̃ = w − α ∇f_i(w; D), then
  w ← w − β (I − α ∇²f_i(w; D'')) ∇f_i(w̃; D'). The engine's minibatch of B rows is split into D = rows 0, 2, 4, …
  and D' = rows 1, 3, 5, … (interleaved, so a short last batch splits the same way in every loop), so each has
  B/2 rows; set batch_size to twice the paper's |D|. The loss is f_i(w̃; D') and β is the engine's lr: with
  optimizer=sgd, momentum=0, weight_decay=0 the step is exactly the algorithm's.
  `order` = "first" (default): Per-FedAvg (FO), the Hessian term dropped (w̃ is built from a detached gradient).
  `order` = "second": the exact MAML gradient (I − α ∇²f_i(w; D)) ∇f_i(w̃; D') by differentiating through the inner
  step with torch.func, i.e. D'' = D. Per-FedAvg (HF) estimates the same Hessian-vector product by finite
  differences on a third batch D''; we compute it exactly instead (δ → 0) and reuse D.
- server (Alg. 1): w ← 1/|A| Σ_{i∈A} w_i, uniform over the participants A as in the paper;
- evaluation: each client first takes one adaptation step w − α ∇f_i(w) on its training data (the full local
  training set, the deterministic step of eq. 3; the paper's experiments take one stochastic step), then predicts.
Global model: the meta-model w, evaluated as the paper evaluates it: after each client's adaptation step on its own
training data (its own `predict`), on that client's test rows.
Default α = 0.005: Per-FedAvg's setting in pFedMe's MNIST comparison (Dinh et al. 2020, official README: α = 0.005,
β = 0.001 with SGD). Both forward passes of a step update BN running statistics, as in pFedMe's Per-FedAvg code.
"""

from __future__ import annotations

from torch.func import grad

from ..training.config import Setting
from .registry import register
from .base import FedAvg, weighted_mean

ORDERS = ("first", "second")
D, D_PRIME = slice(0, None, 2), slice(1, None, 2)  # the two halves of one engine minibatch


@register
class PerFedAvg(FedAvg):
    name = "perfedavg"
    paper = (
        "Fallah, Mokhtari & Ozdaglar, Personalized Federated Learning with Theoretical Guarantees: "
        "A Model-Agnostic Meta-Learning Approach, NeurIPS 2020, eq. 3, Alg. 1"
    )
    uploads = "all head parameters"
    fedavg_server = False  # the server averages the participants uniformly (aggregate)
    settings = {
        "alpha": Setting(0.005, "α, the adaptation step (pFedMe's Per-FedAvg setting)", lo=0, lo_open=True),
        "order": Setting("first", "first: Per-FedAvg (FO); second: the exact MAML gradient", choices=ORDERS),
    }

    def step(self, params: dict, at: dict, buffers: dict, x, y, mask, ctx) -> tuple[dict, dict]:
        """params − α ∇f(at; x, y) and the BN statistics of that forward pass."""
        g, new = grad(super().local_loss, has_aux=True)(at, buffers, x, y, mask, ctx)
        return {k: params[k] - ctx["hp"]["alpha"] * g[k] for k in params}, new

    # -- client -----------------------------------------------------------------------------------------------
    def local_loss(self, params, buffers, x, y, mask, ctx):
        at = params if self.cfg["order"] == "second" else {k: v.detach() for k, v in params.items()}
        adapted, new = self.step(params, at, buffers, x[D], y[D], mask[D], ctx)  # w̃ = w − α ∇f(w; D)
        loss, new_outer = super().local_loss(adapted, buffers | new, x[D_PRIME], y[D_PRIME], mask[D_PRIME], ctx)
        return loss, new | new_outer

    def context(self, state, rnd):
        train = rnd.data
        per_model = lambda t: t[None].expand(rnd.H, *t.shape)  # [C, ...] -> [H, C, ...] (a view)
        local = {"train_x": train.features, "train_y": train.labels, "train_mask": train.labels >= 0}
        return super().context(state, rnd) | {k: per_model(v) for k, v in local.items()}

    def predict(self, params, buffers, x, ctx):
        adapted, _ = self.step(params, params, buffers, ctx["train_x"], ctx["train_y"], ctx["train_mask"], ctx)
        return super().predict(adapted, buffers, x, ctx)

    # -- server -----------------------------------------------------------------------------------------------
    def aggregate(self, uploads, weights, state, rnd):
        return {k: weighted_mean(v, rnd.part.float()) for k, v in uploads.items()}  # uniform over participants
