"""Memory of a run, estimated before anything runs from what the algorithm declares: its `init`, `init_state`,
`context`, `local_loss` and `predict` replay the engine's first round for real on a few clients (a run's state is
grown from them to its C clients, so the replay costs what a few clients cost). The estimate follows what each tensor
lives for:

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

The replay runs on real tensors: every op on torch's meta device imports torch._dynamo (seconds). It runs there
(shapes only, nothing allocated) where the data given is, and where a size setting is above its default, since such
a setting may ask for more memory than there is.

`fit_at_once` picks how many participants a pass of local training may hold for a run to fit the available memory
(the engine trains the rest in further slices); `check_memory` refuses, in one line naming the setting to lower, a
run whose estimate exceeds it.
"""

from __future__ import annotations

import collections
import contextlib
import math
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
# the clients the replays make state for; a run of more is grown from the two (far enough apart that a temporary
# whose size happens to match another's at one of them moves the slope little)
REPLAYED_CLIENTS = (8, 16)
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


def _first(data: ClientData, n: int) -> ClientData:
    """The first n clients of `data` (views)."""
    views = None if data.views is None else data.views[:n]
    return ClientData(data.features[:n], data.labels[:n], data.counts[:n], data.num_classes, views)


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


def _at(a, b, n: tuple[int, int], C: int) -> int:
    """Bytes of tree `a`, made for n[0] clients, at C clients: each dimension that differs in `b` (the same tree made
    for n[1]) grows linearly with the clients ([C, K, d] prototypes, [C, C] affinities)."""
    total = 0
    for s, t in zip(tree_leaves(a), tree_leaves(b), strict=True):
        if torch.is_tensor(s):
            dims = (i + (j - i) * (C - n[0]) // (n[1] - n[0]) for i, j in zip(s.shape, t.shape, strict=True))
            total += math.prod(dims) * s.element_size()
    return total


def _round(algo, cfg: dict, model, train: ClientData, test: ClientData | None, n: int):
    """The engine's first round replayed for real on the first n clients, its hooks in the engine's order (those of
    `REPLAYED`): (their state.client and state.server, their uploads, the bytes the local step of TRACED of them
    allocates, and their predict on their rows)."""
    B, D, dev = cfg["batch_size"], train.features.shape[2], train.features.device
    state, rnd = _replay(algo, cfg, model, _first(train, n))
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
    return (state.client, state.server), uploads, step.bytes, evaluation.bytes


def _traced(algo, cfg: dict, model, train: ClientData, test: ClientData | None) -> tuple[int, int, int, int]:
    """(state.client + state.server bytes; per model: what its local step allocates, its upload, what its predict
    allocates) at C clients: `_round` on all of them, or where they are more than REPLAYED_CLIENTS, on each of those
    counts, what differs between the two growing linearly with the clients (FedPCL's step contrasts with every
    client's prototypes)."""
    C = train.features.shape[0]
    if C <= REPLAYED_CLIENTS[1]:
        kept, uploads, step, scored = _round(algo, cfg, model, train, test, C)
        return _bytes(kept), step // TRACED, _bytes(uploads) // C, scored // TRACED
    n = REPLAYED_CLIENTS
    (kept, uploads, *spent), (kept_, uploads_, *spent_) = (_round(algo, cfg, model, train, test, k) for k in n)
    step, scored = (a + (b - a) * (C - n[0]) // (n[1] - n[0]) for a, b in zip(spent, spent_))
    return _at(kept, kept_, n, C), step // TRACED, _at(uploads, uploads_, n, C) // C, scored // TRACED


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
    if meta:
        train, test = _on_meta(train), test and _on_meta(test)
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            params, buffers = algo.init(cfg, D, K, torch.Generator().manual_seed(0))
    except UserError:
        raise
    except Exception:  # an init that reads values: made for real
        params, buffers = algo.init(cfg, D, K, torch.Generator().manual_seed(0))
    n_params, n_buffers = _bytes(params), _bytes(buffers)
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
