"""FedAvg (McMahan et al., 2017) and the hooks every other algorithm overrides.

The model on top of the frozen backbones is the head of the FedPCL baselines (Tan et al., "Federated Learning from
Pre-Trained Models: A Contrastive Learning Approach", NeurIPS 2022, §5.1): a projection layer FC(D, proj_dim) + ReLU
(+ BN with bn=True) followed by a classifier FC(proj_dim, K).

An algorithm is bound to the run's shared (structural) settings, `self.cfg` (read-only; `create(name, cfg)` or the
engine's `bind`). Every hook that runs on the server side gets `rnd`, the read-only `engine.Round` (its fields
are listed there); per-configuration floats exist only as its tensors rnd.hp (name -> [H]). Hooks, in the order the
engine calls them:

    init(cfg, d_in, K, gen) -> (params, buffers)       ONE model's initial tensors
    init_state(state, rnd)           once, before round 1 (rnd.round = -1)
    per local epoch:
        trainable(name, rnd)         whether parameter `name` is updated in local epoch rnd.epoch
        context(state, rnd)          per-model tensors the local loss and inference need, leading [H, C]
        local_loss(params, buffers, x, y, mask, ctx) -> (loss, new_buffers)   ONE client's minibatch loss (vmapped)
        after_step(params, ctx, active, rnd)   after each optimizer step, in place on [H, C, ...] (e.g. SCAFFOLD)
    after_local(state, rnd)          e.g. compute prototypes on the client's data
    upload(state, rnd)               what each client sends: name -> [H, C, ...]
    aggregate(uploads, weights, state, rnd) -> server state, name -> [H, ...]  (weights [H, C]: n_k, 0 if absent)
    download(state, server, rnd)     what clients take from the server
    predict(params, buffers, x, ctx) -> scores [N, K]       ONE client's inference (vmapped; ctx["rows"] [N] bool
                                                            marks the real rows of x)
at every evaluation round:
    global_model(state, rnd) -> (params, buffers) name -> [H, ...], or None     the server's aggregated model
    predict_global(params, buffers, x, ctx) -> scores [N, K]  its inference on one client's rows (vmapped)
and, asked once per run: local_epochs(), shared(name). Declared as data: `groups` (the local optimizer's parameter
groups: the settings giving their learning rate, a multiplier of it and weight decay, and gradient-norm clip) and
`keeps_optimizer_state` (moments and step counts carry over from round to round, per model) and `personal_predict`
(predict reads only what the client's own training changes: non-participants keep their scores). Derived from which
hooks are FedAvg's own: `fedavg_server` (the engine averages the participants' shared tensors where they trained)
and `clients_hold_global` (the global metric is the clients' pooled one).

The global model is what the FedAvg-family papers evaluate on a global test set (here: the union of all clients'
test splits). FedAvg's is the averaged model every client downloads; an algorithm whose server holds no complete
model (nothing shared, or personal layers the server never sees) has none, and says so in its docstring.
"""

from __future__ import annotations

import copy
from types import MappingProxyType

import torch
import torch.nn.functional as F

from .heads import bn_init, linear, mlp, mlp_init
from ..training.config import Setting
from ..training.optim import Group
from . import register


