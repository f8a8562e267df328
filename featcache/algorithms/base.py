"""FedAvg (McMahan et al., 2017), the hooks every other algorithm overrides, and the contract they implement.

The model on top of the frozen backbones is the head of the FedPCL baselines (Tan et al., "Federated Learning from
Pre-Trained Models: A Contrastive Learning Approach", NeurIPS 2022, §5.1): a projection layer FC(D, proj_dim) + ReLU
(+ BN with bn=True) followed by a classifier FC(proj_dim, K).

An algorithm is bound to the run's shared (structural) settings, `self.cfg` (read-only; `create(name, cfg)` or the
engine's `bind`). Every hook that runs on the server side gets `rnd`, the read-only `Round` (training/engine.py
lists its fields); per-configuration floats exist only as its tensors rnd.hp (name -> [H]). `state` is the engine's
`State`: params, buffers and client [H, C, ...], server [H, ...]. Hooks, in the order the engine calls them:

    init(cfg, d_in, K, gen) -> (params, buffers)       ONE model's initial tensors
    init_state(state, rnd)           once, before round 1 (rnd.round = -1)
    per local epoch:
        trainable(name, rnd)         whether parameter `name` is updated in local epoch rnd.epoch
        context(state, rnd)          per-model tensors the local loss and inference need, leading [H, C]
        local_loss(params, buffers, x, y, mask, ctx) -> (loss, new_buffers)   ONE client's minibatch loss (vmapped)
        penalty(params, ctx) -> (value [H, C], grads) or None   a term of the loss with a closed-form gradient
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
and, asked once per run: local_epochs(), shared(name).

Declared as data, never inferred from which hooks a class overrides (`Algorithm` lists them; `registry.register`
refuses a class whose hooks contradict them, `contradictions`): `settings`, `groups` (the local optimizer's parameter
groups: the settings giving their learning rate, a multiplier of it and weight decay, and a gradient-norm clip) and
the capabilities `uses_views`, `uses_global`, `capturable`, `keeps_optimizer_state`, `personal_predict`,
`fedavg_server`, `clients_hold_global` and `across_clients` (each explained where FedAvg declares it).

The global model is what the FedAvg-family papers evaluate on a global test set (here: the union of all clients'
test splits). FedAvg's is the averaged model every client downloads; an algorithm whose server holds no complete
model (nothing shared, or personal layers the server never sees) has none, and says so in its docstring.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch
import torch.nn.functional as F

from ..training.config import Setting, settings_of
from ..training.optim import Group
from .heads import Params, bn_init, linear, mlp, mlp_init

if TYPE_CHECKING:
    from ..training.engine import Round, State

Context = dict[str, Any]  # a hook's per-model tensors (nested dicts of [H, C, ...]; ONE client's inside vmap)


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


def proximal(params: Params, anchor: Params) -> torch.Tensor:
    """||w − w^t||² summed over all parameters (a scalar for one client)."""
    return cast(torch.Tensor, sum(((params[k] - anchor[k]) ** 2).sum() for k in params))


def laid_like(anchor: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`anchor` [H, C, ...], one model per configuration broadcast over clients, in the memory layout of each model
    of `p` [H, C, ...] (a linear weight trained transposed in memory): elementwise arithmetic of the two then runs
    at full speed. Copies the H models only, and only where the layouts differ."""
    if anchor.dim() < 4 or anchor.stride(1) != 0 or p.stride()[2:] == anchor.stride()[2:] or not p.mT.is_contiguous():
        return anchor
    return anchor[:, 0].mT.contiguous().mT[:, None].expand_as(anchor)


def keep_class_counts(state: State, rnd: Round) -> None:
    """Each client's training rows per class, n_{c,k}, into state.client["class_counts"] [H, C, K] (fixed: the
    cached data do not change), for a loss that reads its client's label distribution (FedRoD, FedLC)."""
    data = rnd.data
    counts = (one_hot(data.labels, data.num_classes) & data.mask[..., None]).sum(1).float()  # [C, K]
    state.client["class_counts"] = counts.expand(rnd.H, *counts.shape)  # [H, C, K]


