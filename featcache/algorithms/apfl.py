"""APFL (Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461, 2020, Alg. 1 and
its adaptive α).

Each client i keeps a local model v_i beside its copy w_i of the global model and a mixing weight α_i ∈ [0, 1]; its
personalized model mixes the two in parameter space, v̄_i = α_i v_i + (1 − α_i) w_i. A local step on a minibatch ξ
(Alg. 1; the adaptive α's step; all three from the values before the step):

    w_i ← w_i − η ∇f_i(w_i; ξ)
    v_i ← v_i − η ∇_v f_i(v̄_i; ξ) = v_i − η α_i ∇f_i(v̄_i; ξ)
    α_i ← α_i − η ∇_α f_i(v̄_i; ξ) = α_i − η ⟨v_i − w_i, ∇f_i(v̄_i; ξ)⟩,   projected onto [0, 1]

After τ local steps (a round) the participants U_t send w_i and the server averages them, w = 1/|U_t| Σ_{j∈U_t} w_j,
which every client then holds as its w_i. Differences from FedAvg:
- the head holds v_i under "pers." (parameters and BN statistics) and α_i as a parameter "alpha" [1]; neither is
  uploaded;
- local loss: f_i(w_i) + f_i(v̄_i) with v̄_i = α_i v_i + (1 − α_i) sg(w_i) (w_i's gradient is its own loss's alone),
  so the engine's one backward pass gives exactly the three gradients above and its optimizer takes the three
  steps at once (Alg. 1's step with optimizer=sgd, momentum=0, weight_decay=0; with Adam, Adam on the same
  gradients); `after_step` projects α_i onto [0, 1];
- the server's mean is uniform over the participants (Alg. 1), not FedAvg's n_k / n;
- each client predicts with v̄_i = α_i v_i + (1 − α_i) w, w the model it downloaded (Alg. 1's output mixes v_i with
  the participants' average; it also averages the mixtures over the iterates, for its analysis: featcache, as the
  released codes, evaluates the last one).
Choices the paper leaves open: v_i starts as the initial global model (as PFLlib and FL-bench start it); α_0 = 0.5
(FL-bench's default; the paper's experiments take 0.25, 0.5 and 0.75: a per-configuration value a grid varies);
α learns at the models' rate η (as the paper writes its step), through the engine's optimizer, weight decay
included; adaptive=false keeps α_i at α_0 (the paper's APFL with a fixed α); v̄_i's BN layer runs with v_i's
statistics ("pers.", updated by v̄_i's forward passes), w_i's statistics travel with w_i and are averaged uniformly.
Global model: the averaged w, predicting with w itself.
The training loss is f_i(w_i) + f_i(v̄_i).

`apfl-official` is APFL as PFLlib releases it (TsingZ0/PFLlib @ d832e76f, system/flcore/clients/clientapfl.py,
servers/serverapfl.py), which differs in three places:
- v_i is trained on its own loss, v_i ← v_i − η ∇f_i(v_i; ξ), not on v̄_i's;
- after both steps, α_i ← clip(α_i − η (⟨v_i' − w_i', α_i ∇f_i(v_i; ξ) + (1 − α_i) ∇f_i(w_i; ξ)⟩ + 0.02 α_i), 0, 1)
  from the parameters after the step and the gradients of the step (FedTorch's rule, which the release cites);
- when local training ends, v_i ← (1 − α_i) w_i + α_i v_i with the client's trained w_i: the client predicts with that
  v_i and trains from it in its next round.
Its server averages w by n_k (PFLlib's) and α_0 = 1 (PFLlib's default). α_i is a buffer there, not a parameter:
the loss also returns the step's α_i ∇f_i(v_i) + (1 − α_i) ∇f_i(w_i) (torch.func.grad, beside the engine's backward
pass) as a buffer, and the client's next step, or `after_local` after its last, takes the α step once the parameters
after the step exist; the step does not change w_i or v_i, so taking it later changes nothing. BN statistics
(bn=True) are averaged with w by n_k (PFLlib averages `parameters()` only and keeps the first uploader's buffers).
"""

from __future__ import annotations

import torch
from torch.func import grad

from ..training.config import Setting
from ..training.models import map_models
from .base import FedAvg, bcast, weighted_mean
from .registry import register