def masked_mean(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of v [B] over rows where mask [B] is True (0 when there are none)."""
    m = mask.float()
    return (v * m).sum() / m.sum().clamp(min=1)


def one_hot(y: torch.Tensor, K: int) -> torch.Tensor:
    """[N] -> [N, K] bool (vmap-safe, unlike F.one_hot); padding labels (-1) give all-False rows."""
    return y[..., None] == torch.arange(K, device=y.device)


def logsumexp(s: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """torch.logsumexp with exponents clamped at −87 (e^−87 ≈ 1.6e−38: a term that cannot change a float32 sum
    holding e^0 = 1). The CPU's exp is many times slower on arguments that underflow, which at τ = 0.07 and on −inf
    masks is most of them. A row that is all −inf gives a finite, very negative value instead of −inf (no NaN
    downstream)."""
    m = s.detach().amax(dim, keepdim=True)
    m = m.masked_fill(~torch.isfinite(m), 0)
    out = (s - m).clamp(min=-87).exp().sum(dim, keepdim=True).log() + m
    return out if keepdim else out.squeeze(dim)


def masked_ce(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(F.cross_entropy(logits, y.clamp(min=0), reduction="none"), mask)


def proximal(params: dict, anchor: dict) -> torch.Tensor:
    """||w − w^t||² summed over all parameters (a scalar for one client)."""
    return sum(((params[k] - anchor[k]) ** 2).sum() for k in params)


def remember_global(state) -> None:
    """Keep the model every client starts the next round from, w^t [H, ...], in state.server["global"].

    Call it after the download of a FedAvg-style algorithm, when all clients of a configuration hold the same model.
    """
    state.server["global"] = {k: v[:, 0].clone() for k, v in state.params.items()}  # [H, ...]


def global_context(state, rnd) -> dict:
    """The round's global model broadcast to every client: name -> [H, C, ...] (views)."""
    return {k: rnd.expand(v) for k, v in state.server["global"].items()}


def bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast [H] or [H, C] against [H, ...] or [H, C, ...] (trailing singleton axes)."""
    return t.reshape(*t.shape, *[1] * (like.dim() - t.dim()))


def weighted_mean(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Average [H, C, ...] over clients with weights [H, C] -> [H, ...] (FedAvg's n_k / n)."""
    w = w / w.sum(1, keepdim=True).clamp(min=1e-12)  # [H, C]
    return torch.einsum("hc,hc...->h...", w.to(v.dtype), v)  # a batched product: no [H, C, ...] temporary


@register
class FedAvg:
    name = "fedavg"
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
    uploads = "all head parameters"
    # Declared settings (training/config.py `Setting`): a subclass lists only what it adds or changes.
    settings = {
        "proj_dim": Setting(256, "width of the projection layer", lo=1),
        "bn": Setting(False, "BatchNorm after the projection layer"),
    }
    uses_views = False  # whether training needs the cached augmented views (train.py loads them)
    limitation = ""  # what differs from the paper on cached features (shown by `featcache algos`)
    # Why the training loss is not a fit measure whose fall means a better fit (unbounded below, a bound, ...): `train`
    # prints it once and `featcache algos` shows it; it holds under the settings `objective_when` names ({}: always).
    objective = ""
    objective_when: dict = {}
    # Whether the engine may capture the local step (a CUDA graph): local_loss and after_step read their inputs
    # only from tensors, never from the Round's step number or other host values that change from step to step.
    # (Capture first runs the step twice with every model masked out: a local_loss that draws random numbers gets
    # other draws than an eager run, so `assert_capturable` reports it; set False for such an algorithm.)
    capturable = True
    # The local optimizer's parameter groups by name prefix (longest prefix wins): which settings give a group's
    # learning rate, a multiplier of it (a batched=False setting) and weight decay, and the norm each model's gradient
    # of the group is clipped to (None: none).
    groups = {"": Group()}
    # Whether each model's optimizer moments and step counts carry over from round to round (one optimizer per
    # client kept alive, as torch.optim objects a client holds for the whole run) instead of starting from zero.
    keeps_optimizer_state = False
    # Whether `predict` reads only what a client's own local training changes (its parameters and buffers, and
    # per-client state refreshed for the round's participants only): a client that took part in no round since the
    # last evaluation then keeps its scores, and the engine reuses them rather than scoring it again.
    personal_predict = False
    cfg = None  # the shared settings this instance is bound to (see bind)

    def bind(self, cfg) -> "FedAvg":
        """A copy bound to the shared (structural) settings `cfg` (read-only); this instance is unchanged."""
        bound = copy.copy(self)
        bound.cfg = cfg if isinstance(cfg, MappingProxyType) else MappingProxyType(dict(cfg))
        return bound

    # -- model ------------------------------------------------------------------------------------------------
    def init(self, cfg: dict, d_in: int, num_classes: int, gen: torch.Generator):
        params, buffers = mlp_init([d_in, cfg["proj_dim"]], gen, prefix="proj", bn=False)
        if cfg["bn"]:
            bn_init(params, buffers, "proj0.bn", cfg["proj_dim"])
        head, _ = mlp_init([cfg["proj_dim"], num_classes], gen, prefix="cls")
        return params | head, buffers

    def embed(self, params, buffers, x, mask=None, train=False):
        """Projection network output z [N, proj_dim] and updated BN statistics."""
        return mlp(params, buffers, x, 1, prefix="proj", mask=mask, train=train, final_relu=True)

    def logits(self, params, z):
        return linear(params, "cls0", z)  # [N, K]

    # -- client -----------------------------------------------------------------------------------------------
    def context(self, state, rnd) -> dict:
        """Per-model tensors for local_loss and predict, leading [H, C]; asked once per local epoch and for
        evaluation (server and client state do not change during local steps)."""
        return {"hp": {k: rnd.expand(v) for k, v in rnd.hp.items()}}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        return masked_ce(self.logits(params, z), y, mask), new_buffers

    def predict(self, params, buffers, x, ctx):
        z, _ = self.embed(params, buffers, x)
        return self.logits(params, z)

    def after_step(self, params: dict, ctx: dict, active: torch.Tensor, rnd) -> None:
        """Called after every optimizer step (under no_grad) with the stacked parameters name -> [H, C, ...], which it
        may change in place, the epoch's context and active [H, C] bool (the models that stepped; the others must
        stay unchanged). Must not read device tensors back to the host; on CUDA it runs inside the captured step (see
        `capturable`), whose `rnd.step` is the step it was captured at."""

    def local_epochs(self) -> int:
        return self.cfg["local_epochs"]

    def trainable(self, name: str, rnd) -> bool:
        """Whether parameter `name` is updated in local epoch rnd.epoch of round rnd.round (phases train subsets)."""
        return True

    def init_state(self, state, rnd) -> None:
        pass

    def after_local(self, state, rnd) -> None:
        pass

    # -- server -----------------------------------------------------------------------------------------------
    def shared(self, name: str) -> bool:
        """Which parameters are uploaded and averaged."""
        return True

    def upload(self, state, rnd) -> dict:
        """Shared parameters and shared buffers (BN running statistics travel with their layer)."""
        return {k: v for k, v in (state.params | state.buffers).items() if self.shared(k)}

    def aggregate(self, uploads: dict, weights: torch.Tensor, state, rnd) -> dict:
        return {k: weighted_mean(v, weights) for k, v in uploads.items()}

    def download(self, state, server: dict, rnd) -> None:
        """Every client receives the server's model: stored once per configuration, [H, ...] broadcast to [H, C, ...]
        (a view: what a client changes later is copied first)."""
        for k, v in server.items():
            target = state.params if k in state.params else state.buffers
            target[k] = rnd.expand(v)

    # -- the global model -------------------------------------------------------------------------------------
    def global_model(self, state, rnd) -> tuple[dict, dict] | None:
        """The server's aggregated model after the round, (params, buffers) name -> [H, ...], or None when the
        server holds no complete model. Default: when every parameter and buffer is shared, the model every client
        holds after FedAvg's download (client 0's copy); None as soon as one is not. Override it when `download`
        does not hand every client the server's model."""
        if not all(self.shared(k) for k in (*state.params, *state.buffers)):
            return None
        return {k: v[:, 0] for k, v in state.params.items()}, {k: v[:, 0] for k, v in state.buffers.items()}

    def predict_global(self, params, buffers, x, ctx):
        """Scores [N, K] of the global model on one client's rows (vmapped like `predict`, which it is by default;
        an algorithm whose `predict` reads a personal model from `ctx` predicts with `params` here)."""
        return self.predict(params, buffers, x, ctx)

    @property
    def fedavg_server(self) -> bool:
        """Whether the server side is FedAvg's own (after_local, upload, aggregate and download not overridden): the
        participants' shared tensors averaged and the mean handed to every client. Then the engine aggregates the
        participants' tensors where they trained and never writes them into the clients' state, which download
        replaces anyway: a round costs memory and time in proportion to its participants, not to C."""
        cls = type(self)
        return all(getattr(cls, h) is getattr(FedAvg, h) for h in ("after_local", "upload", "aggregate", "download"))

    @property
    def clients_hold_global(self) -> bool:
        """Whether every client predicts with the global model after `download`, as `predict_global` would: then the
        global metric is the clients' pooled one and is not evaluated again. True exactly where the default
        `global_model` and `predict_global` apply (their contract is FedAvg's download); overriding either opts out."""
        cls = type(self)
        return cls.global_model is FedAvg.global_model and cls.predict_global is FedAvg.predict_global