def remember_global(state: State, buffers: bool = False) -> None:
    """Keep the model every client starts the next round from, w^t [H, ...], in state.server["global"] (with
    `buffers`, its buffers in state.server["global_buffers"]).

    Call it after the download of a FedAvg-style algorithm, when all clients of a configuration hold the same model.
    """
    state.server["global"] = {k: v[:, 0].clone() for k, v in state.params.items()}  # [H, ...]
    if buffers:
        state.server["global_buffers"] = {k: v[:, 0].clone() for k, v in state.buffers.items()}  # [H, ...]


def bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast [H] or [H, C] against [H, ...] or [H, C, ...] (trailing singleton axes)."""
    return t.reshape(*t.shape, *[1] * (like.dim() - t.dim()))


def weighted_mean(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Average [H, C, ...] over clients with weights [H, C] -> [H, ...] (FedAvg's n_k / n)."""
    w = w / w.sum(1, keepdim=True).clamp(min=1e-12)  # [H, C]
    if v.dim() > 3 and not v.is_contiguous() and v.mT.is_contiguous():  # a weight in its gradient's layout: read
        return torch.einsum("hc,hc...->h...", w.to(v.dtype), v.mT).mT.contiguous()  # in place (einsum would copy it)
    return torch.einsum("hc,hc...->h...", w.to(v.dtype), v)  # a batched product: no [H, C, ...] temporary


def objective_note(algo, cfg: Mapping[str, Any]) -> str:
    """The algorithm's (class or instance) `objective` note when it holds under the resolved settings `cfg` (its
    `objective_when`), else ""."""
    return algo.objective if all(cfg.get(k) == v for k, v in algo.objective_when.items()) else ""


def objective_text(algo) -> str:
    """The algorithm's note on its training loss, with the settings under which it holds ("" when it has none)."""
    note, when = algo.objective, algo.objective_when
    return f"{note} (with {', '.join(f'{k}={v}' for k, v in when.items())})" if note and when else note