PERS = "pers."  # prefix of the local model v_i's parameters and buffers
ALPHA = "alpha"  # apfl: the mixing weight α_i, a parameter [1]
OFFICIAL = "apfl."  # apfl-official: α_i ("apfl.alpha" [1]), a pending α step ("apfl.pending" [1]) and its direction
DECAY = 0.02  # apfl-official: the release's 0.02 α_i added to α's gradient (clientapfl.alpha_update)


def own(tree: dict) -> dict:
    """w_i's entries of a params or buffers dict."""
    return {k: v for k, v in tree.items() if not k.startswith((PERS, OFFICIAL)) and k != ALPHA}


def personal(tree: dict) -> dict:
    """v_i's entries of a params or buffers dict, under w_i's names."""
    return {k[len(PERS) :]: v for k, v in tree.items() if k.startswith(PERS)}


def mixed(params: dict) -> dict:
    """v̄_i = α_i v_i + (1 − α_i) w_i, one client's (α_i [1])."""
    a, w = params[ALPHA], own(params)
    return {k: a * v + (1 - a) * w[k] for k, v in personal(params).items()}


@register
class APFL(FedAvg):
    name = "apfl"
    paper = (
        "Deng, Kamani and Mahdavi, Adaptive Personalized Federated Learning, arXiv:2003.13461, 2020, Alg. 1 "
        "(adaptive α)"
    )
    uploads = "all parameters of the global model w (the local model v_i and α_i stay on the client)"
    settings = {
        "alpha": Setting(0.5, "α_0, each client's initial mixing weight of its local model", lo=0, hi=1),
        "adaptive": Setting(True, "learn α_i (false: α_i stays α_0, the paper's fixed-α APFL)"),
    }
    fedavg_server = False  # the server's mean is uniform over the participants (aggregate)
    clients_hold_global = False  # the clients predict with v̄_i

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        copy = lambda tree: tree | {PERS + k: v.clone() for k, v in tree.items()}  # v_i^0 = w^0
        return copy(params) | {ALPHA: torch.zeros(1)}, copy(buffers)  # α_i: α_0 per configuration (init_state)

    def init_state(self, state, rnd):
        state.params[ALPHA] = rnd.expand(rnd.hp["alpha"][:, None])  # [H, C, 1]

    def shared(self, name):
        return not name.startswith(PERS) and name != ALPHA

    def trainable(self, name, rnd):
        return name != ALPHA or self.cfg["adaptive"]

    def local_loss(self, params, buffers, x, y, mask, ctx):
        f_w, new = FedAvg.local_loss(self, own(params), own(buffers), x, y, mask, ctx)
        detached = {k: v.detach() for k, v in own(params).items()}  # sg(w_i): v̄_i's loss does not train w_i
        v_bar = mixed(params | detached)
        f_v, new_v = FedAvg.local_loss(self, v_bar, personal(buffers), x, y, mask, ctx)
        return f_w + f_v, new | {PERS + k: v for k, v in new_v.items()}

    def after_step(self, params, ctx, active, rnd):
        params[ALPHA].clamp_(0.0, 1.0)  # [H, C, 1] the projection onto [0, 1] (a model that sat out is inside it)

    def predict(self, params, buffers, x, ctx):
        return FedAvg.predict(self, mixed(params), personal(buffers), x, ctx)

    # -- server -----------------------------------------------------------------------------------------------
    def aggregate(self, uploads, weights, state, rnd):
        part = rnd.part.to(weights.dtype)  # [H, C] 1/|U_t| over the participants
        return {k: weighted_mean(v, part) for k, v in uploads.items()}

    def global_model(self, state, rnd):
        """The averaged w (every client holds the server's copy after the download)."""
        pick = lambda tree: {k: v[:, 0] for k, v in own(tree).items()}  # [H, ...]
        return pick(state.params), pick(state.buffers)

    def predict_global(self, params, buffers, x, ctx):
        return FedAvg.predict(self, params, buffers, x, ctx)  # w itself


def alpha_step(w: dict, v: dict, direction: dict, alpha, pending, lr):
    """One client's α_i after its pending step (apfl-official): clip(α_i − η (Σ ⟨v_i − w_i, d⟩ + 0.02 α_i), 0, 1),
    d = α_i ∇f_i(v_i) + (1 − α_i) ∇f_i(w_i) of that step, w_i and v_i after it; α_i itself where none is pending."""
    dot = sum((v[k] - w[k]).flatten() @ direction[k].flatten() for k in w)  # []
    new = (alpha - lr * (dot + DECAY * alpha)).clamp(0.0, 1.0)  # [1]
    return torch.where(pending > 0, new, alpha)


