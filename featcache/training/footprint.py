"""Memory of a run, estimated before anything runs from what the algorithm declares: its `init`, `init_state`,
`context`, `local_loss` and `predict` replay the engine's first round (the state and uploads of every client, the
local step and predict of two). The estimate follows what each tensor lives for:

- state, for the whole run, per configuration: every one of the C clients' parameters and buffers (the shared ones
  once where the server is FedAvg's and not every client trains: `fedavg_server`), the algorithm's per-client state
  (`state.client`) and the server's (`state.server`, e.g. FedPCL's padded prototypes [C, K, d]);
- training, per configuration, for the S models one pass of local training holds (the P = max(1, round(participation
  · C)) of a round, in slices of `cohort.slice_size`): each model's working copy of its parameters (the state's own
  where all C train at once), optimizer moments (both moved into the gradients' layout within their own memory at the
  first step) and what the local step allocates (the new tensors of one vmapped forward and backward, gradients
  included, as the allocator hands them out: see `_Allocated`; traced on two models side by side, so a batched
  op that copies per model counts as it does in the engine); and every participant's upload (the server's
  aggregation reads the P uploads as one stack, copied where they are views; FedAvg's server reads its P
  participants' trained tensors as they are where one pass trains them all in id order);
- evaluation, per configuration: every client's scores on its own rows (`predict`, traced the same way);
- data, once: the clients' features, labels and views of the train and test splits.

The replay runs on real tensors (every op on torch's meta device imports torch._dynamo: seconds), and on the meta
device (shapes only, nothing allocated) where the data given is, where the clients' models would take more than
1/REPLAY_SHARE of the available memory, and where a size setting is above its default, since such a setting may ask
for more memory than there is.

`fit_at_once` picks how many participants a pass of local training may hold for a run to fit the available memory
(the engine trains the rest in further slices); `check_memory` refuses, in one line naming the setting to lower, a
run whose estimate exceeds it.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ..cache import ClientData
from ..errors import UserError
from ..memory import available_bytes
from .config import resolve, shared_settings, structural_keys
from . import schedule
from .cohort import cohort_size, sets_aside, slice_size
from .engine import Frame, client_side, initial_state
from .hparams import HParams
from .optim import OPTIMIZERS
from .models import map_models

# Size settings a memory refusal may name, in the order they are considered when several grew.
SIZE_SETTINGS = ("proj_dim", "con_dim", "n_prompts", "queue", "heads", "batch_size")
VIEWS = (torch.ops.aten._unsafe_view.default,)  # views whose schema does not say so
TRACED = 2  # models traced side by side: a batched op that copies per model shows up as it does in the engine
REPLAY_SHARE = 8  # the replay runs on real tensors where every client's model takes at most 1/8 of the memory
# The hooks the replay runs, in the engine's order (after_step, aggregate and download allocate nothing it counts).
REPLAYED = ("init", "init_state", "context", "local_loss", "after_local", "upload", "predict")


@dataclass(frozen=True)
class Footprint:
    """Estimated bytes by lifetime; `state`, `training`, `uploads` and `evaluation` are one configuration's."""

    state: int  # the C clients' parameters, buffers and algorithm state, and the server's state
    training: int  # the S models one pass trains: working parameters, moments, step allocations
    evaluation: int  # every client's scores on its rows
    data: int  # the clients' features, labels and views (train and test), shared by every configuration
    uploads: int  # the P participants' uploads
    participants: int  # P
    traced: bool = True  # False where a hook failed in the replay: its state and activations left out

    @property
    def per_config(self) -> int:
        return self.state + self.training + self.uploads + self.evaluation

    def total(self, configs: int = 1) -> int:
        """Bytes of a run of `configs` batched configurations, its data included."""
        return self.data + configs * self.per_config


def participants(cfg: dict, clients: int) -> int:
    """P: the clients that take part in a round of `clients` at the configuration's participation."""
    return schedule.participants(clients, cfg["participation"])


def _bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if torch.is_tensor(t))


def _data_bytes(*splits: ClientData | None) -> int:
    return sum(_bytes((d.features, d.labels, d.counts, d.views)) for d in splits if d is not None)