class FedAvg:
    name: ClassVar[str] = "fedavg"
    paper: ClassVar[str] = (
        "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
    )
    uploads: ClassVar[str] = "all head parameters"
    # Declared settings (training/config.py `Setting`): a subclass lists only what it adds or changes.
    settings: ClassVar[dict[str, Any]] = {
        "proj_dim": Setting(256, "width of the projection layer", lo=1),
        "bn": Setting(False, "BatchNorm after the projection layer"),
    }
    limitation: ClassVar[str] = ""  # what differs from the paper on cached features (shown by `featcache algos`)
    # Why the training loss is not a fit measure whose fall means a better fit (unbounded below, a bound, ...): `train`
    # prints it once and `featcache algos` shows it; it holds under the settings `objective_when` names ({}: always).
    objective: ClassVar[str] = ""
    objective_when: ClassVar[dict[str, Any]] = {}
    # The local optimizer's parameter groups by name prefix (longest prefix wins): which settings give a group's
    # learning rate, a multiplier of it (a batched=False setting) and weight decay, and the norm each model's gradient
    # of the group is clipped to (None: none).
    groups: ClassVar[dict[str, Group]] = {"": Group()}

    # -- capabilities: what the engine may rely on (a subclass declares each one its hooks change) ---------------
    # Whether training needs the cached augmented views (train.py loads them).
    uses_views: ClassVar[bool] = False
    # Whether local_loss reads w^t, the model every client starts the round from: FedAvg's own hooks then keep it in
    # state.server ("global", "global_buffers"; after init_state and every download) and `context` hands it over as
    # ctx["global"] and ctx["global_buffers"] (name -> [H, C, ...] views), without a hook of the server side changed.
    uses_global: ClassVar[bool] = False
    # Whether the engine may capture the local step (a CUDA graph): local_loss and after_step read their inputs
    # only from tensors, never from the Round's step number or other host values that change from step to step.
    # (Capture first runs the step twice with every model masked out: a local_loss that draws random numbers gets
    # other draws than an eager run, so `assert_capturable` reports it; set False for such an algorithm.)
    capturable: ClassVar[bool] = True
    # Whether the local objective holds a term pulling toward w^t with a closed-form gradient: set for a class that
    # overrides `penalty` (the one-step note of training/schedule.py is about such a term).
    proximal: ClassVar[bool] = False
    # Whether each model's optimizer moments and step counts carry over from round to round (one optimizer per
    # client kept alive, as torch.optim objects a client holds for the whole run) instead of starting from zero.
    keeps_optimizer_state: ClassVar[bool] = False
    # Whether `predict` reads only what a client's own local training changes (its parameters and buffers, and
    # per-client state refreshed for the round's participants only): a client that took part in no round since the
    # last evaluation then keeps its scores, and the engine reuses them rather than scoring it again.
    personal_predict: ClassVar[bool] = False
    # Whether the server side is FedAvg's own (after_local, upload, aggregate and download not overridden): the
    # participants' shared tensors averaged and the mean handed to every client. Then the engine aggregates the
    # participants' tensors where they trained and never writes them into the clients' state, which download
    # replaces anyway: a round costs memory and time in proportion to its participants, not to C.
    fedavg_server: ClassVar[bool] = True
    # Whether every client predicts with the global model after `download`, as `predict_global` would: then the
    # global metric is the clients' pooled one and is not evaluated again. Needs the default `global_model` and
    # `predict_global` (their contract is FedAvg's download) and every tensor shared.
    clients_hold_global: ClassVar[bool] = True
    # Why a hook reads across clients, where a client alone holds only its own rows and state ("": none does): such
    # an algorithm cannot run split into a server and clients that each hold one client (featcache.flower refuses it
    # with this line).
    across_clients: ClassVar[str] = ""

    cfg: Mapping[str, Any] = MappingProxyType({})  # the shared settings this instance is bound to (see bind)

    def bind(self, cfg: Mapping[str, Any]) -> FedAvg:
        """A copy bound to the shared (structural) settings `cfg` (read-only); this instance is unchanged."""
        bound = copy.copy(self)
        bound.cfg = cfg if isinstance(cfg, MappingProxyType) else MappingProxyType(dict(cfg))
        return bound

    # -- model ------------------------------------------------------------------------------------------------
    def init(self, cfg: Mapping[str, Any], d_in: int, num_classes: int, gen: torch.Generator) -> tuple[Params, Params]:
        params, buffers = mlp_init([d_in, cfg["proj_dim"]], gen, prefix="proj", bn=False)
        if cfg["bn"]:
            bn_init(params, buffers, "proj0.bn", cfg["proj_dim"])
        head, _ = mlp_init([cfg["proj_dim"], num_classes], gen, prefix="cls")
        return params | head, buffers

    def embed(
        self, params: Params, buffers: Params, x: torch.Tensor, mask: torch.Tensor | None = None, train: bool = False
    ) -> tuple[torch.Tensor, Params]:
        """Projection network output z [N, proj_dim] and updated BN statistics."""
        return mlp(params, buffers, x, 1, prefix="proj", mask=mask, train=train, final_relu=True)

    def logits(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        return linear(params, "cls0", z)  # [N, K]

    # -- client -----------------------------------------------------------------------------------------------
    def context(self, state: State, rnd: Round) -> Context:
        """Per-model tensors for local_loss and predict, leading [H, C]; asked once per local epoch and for
        evaluation (server and client state do not change during local steps). With `uses_global`, w^t too."""
        ctx: Context = {"hp": {k: rnd.expand(v) for k, v in rnd.hp.items()}}
        if self.uses_global:
            ctx["global"] = {k: rnd.expand(v) for k, v in state.server["global"].items()}  # [H, C, ...] views
            ctx["global_buffers"] = {k: rnd.expand(v) for k, v in state.server["global_buffers"].items()}
        return ctx

    def local_loss(
        self, params: Params, buffers: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, ctx: Context
    ) -> tuple[torch.Tensor, Params]:
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        return masked_ce(self.logits(params, z), y, mask), new_buffers

    def predict(self, params: Params, buffers: Params, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        z, _ = self.embed(params, buffers, x)
        return self.logits(params, z)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.proximal = cls.penalty is not FedAvg.penalty

    def penalty(self, params: Params, ctx: Context) -> tuple[torch.Tensor, Params] | None:
        """A term of the local objective whose gradient has a closed form, on the stacked models name -> [H, C, ...]
        and their context: its value [H, C] and its gradient name -> [H, C, ...], added to local_loss's value and
        gradient without a second autograd pass (FedProx's μ/2 ||w − w^t||²: μ (w − w^t)). None: no such term."""
        return None

    def after_step(self, params: Params, ctx: Context, active: torch.Tensor, rnd: Round) -> None:
        """Called after every optimizer step (under no_grad) with the stacked parameters name -> [H, C, ...], which it
        may change in place, the epoch's context and active [H, C] bool (the models that stepped; the others must
        stay unchanged). Must not read device tensors back to the host; on CUDA it runs inside the captured step (see
        `capturable`), whose `rnd.step` is the step it was captured at."""

    def local_epochs(self) -> int:
        return self.cfg["local_epochs"]

    def trainable(self, name: str, rnd: Round) -> bool:
        """Whether parameter `name` is updated in local epoch rnd.epoch of round rnd.round (phases train subsets)."""
        return True

    def init_state(self, state: State, rnd: Round) -> None:
        """The algorithm's state before round 1 (with `uses_global`: w^t, the initial model)."""
        if self.uses_global:
            remember_global(state, buffers=True)

    def after_local(self, state: State, rnd: Round) -> None:
        pass

    # -- server -----------------------------------------------------------------------------------------------
    def shared(self, name: str) -> bool:
        """Which parameters are uploaded and averaged."""
        return True

    def upload(self, state: State, rnd: Round) -> dict[str, Any]:
        """Shared parameters and shared buffers (BN running statistics travel with their layer)."""
        return {k: v for k, v in (state.params | state.buffers).items() if self.shared(k)}

    def aggregate(self, uploads: dict[str, Any], weights: torch.Tensor, state: State, rnd: Round) -> dict[str, Any]:
        return {k: weighted_mean(v, weights) for k, v in uploads.items()}

    def download(self, state: State, server: dict[str, Any], rnd: Round) -> None:
        """Every client receives the server's model: stored once per configuration, [H, ...] broadcast to [H, C, ...]
        (a view: what a client changes later is copied first). With `uses_global` it becomes w^t."""
        for k, v in server.items():
            target = state.params if k in state.params else state.buffers
            target[k] = rnd.expand(v)
        if self.uses_global:
            remember_global(state, buffers=True)

    # -- the global model -------------------------------------------------------------------------------------
    def global_model(self, state: State, rnd: Round) -> tuple[Params, Params] | None:
        """The server's aggregated model after the round, (params, buffers) name -> [H, ...], or None when the
        server holds no complete model. Default: when every parameter and buffer is shared, the model every client
        holds after FedAvg's download (client 0's copy); None as soon as one is not. Override it when `download`
        does not hand every client the server's model."""
        if not all(self.shared(k) for k in (*state.params, *state.buffers)):
            return None
        return {k: v[:, 0] for k, v in state.params.items()}, {k: v[:, 0] for k, v in state.buffers.items()}

    def predict_global(self, params: Params, buffers: Params, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Scores [N, K] of the global model on one client's rows (vmapped like `predict`, which it is by default;
        an algorithm whose `predict` reads a personal model from `ctx` predicts with `params` here)."""
        return self.predict(params, buffers, x, ctx)


class Algorithm(Protocol):
    """What the engine and the runs rely on: FedAvg implements it, and a plug-in that subclasses FedAvg inherits
    every member it leaves alone. Type a helper that takes any algorithm as `Algorithm`; the hooks' order and
    shapes are in this module's docstring, each capability's meaning where FedAvg declares it."""

    name: ClassVar[str]
    paper: ClassVar[str]
    uploads: ClassVar[str]
    settings: ClassVar[dict[str, Any]]
    limitation: ClassVar[str]
    objective: ClassVar[str]
    objective_when: ClassVar[dict[str, Any]]
    groups: ClassVar[dict[str, Group]]
    cfg: Mapping[str, Any]

    # capabilities: class attributes, or a property where one follows a setting (FedProto's personal_predict)
    @property
    def uses_views(self) -> bool: ...
    @property
    def uses_global(self) -> bool: ...
    @property
    def capturable(self) -> bool: ...
    @property
    def keeps_optimizer_state(self) -> bool: ...
    @property
    def personal_predict(self) -> bool: ...
    @property
    def fedavg_server(self) -> bool: ...
    @property
    def clients_hold_global(self) -> bool: ...
    @property
    def across_clients(self) -> str: ...

    def bind(self, cfg: Mapping[str, Any]) -> Algorithm: ...
    def init(
        self, cfg: Mapping[str, Any], d_in: int, num_classes: int, gen: torch.Generator
    ) -> tuple[Params, Params]: ...
    def init_state(self, state: State, rnd: Round) -> None: ...
    def local_epochs(self) -> int: ...
    def trainable(self, name: str, rnd: Round) -> bool: ...
    def context(self, state: State, rnd: Round) -> Context: ...
    def local_loss(
        self, params: Params, buffers: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, ctx: Context
    ) -> tuple[torch.Tensor, Params]: ...
    def penalty(self, params: Params, ctx: Context) -> tuple[torch.Tensor, Params] | None: ...
    def after_step(self, params: Params, ctx: Context, active: torch.Tensor, rnd: Round) -> None: ...
    def after_local(self, state: State, rnd: Round) -> None: ...
    def shared(self, name: str) -> bool: ...
    def upload(self, state: State, rnd: Round) -> dict[str, Any]: ...
    def aggregate(self, uploads: dict[str, Any], weights: torch.Tensor, state: State, rnd: Round) -> dict[str, Any]: ...
    def download(self, state: State, server: dict[str, Any], rnd: Round) -> None: ...
    def predict(self, params: Params, buffers: Params, x: torch.Tensor, ctx: Context) -> torch.Tensor: ...
    def global_model(self, state: State, rnd: Round) -> tuple[Params, Params] | None: ...
    def predict_global(self, params: Params, buffers: Params, x: torch.Tensor, ctx: Context) -> torch.Tensor: ...


CAPABILITIES = (
    "uses_views",
    "uses_global",
    "capturable",
    "keeps_optimizer_state",
    "personal_predict",
    "fedavg_server",
    "clients_hold_global",
)
# The hooks a declaration rests on: overriding one of them contradicts the capability being True.
RESTS_ON = {
    "fedavg_server": ("after_local", "upload", "aggregate", "download"),
    "clients_hold_global": ("global_model", "predict_global"),
}


def contradictions(cls: type[FedAvg]) -> list[str]:
    """What in `cls`'s declarations its hooks or settings contradict, one line each naming the fix ([]: none):
    a capability that is not a bool (or a property), a True capability whose hooks are overridden (`RESTS_ON`), a
    group naming a setting that is not declared, or a learning-rate multiplier a grid could vary per configuration."""
    out = []
    for flag in CAPABILITIES:
        value = getattr(cls, flag)
        if not isinstance(value, (bool, property)):
            out.append(f"{flag} = {value!r}: declare True or False")
        elif value is True:
            changed = [h for h in RESTS_ON.get(flag, ()) if getattr(cls, h) is not getattr(FedAvg, h)]
            if changed:
                out.append(f"declares {flag} = True but overrides {', '.join(changed)}: declare {flag} = False")
    table = settings_of(cls)
    for prefix, group in cls.groups.items():
        for field, key in (("lr", group.lr), ("weight_decay", group.weight_decay), ("lr_scale", group.lr_scale)):
            if key is not None and key not in table:
                out.append(f"groups[{prefix!r}].{field} = {key!r} names no setting: declare it in `settings`")
        if group.lr_scale in table and table[group.lr_scale].batched:
            out.append(
                f"groups[{prefix!r}].lr_scale = {group.lr_scale!r} is a batched setting: declare it with batched=False"
            )
    return out


if TYPE_CHECKING:
    _: Algorithm = FedAvg()  # FedAvg implements the contract (mypy checks it)
