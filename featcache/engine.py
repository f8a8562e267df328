"""The one round loop. Every algorithm runs here; algorithms only supply hooks (see algorithms/base.py).

Models carry two leading axes [H, C]: H configurations (hyperparameter settings x seeds) and C clients. One round:

    broadcast context -> local epochs (all H*C models in one vmapped step per minibatch) -> after_local
    -> upload -> aggregate over clients of each configuration -> download -> evaluate

Evaluation (every `eval_every` rounds and after the last) records, per model: accuracy and loss on its client's own
test rows, accuracy on its own training rows, and the round's mean local training loss (accumulated on the device
over the local steps, read back once per round with the NaN check); per configuration: the accuracy of the server's
global model (the algorithm's `global_model` hook, None where the server holds none) on the union of all clients'
test rows.

Every hook gets a read-only `Round`: which round and local epoch it is, the participation mask, the per-configuration
hyperparameters, the shared settings. Hooks never see the engine.

On CUDA each kind of local step is captured once as a CUDA graph and replayed (capture.py); the step reads and
writes only tensors the engine keeps for the whole run (the optimizer's, `_buffers`, `_acc`, the static slots).

Minibatch order comes from a counter-based hash of (seed, round, epoch, client, row), so it needs no Python loop
over clients, and a client sees the same batches whether it trains alone, in a plain loop, or inside a grid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch
from torch.func import vmap

from .cache import ClientData
from .devices import resolve_device
from .errors import UserError
from .capture import Graphs, Static, disarmed, resolve_mode, signature
from .optim import copy_into, optimizer_for
from .training.config import shared_settings, structural_keys

Params = dict[str, torch.Tensor]


@dataclass
class State:
    """Everything that evolves over rounds; tensors lead with [H, C] (models) except `server` ([H, ...])."""

    params: Params  # updated in place by the optimizer during local training: clone what you keep across rounds
    buffers: Params  # likewise updated in place during local training (BN statistics): clone what you keep
    client: dict = field(default_factory=dict)  # per-model algorithm state, e.g. local prototypes [H, C, K, d]
    server: dict = field(default_factory=dict)  # per-config server state, e.g. global prototypes [H, K, d]
    hp: dict = field(default_factory=dict)  # per-config hyperparameters as tensors [H]


@dataclass(frozen=True)
class Round:
    """Read-only facts of the moment a hook runs; the engine hands a fresh one to every hook (hooks never see the
    engine). Tensors are on `device` unless noted."""

    round: int  # 0-based round; -1 in init_state (before round 1)
    rounds: int  # R, the run's number of rounds
    epoch: int  # local epoch (0 outside local training)
    step: int  # step within the local epoch (0 outside local training)
    steps_per_epoch: int  # minibatches per local epoch (the largest client's; smaller clients sit the rest out)
    client_steps: torch.Tensor  # [C] minibatches each client takes per local epoch
    part: torch.Tensor  # [H, C] bool: the clients taking part in this round (all of them in init_state)
    H: int  # configurations
    C: int  # clients
    seeds: torch.Tensor  # [H] int64, on the host (they seed torch.Generators)
    hp: MappingProxyType  # per-configuration hyperparameters, name -> [H] float32
    cfg: MappingProxyType  # the run's shared (structural) settings, read-only
    data: ClientData  # the clients' training data (padded [C, Nmax, ...] + counts [C])
    device: torch.device

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """[H, ...] -> [H, C, ...] (a view): a per-configuration value for every client."""
        return expand_hc(t, self.C)


def map_models(fn, model_args: tuple, client_args: tuple = (), shared_args: tuple = ()):
    """Apply a per-client function to every model: model_args lead with [H, C], client_args with [C] (data shared
    by all configurations, never copied H times), shared_args are passed unchanged."""
    n_m, n_c, n_s = len(model_args), len(client_args), len(shared_args)
    inner = vmap(fn, in_dims=(0,) * (n_m + n_c) + (None,) * n_s)
    outer = vmap(inner, in_dims=(0,) * n_m + (None,) * (n_c + n_s))
    return outer(*model_args, *client_args, *shared_args)


def expand_hc(t: torch.Tensor, C: int) -> torch.Tensor:
    """[H, ...] -> [H, C, ...] (a view)."""
    return t[:, None].expand(t.shape[0], C, *t.shape[1:])


_MASK63 = (1 << 63) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping multiply, logical shifts)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def hash_keys(seeds: torch.Tensor, *ids: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Pseudo-random int64 keys [H, *shape] from (seed_h, ids..., position); same inputs, same keys, anywhere (on the
    device of `seeds`: integer arithmetic only, so CPU and GPU give the same bits)."""
    x = seeds.long().reshape(-1, *([1] * len(shape)))
    for i in ids:
        x = _mix(x * 1_000_003 + i)
    for d, n in enumerate(shape):  # each axis position enters separately: client c, row n
        coord = torch.arange(n, device=x.device).reshape(*([1] * (d + 1)), n, *([1] * (len(shape) - d - 1)))
        x = _mix(x * 1_000_003 + coord)
    return x & _MASK63