class _Allocated(TorchDispatchMode):
    """The bytes of the new tensors the ops under it return, roughly the way the process's allocator hands them
    out: it keeps freed memory (featcache.memory.keep_freed_memory), and a block freed at the top of its heap is
    taken again by the next tensor, so a chunked loop's temporaries count once. Modelled as: a new tensor adds to
    the peak unless a freed one of its size is there to take; temporaries of other sizes add up. (A block freed
    below live ones is not reused for a tensor of its own size: glibc serves torch's 64-byte-aligned requests with
    a little more than the size, so such holes make a run's peak exceed this estimate.)"""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # torch would wrap __torch_dispatch__ in a torch._dynamo import (seconds)
        return False

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.freed = collections.Counter()  # size in bytes -> freed blocks of that size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in VIEWS and all(r.alias_info is None for r in func._schema.returns):  # a view allocates nothing
            for t in tree_leaves(out):
                if torch.is_tensor(t):
                    n = t.numel() * t.element_size()
                    if self.freed[n]:
                        self.freed[n] -= 1
                    else:
                        self.bytes += n
                    weakref.finalize(t, self.freed.update, [n])  # its block is free again once it dies
        return out


def _replay(algo, cfg: dict, model, data: ClientData):
    """The engine's round-1 State and Round for `data`'s clients, made by its own `Frame` and `initial_state`."""
    C, dev = data.features.shape[0], data.features.device
    floats = [k for k in cfg if k not in structural_keys(cfg, algo) and k != "seed"]
    hp = HParams.of({k: [float(cfg[k])] for k in floats}, dev)
    shared = MappingProxyType(dict(shared_settings(cfg, algo)))
    frame = Frame(
        1, torch.ones(C, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64), hp, shared, data, dev
    )
    return initial_state(algo, [model], frame), frame.round(0)


def _traced(algo, cfg: dict, model, train: ClientData, test: ClientData | None) -> tuple[int, int, int, int]:
    """(state.client + state.server bytes; per model: what its local step allocates, its upload, what its predict
    allocates), from the engine's first round replayed on the data's device, its hooks in the engine's order (those
    of `REPLAYED`): state and uploads of every client, the step and predict of TRACED of them."""
    C, B, D, dev = train.features.shape[0], cfg["batch_size"], train.features.shape[2], train.features.device
    state, rnd = _replay(algo, cfg, model, train)
    traced = lambda tree: tree_map(lambda t: t[:, :TRACED] if torch.is_tensor(t) and t.dim() >= 2 else t, tree)
    models, bufs = traced(state.params), traced(state.buffers)
    x, y = torch.zeros(1, TRACED, B, D, device=dev), torch.zeros(1, TRACED, B, dtype=torch.int64, device=dev)
    views = {"views": torch.zeros(1, TRACED, B, train.views.shape[2], D, device=dev)} if train.views is not None else {}
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in models.items()}
    ctx = traced(algo.context(state, rnd))
    with _Allocated() as step:
        loss, _ = torch.func.vmap(torch.func.vmap(algo.local_loss))(
            leaves, bufs, x, y, torch.ones(1, TRACED, B, dtype=torch.bool, device=dev), ctx | views
        )
        torch.autograd.grad(loss.sum(), [v for v in leaves.values()], allow_unused=True)
    uploads = client_side(algo, state, rnd)
    split = max((s for s in (train, test) if s is not None), key=lambda s: s.features.shape[1])  # the most rows
    models, bufs, ctx = traced(state.params), traced(state.buffers), traced(algo.context(state, rnd))
    rows = {"rows": torch.ones(1, TRACED, split.features.shape[1], dtype=torch.bool, device=dev)}
    with _Allocated() as evaluation, torch.no_grad():  # as evaluate.scores runs it: the rows shared by configurations
        map_models(lambda p, b, c, x: algo.predict(p, b, x, c), (models, bufs, ctx | rows), (split.features[:TRACED],))
    return _bytes((state.client, state.server)), step.bytes // TRACED, _bytes(uploads) // C, evaluation.bytes // TRACED


def _grown(algo, cfg: dict) -> list[str]:
    """The size settings of `cfg` above their defaults."""
    defaults = resolve(algo)
    return [k for k in SIZE_SETTINGS if k in cfg and cfg[k] > defaults[k]]


def _on_meta(data: ClientData) -> ClientData:
    """`data`'s shapes on the meta device."""
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
    views = None if data.views is None else meta(data.views)
    return ClientData(meta(data.features), meta(data.labels), meta(data.counts), data.num_classes, views)