@register
class APFLOfficial(APFL):
    name = "apfl-official"
    paper = "APFL as PFLlib releases it (TsingZ0/PFLlib, clientapfl.py, serverapfl.py)"
    settings = {
        "alpha": 1.0,  # PFLlib's default (main.py -al)
        "adaptive": None,  # the release always learns α_i
    }
    fedavg_server = False  # after local training v_i takes the mixture (after_local)
    personal_predict = True  # v_i and α_i change only in the client's own training

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        del params[ALPHA]
        direction = {f"{OFFICIAL}dir.{k}": torch.zeros_like(v) for k, v in own(params).items()}
        flags = {f"{OFFICIAL}alpha": torch.zeros(1), f"{OFFICIAL}pending": torch.zeros(1)}
        return params, buffers | flags | direction

    def init_state(self, state, rnd):
        state.buffers[f"{OFFICIAL}alpha"] = rnd.expand(rnd.hp["alpha"][:, None])  # [H, C, 1]

    def shared(self, name):
        return not name.startswith((PERS, OFFICIAL))

    def trainable(self, name, rnd):
        return True

    @staticmethod
    def caught_up(params: dict, buffers: dict, lr) -> torch.Tensor:
        """One client's α_i with its pending step taken (the parameters are those after that step)."""
        direction = {k[len(OFFICIAL) + 4 :]: v for k, v in buffers.items() if k.startswith(f"{OFFICIAL}dir.")}
        w, v = ({k: t.detach() for k, t in part(params).items()} for part in (own, personal))
        return alpha_step(w, v, direction, buffers[f"{OFFICIAL}alpha"], buffers[f"{OFFICIAL}pending"], lr)

    def local_loss(self, params, buffers, x, y, mask, ctx):
        alpha = self.caught_up(params, buffers, ctx["hp"]["lr"])  # [1] after the previous step's α step
        loss = lambda p, b: FedAvg.local_loss(self, p, b, x, y, mask, ctx)
        w, v = own(params), personal(params)
        f_w, new = loss(w, own(buffers))
        f_v, new_v = loss(v, personal(buffers))
        both = lambda w, v: loss(w, own(buffers))[0] + loss(v, personal(buffers))[0]
        detached = lambda tree: {k: t.detach() for k, t in tree.items()}
        g_w, g_v = grad(both, argnums=(0, 1))(detached(w), detached(v))  # ∇f_i(w_i; ξ), ∇f_i(v_i; ξ)
        direction = {f"{OFFICIAL}dir.{k}": alpha * g_v[k] + (1 - alpha) * g_w[k] for k in w}
        flags = {f"{OFFICIAL}alpha": alpha, f"{OFFICIAL}pending": torch.ones_like(alpha)}
        return f_w + f_v, new | {PERS + k: t for k, t in new_v.items()} | flags | direction

    def after_step(self, params, ctx, active, rnd):
        pass  # α_i is clipped in its own step

    def after_local(self, state, rnd):
        """The participants' last α step, then v_i ← (1 − α_i) w_i + α_i v_i (clientapfl.train's end)."""
        lr = rnd.expand(rnd.hp["lr"])  # [H, C]
        alpha = map_models(self.caught_up, (state.params, state.buffers, lr))  # [H, C, 1]
        a = alpha[..., 0]  # [H, C]
        part = rnd.part  # [H, C]
        mixed_v = {}
        for k, w in own(state.params).items():
            v = state.params[PERS + k]  # [H, C, ...]
            mix = (1 - bcast(a, v)) * w + bcast(a, v) * v  # [H, C, ...]
            mixed_v[PERS + k] = torch.where(bcast(part, v), mix, v)
        state.params = state.params | mixed_v  # new tensors: the step runner's own are refilled next round
        pending = state.buffers[f"{OFFICIAL}pending"]
        state.buffers = state.buffers | {f"{OFFICIAL}alpha": alpha, f"{OFFICIAL}pending": torch.zeros_like(pending)}

    def predict(self, params, buffers, x, ctx):
        return FedAvg.predict(self, personal(params), personal(buffers), x, ctx)

    def aggregate(self, uploads, weights, state, rnd):
        return FedAvg.aggregate(self, uploads, weights, state, rnd)  # n_k / n (PFLlib's serverbase)