def batch_order(seeds: torch.Tensor, rnd: int, epoch: int, counts: torch.Tensor, n_max: int) -> torch.Tensor:
    """Per model, a random permutation of its client's valid rows, padding rows last: [H, C, Nmax] int64, on the
    device of `seeds` (`counts` [C] on the same device); no host synchronisation."""
    keys = hash_keys(seeds, rnd, epoch, shape=(len(counts), n_max))  # [H, C, Nmax]
    valid = torch.arange(n_max, device=keys.device) < counts[:, None]  # [C, Nmax]
    keys = torch.where(valid, keys >> 1, torch.full_like(keys, _MASK63))  # [H, C, Nmax]
    return torch.argsort(keys, dim=-1, stable=True)


def participation(seeds: torch.Tensor, rnd: int, C: int, rate: float) -> torch.Tensor:
    """[H, C] bool: which clients take part in this round (at least one per configuration)."""
    if rate >= 1:
        return torch.ones(len(seeds), C, dtype=torch.bool)
    k = max(1, round(rate * C))
    keys = hash_keys(seeds, rnd, 1 << 20, shape=(C,))  # [H, C]
    ranks = torch.argsort(torch.argsort(keys, dim=-1), dim=-1)
    return ranks < k


def trained_rows(counts, batch_size: int, drop_last: bool) -> list[int]:
    """Rows each client trains on per local epoch (drop_last drops a short last batch)."""
    return [int(n) // batch_size * batch_size if drop_last else int(n) for n in counts]


def client_steps(counts, batch_size: int, drop_last: bool) -> list[int]:
    """Minibatches each client takes per local epoch (the one place this is computed; see `Round.client_steps`)."""
    return [(n + batch_size - 1) // batch_size for n in trained_rows(counts, batch_size, drop_last)]


class Engine:
    """Trains H configurations x C clients of one algorithm on cached features."""

    def __init__(self, algo, cfgs: list[dict], train: ClientData, test: ClientData,
                 device: str | torch.device = "cpu", capture: str | None = "auto"):
        self.cfgs, self.device = cfgs, resolve_device(device)
        structural = structural_keys(cfgs[0], algo)
        for c in cfgs[1:]:
            diff = [k for k in structural if c[k] != cfgs[0][k]]
            if diff:
                raise UserError(f"configurations of one batched run must share {diff}: run them as separate buckets")
        self.cfg = shared_settings(cfgs[0], algo)  # the engine's own and every hook's shared settings
        self.algo = algo.bind(self.cfg)  # a bound copy; the caller's object is left as it was
        self.train, self.test = train.to(self.device), test.to(self.device)
        self.H, self.C = len(cfgs), train.features.shape[0]
        self.seeds = torch.tensor([c["seed"] for c in cfgs])
        floats = [k for k in cfgs[0] if k not in structural and k != "seed"]
        self.hp = {k: torch.tensor([float(c[k]) for c in cfgs], dtype=torch.float32, device=self.device)
                   for k in floats}  # name -> [H]
        self._hp_host = {k: [float(c[k]) for c in cfgs] for k in floats}  # the optimizer's per-config floats
        self._seeds = self.seeds.to(self.device)  # [H] for batch orders built on the device
        self._plan_steps()
        self._opt = None  # the run's optimizer, built in round 1; `load` starts every later round
        self._buffers: Params | None = None  # the models' buffers during local steps (updated in place)
        z = torch.zeros(self.H, self.C, device=self.device)
        self._acc = {"bad": z.bool(), "loss": z.clone(), "steps": z.clone()}  # [H, C] each, summed over a round
        mode = resolve_mode(capture, self.device) if self.algo.capturable else "off"
        self.graphs = None if mode == "off" else Graphs(mode, self.device)  # the captured local steps (capture.py)
        # slots the captured steps read: the round's participants [H, C], idx/valid per batch width, ctx per key
        self._static: dict = {"part": torch.zeros(self.H, self.C, dtype=torch.bool, device=self.device)}
        self._calls = 0  # local_train calls so far: when each context slot was last filled
        self._c_idx = torch.arange(self.C, device=self.device)[None, :, None]  # [1, C, 1] gathers each client's rows
        data = (self.train.features, self.train.labels, self.train.counts, self.train.views)
        self._fixed = frozenset(t.untyped_storage().data_ptr() for t in data if t is not None)  # stays put
        self.last_round: Round | None = None  # the context of the last round run (evaluate's default)
        self.round_loss: torch.Tensor | None = None  # [H, C] the last local_train's mean loss per model (device)

    def _plan_steps(self) -> None:
        """Minibatch plan, fixed for the run and read from the host once: rows each client trains per epoch (n_eff),
        the steps per epoch, and per step which clients still have a batch. Refuses clients that would never train."""
        B, drop_last = self.cfg["batch_size"], self.cfg["drop_last"]
        counts = self.train.counts.tolist()  # once, before training
        n_eff = trained_rows(counts, B, drop_last)
        small = sum(n == 0 for n in n_eff)
        if small:
            raise UserError(f"{small} client(s) have fewer than batch_size={B} training rows and would never train "
                            "with drop_last: use --set drop_last=false or a smaller --set batch_size")
        per_client = client_steps(counts, B, drop_last)
        self.steps = max(per_client)
        self._client_steps = torch.tensor(per_client, device=self.device)  # [C]
        N = self.train.features.shape[1]
        self._n_eff = torch.tensor(n_eff, device=self.device)  # [C]
        self._has_batch = [[s * B < n for n in n_eff] for s in range(self.steps)]  # host [steps][C]
        self._valid = [((s * B + torch.arange(min(B, N - s * B), device=self.device)) < self._n_eff[:, None])
                       for s in range(self.steps)]  # [C, B_s] per step: rows of a step that are real samples

    # -- setup --------------------------------------------------------------------------------------------------
    def round_context(self, rnd: int, part=None, epoch: int = 0, step: int = 0) -> Round:
        """The `Round` of round `rnd` (-1: before round 1); part [H, C] bool (default: every client)."""
        if part is None:
            part = torch.ones(self.H, self.C, dtype=torch.bool, device=self.device)
        elif not torch.is_tensor(part):
            part = torch.tensor(part, dtype=torch.bool)
        return Round(round=rnd, rounds=self.cfg["rounds"], epoch=epoch, step=step, steps_per_epoch=self.steps,
                     client_steps=self._client_steps, part=part.to(self.device), H=self.H, C=self.C,
                     seeds=self.seeds, hp=MappingProxyType(self.hp), cfg=self.cfg, data=self.train,
                     device=self.device)

    def init_state(self) -> State:
        d_in, K = self.train.features.shape[-1], self.train.num_classes
        per_h = [self.algo.init(self.cfg, d_in, K, torch.Generator().manual_seed(int(s))) for s in self.seeds]
        stack = lambda dicts: {k: expand_hc(torch.stack([d[k] for d in dicts]), self.C).clone().to(self.device)
                               for k in dicts[0]}
        state = State(params=stack([p for p, _ in per_h]), buffers=stack([b for _, b in per_h]), hp=self.hp)
        self.algo.init_state(state, self.round_context(-1))
        return state

    # -- one round ----------------------------------------------------------------------------------------------
    def local_train(self, state: State, rnd: int, part) -> torch.Tensor:
        """The round's local epochs for every model. `part` [H][C] bool is host data (nested lists, or a CPU tensor;
        participation is computed on the host), so the optimizer learns which models step without reading the
        device. Nothing in here reads a device tensor back: returns the models whose loss was NaN/Inf at some step,
        [H, C] bool on the device, and leaves each model's mean loss over the local steps it took in
        `self.round_loss` ([H, C] on the device, NaN where a model took none), for the caller to read once per round
        (`read_round`). Parameters and buffers are trained in tensors the engine keeps for the whole run (the
        optimizer's and `_buffers`), which is what lets a captured step replay on the same memory every round."""
        cfg, algo, data = self.cfg, self.algo, self.train
        B = cfg["batch_size"]
        part_host = part.tolist() if torch.is_tensor(part) else part  # [H][C] host bools
        ctx_round = self.round_context(rnd, part_host)
        opt = self._optimizer(state)
        state.params = opt.load(state.params)  # this round's starting models, in the optimizer's own tensors
        if self._buffers is None:
            self._buffers = {k: v.clone() for k, v in state.buffers.items()}
        state.buffers = copy_into(self._buffers, state.buffers)
        for t in self._acc.values():
            t.zero_()
        self._calls += 1
        if self.graphs is not None:
            self._static["part"].copy_(ctx_round.part)  # [H, C] what the captured steps read
        loss_fn = vmap(vmap(algo.local_loss))  # [H, C] losses; summed, each model gets exactly its own gradient
        for epoch in range(algo.local_epochs()):
            at = replace(ctx_round, epoch=epoch)
            frozen = frozenset(k for k in state.params if not algo.trainable(k, at))
            ctx = algo.context(state, at)  # server and client state do not change during local steps
            order = batch_order(self._seeds, rnd, epoch, data.counts, data.features.shape[1])  # [H, C, N]
            for s in range(self.steps):
                idx = order[..., s * B : (s + 1) * B]  # [H, C, B]
                if self.graphs is None:
                    active_host = [[p and h for p, h in zip(row, self._has_batch[s])] for row in part_host]
                    self._step(opt.params, self._buffers, self._acc, opt, loss_fn, ctx, idx, self._valid[s],
                               ctx_round.part, active_host, replace(at, step=s), frozen)
                else:
                    self._replay(opt, loss_fn, ctx, idx, self._valid[s], ctx_round.part, replace(at, step=s), frozen)
        state.params = dict(opt.params)  # (the first step may have given a parameter its gradient's layout)
        acc = self._acc
        self.round_loss = acc["loss"] / acc["steps"]  # [H, C], NaN where a model took no step
        return acc["bad"].clone()  # (the sums are zeroed and refilled next round)

    def _optimizer(self, state: State):
        """The run's optimizer (built in round 1): masked whole-stack arithmetic where steps are captured or on a
        GPU, torch's fused kernels on the CPU."""
        if self._opt is None:
            hp = self._hp_host
            kind = optimizer_for(self.cfg["optimizer"], self.device, masked=self.graphs is not None)
            self._opt = kind(state.params, lr=hp["lr"], weight_decay=hp["weight_decay"], momentum=hp.get("momentum"),
                             scale={k: self.algo.lr_scale(k) for k in state.params})
        return self._opt

    def _step(self, params: Params, buffers: Params, acc: dict, opt, loss_fn, ctx: dict, idx, valid, part, active_host,
              at: Round, frozen) -> None:
        """One local step of every model on the rows `idx` [H, C, B] (valid [C, B]: real rows; part [H, C]: the
        round's participants), updating the parameters (the optimizer's), the buffers and the round's sums `acc` in
        place."""
        data, c_idx = self.train, self._c_idx
        valid = valid.expand_as(idx)  # [H, C, B]
        active = valid.any(-1) & part  # [H, C]
        x = data.features[c_idx, idx]  # [H, C, B, D]
        y = data.labels[c_idx, idx]  # [H, C, B]
        extra = {"views": data.views[c_idx, idx]} if data.views is not None else {}  # [H, C, B, V, D]
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss, new_buffers = loss_fn(leaves, buffers, x, y, valid, ctx | extra)  # [H, C]
        grads = dict(zip(leaves, torch.autograd.grad(loss.sum(), list(leaves.values()), allow_unused=True)))
        grads = {k: torch.zeros_like(leaves[k]) if g is None else g for k, g in grads.items()}
        loss = loss.detach()
        acc["bad"] |= ~torch.isfinite(loss) & active  # [H, C] read once, after the round
        acc["loss"] += torch.where(active, loss, 0.0)  # [H, C]
        acc["steps"] += active  # [H, C]
        with torch.no_grad():
            opt.step(params, grads, active if opt.device_mask else active_host, frozen)  # in place
            self.algo.after_step(params, ctx, active, at)
            for k, v in new_buffers.items():
                buffers[k].copy_(torch.where(active.reshape(*active.shape, *[1] * (v.dim() - 2)), v, buffers[k]))

    def _replay(self, opt, loss_fn, ctx: dict, idx, valid, part, at: Round, frozen) -> None:
        """`_step` through its captured graph: this step's values go into the static slots, then the graph of its
        kind (trained names, batch width, context structure) replays; a kind seen for the first time is captured.
        The graph's closure holds the tensors of the moment of capture: one replaced since (rather than updated in
        place) shows up in replay mode as a difference from the eager run, as it would on a GPU."""
        slots, width = self._static, idx.shape[-1]
        key = (frozen, width, signature(ctx))
        if not self.graphs.admits(key):  # no graph, no slots kept: this kind runs eagerly
            return self._step(opt.params, self._buffers, self._acc, opt, loss_fn, ctx, idx, valid, part, None, at,
                              frozen)
        if ("idx", width) not in slots:
            slots["idx", width], slots["valid", width] = idx.clone(), valid.clone()
        slots["idx", width].copy_(idx)  # [H, C, B]
        slots["valid", width].copy_(valid)  # [C, B]
        stamp = (self._calls, at.epoch)  # the context changes between epochs and calls only
        if key not in self.graphs:
            static_ctx = slots["ctx", key] = Static(ctx, self._fixed)
            step = replace(at, part=slots["part"])  # the Round the captured hooks see (its step: the capture's)
            held = dict(opt.params), dict(self._buffers), dict(self._acc)  # what a CUDA graph would hold
            fn = lambda: self._step(*held, opt, loss_fn, static_ctx.tree, slots["idx", width], slots["valid", width],
                                    slots["part"], None, step, frozen)
            self.graphs.capture(key, fn, disarmed(slots["part"]))
        elif slots["loaded", key] != stamp:
            slots["ctx", key].load(ctx)
        slots["loaded", key] = stamp
        self.graphs.run(key)

    def read_round(self, bad: torch.Tensor, rnd: int) -> torch.Tensor:
        """One device read per round: refuse to go on when any model's loss was NaN/Inf (bad [H, C]); return the
        round's mean local training loss [H, C] on the host (NaN for models that sat the round out)."""
        both = torch.stack([bad.to(self.round_loss.dtype), self.round_loss]).cpu()  # [2, H, C]
        if bool(both[0].any()):
            raise UserError(f"{self.algo.name}: loss became NaN/Inf in round {rnd + 1}: lower --set lr=... "
                            "or check the cache with `featcache info`")
        return both[1]

    # -- evaluation ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def scores(self, state: State, data: ClientData, rnd: Round | None = None, model=None) -> torch.Tensor:
        """Every model's scores on its client's rows of `data`: [H, C, N, K] (after round `rnd`, by default the last
        one run). `model` = (params, buffers) name -> [H, ...] scores the server's global model instead, broadcast to
        every client, with the algorithm's `predict_global`."""
        ctx = self.algo.context(state, rnd or self.last_round or self.round_context(-1))
        if model is None:
            params, buffers, fn = state.params, state.buffers, self.algo.predict
        else:
            params, buffers = ({k: expand_hc(v, self.C) for k, v in d.items()} for d in model)  # [H, C, ...]
            fn = self.algo.predict_global
        predict = lambda p, b, c, x: fn(p, b, x, c)
        return map_models(predict, (params, buffers, ctx), (data.features,))  # [H, C, N, K]

    def evaluate(self, state: State, data: ClientData, rnd: Round | None = None) -> torch.Tensor:
        """Per-model accuracy on each client's own data: [H, C] (after round `rnd`, by default the last one run)."""
        return accuracy_loss(self.scores(state, data, rnd), data)[0]

    def evaluate_global(self, state: State, data: ClientData, rnd: Round | None = None) -> torch.Tensor | None:
        """The server's global model's accuracy on the union of all clients' rows of `data`: [H] (one correct count
        over every row of every client / all rows), or None when the algorithm has no global model."""
        model = self.algo.global_model(state, rnd or self.last_round or self.round_context(-1))
        if model is None:
            return None
        hit = hits(self.scores(state, data, rnd, model), data)  # [H, C, N]
        return hit.sum((1, 2)) / data.counts.sum().clamp(min=1)

    def record(self, state: State, now: Round, round_loss: torch.Tensor, logs: bool = True) -> dict:
        """What an evaluation round records, on the host: test_acc, test_loss, train_acc, train_loss [H, C] and
        global_acc [H] (None without a global model); only test_acc without `logs`."""
        test_acc, test_loss = accuracy_loss(self.scores(state, self.test, now), self.test)  # [H, C] each
        if not logs:
            return {"test_acc": test_acc.cpu()}
        train_acc, _ = accuracy_loss(self.scores(state, self.train, now), self.train)  # [H, C]
        glob = self.evaluate_global(state, self.test, now)  # [H] or None
        return {"test_acc": test_acc.cpu(), "test_loss": test_loss.cpu(), "train_acc": train_acc.cpu(),
                "train_loss": round_loss, "global_acc": None if glob is None else glob.cpu()}

    def run(self, progress=None, logs: bool = True) -> dict:
        """Train all rounds; returns, stacked over the evaluation rounds, the records of `record` (acc = test_acc
        [R_eval, H, C], test_loss, train_acc, train_loss [R_eval, H, C], global_acc [R_eval, H] or None), the
        evaluation rounds, upload sizes and timings. logs=False records test accuracy only: a grid's selection
        needs nothing else, and the other records add a forward pass over every training row per evaluation."""
        state = self.init_state()
        records, rounds, upload_floats, times = [], [], [], []
        R, algo = self.cfg["rounds"], self.algo
        for rnd in range(R):
            t0 = time.perf_counter()
            part_host = participation(self.seeds, rnd, self.C, self.cfg["participation"]).tolist()  # [H][C] host
            round_loss = self.read_round(self.local_train(state, rnd, part_host), rnd)  # [H, C] host
            now = self.last_round = self.round_context(rnd, part_host)
            algo.after_local(state, now)
            uploads = algo.upload(state, now)  # name -> [H, C, ...]
            weights = self.train.counts[None].float() * now.part  # [H, C]
            server = algo.aggregate(uploads, weights, state, now)
            algo.download(state, server, now)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            upload_floats.append(sum(v[0, 0].numel() for v in uploads.values()))
            if (rnd + 1) % self.cfg["eval_every"] == 0 or rnd == R - 1:
                records.append(self.record(state, now, round_loss, logs))
                rounds.append(rnd + 1)
            if progress:
                progress(rnd + 1, R)
        self.state = state
        stacked = {k: None if records[0][k] is None else torch.stack([r[k] for r in records]) for k in records[0]}
        return stacked | {"acc": stacked["test_acc"], "eval_rounds": rounds, "upload_floats": upload_floats,
                          "round_seconds": times}


def hits(scores: torch.Tensor, data: ClientData) -> torch.Tensor:
    """[H, C, N] bool: the valid rows whose top score is their label (scores [H, C, N, K])."""
    return (scores.argmax(-1) == data.labels) & data.mask


def accuracy_loss(scores: torch.Tensor, data: ClientData) -> tuple[torch.Tensor, torch.Tensor]:
    """Accuracy and mean cross-entropy of the scores over each client's valid rows: ([H, C], [H, C]). A score of
    -inf for a row's label (a class the model rules out) gives that row an infinite loss."""
    n = data.counts.clamp(min=1)  # [C]
    labels = data.labels.clamp(min=0).expand(*scores.shape[:-1])  # [H, C, N]
    ce = scores.logsumexp(-1) - scores.gather(-1, labels[..., None]).squeeze(-1)  # [H, C, N]
    loss = torch.where(data.mask, ce, 0.0).sum(-1) / n  # [H, C]
    return hits(scores, data).sum(-1) / n, loss