def estimate(
    algo, cfg: dict, train: ClientData, test: ClientData | None = None, P: int | None = None, at_once: int | None = None
) -> Footprint:
    """The Footprint of one configuration `cfg` of `algo` (bound or not) on `train` (and `test`, counted as data
    when given); P: the models training per round (default: from cfg's participation), `at_once` the most of them
    one pass of local training holds (the Engine's; None: all P). An algorithm's own checks of its settings (in
    `init`) run here too; a hook that fails in the replay leaves its term out (the run itself reports it)."""
    algo = algo.bind(shared_settings(cfg, algo))
    C, D, K, B = train.features.shape[0], train.features.shape[2], train.num_classes, cfg["batch_size"]
    P = cohort_size(C, cfg["participation"], algo.keeps_optimizer_state) if P is None else P  # as the engine's
    S = slice_size(P, at_once, algo.keeps_optimizer_state)  # trained at once
    steps = [] if train.counts.is_meta else schedule.client_steps(train.counts.tolist(), B, cfg["drop_last"])
    by_id = bool(steps) and all(a >= b for a, b in zip(steps, steps[1:]))  # the step order is the ids' (`Plan.order`)
    # shapes only where the data is, or where a size the user raised may ask for more memory than there is
    meta = train.features.is_meta or bool(_grown(algo, cfg))
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            params, buffers = algo.init(cfg, D, K, torch.Generator().manual_seed(0))
    except UserError:
        raise
    except Exception:  # an init that reads values: made for real
        if not meta:
            raise
        params, buffers = algo.init(cfg, D, K, torch.Generator().manual_seed(0))
    n_params, n_buffers = _bytes(params), _bytes(buffers)
    if not meta and REPLAY_SHARE * C * (n_params + n_buffers) > available_bytes(train.features.device):
        meta, (params, buffers) = True, tree_map(lambda t: torch.empty_like(t, device="meta"), (params, buffers))
    if meta:
        train, test = _on_meta(train), test and _on_meta(test)
    traced = True
    try:
        kept, step, upload, evaluation = _traced(algo, cfg, (params, buffers), train, test)
    except UserError:
        raise
    except (Exception, SystemExit):  # a hook that fails (or a plug-in's that exits): the run itself says so;
        # the state beyond parameters and the activations are left out
        kept, step, upload, evaluation, traced = 0, 0, 0, 0, False
    rows = B * D * 4 * (1 + (train.views.shape[2] if train.views is not None else 0))  # the batch
    # the working copy (the clients' state itself where every client trains at once) and the moments; the gradient
    # is among what the step allocates
    moments = len(OPTIMIZERS[cfg["optimizer"]].state_names)
    trained = n_params * ((0 if S == C else 1) + moments)
    trained += n_buffers  # the local steps' own buffers (BN statistics updated during training)
    once = sets_aside(algo, C, P)  # the shared tensors: one per configuration, broadcast to its clients
    lifelong = params | buffers
    shared = _bytes({k: v for k, v in lifelong.items() if once and algo.shared(k)})
    return Footprint(
        state=C * (_bytes(lifelong) - shared) + shared + kept,
        training=S * (trained + step + rows),
        uploads=0 if once and S == P and by_id else P * upload,  # (trained in one pass in id order: not copied)
        evaluation=C * evaluation,
        data=_data_bytes(train, test),
        participants=P,
        traced=traced,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def fit_at_once(
    algo, cfg: dict, models: int, data: ClientData, device: torch.device, flag: str = "", avail: int | None = None
) -> int | None:
    """How many participants per configuration one pass of local training may hold for `models` batched
    configurations to fit in the memory `device` has available (`avail` bytes where given; the data already loaded
    not counted again): None when all of them fit, else the most that do (`Engine(at_once=...)`: the same run, in
    slices); refuses, as `check_memory`, when not even one does."""
    avail = available_bytes(device) if avail is None else avail
    if estimate(algo, cfg, data).per_config * models <= avail:
        return None
    one = estimate(algo, cfg, data, at_once=1)
    room = avail // models - one.state - one.uploads - one.evaluation  # what a configuration's training may take
    if room < one.training:
        _refuse(algo, cfg, models, one.per_config, device, avail, flag)
    return max(1, room // one.training)


def check_memory(algo, cfg: dict, models: int, data: ClientData, device: torch.device, flag: str = "") -> int:
    """Refuse, in one line naming the setting to lower, a run of `models` batched configurations that needs more
    memory than `device` has available (the data already loaded is not counted again). Returns the bytes one
    configuration needs."""
    one = estimate(algo, cfg, data).per_config
    _refuse(algo, cfg, models, one, device, available_bytes(device), flag)
    return one


def _refuse(algo, cfg: dict, models: int, one: int, device: torch.device, avail: int, flag: str) -> None:
    """The one-line refusal of a run of `models` configurations of `one` bytes each, when they exceed `avail`."""
    need = one * models
    if need > avail:
        defaults, grown = resolve(algo), _grown(algo, cfg)
        name = max(grown, key=lambda k: cfg[k] / max(defaults[k], 1)) if grown else None
        fix = (
            f"lower {name} (now {cfg[name]}, default {defaults[name]})"
            if name
            else flag or "use fewer seeds or a cache with fewer clients"
        )
        raise UserError(
            f"{algo.name} would need about {_gib(need)} of memory ({models} model(s) x {_gib(one)}) "
            f"but {device} has {_gib(avail)} available: {fix}"
        )
