"""The one round loop. Every algorithm runs here; algorithms only supply hooks (see algorithms/base.py).

Models carry two leading axes [H, C]: H configurations (hyperparameter settings x seeds) and C clients. One round:

    local epochs of the round's participants -> after_local -> upload -> aggregate over clients of each configuration
    -> download -> evaluate

`Engine.run` is that loop, top to bottom, over a client backend (`Clients`). `Vectorized`, the default, trains the
round's participants, H*P models, in one vmapped step per minibatch (`LocalSteps`, steps.py: eager or captured as CUDA
graphs) on the round's cohort (cohort.py: its participants gathered from the [H, C] state and written back, in slices of
`at_once` where memory asks for it; with FedAvg's server the shared tensors go to the server as trained instead) and
scores every model at once (evaluate.py). plain.py's `Plain` trains and scores each client alone in plain torch
(`featcache.testing.plain_loop`, the reference), featcache.flower's `Transport` sends clients messages. Every backend
runs the same loop: participation and the minibatch plan (schedule.py), the NaN check of the round's mean local loss
(read back once per round), the server side, evaluation every `eval_every` rounds and after the last, records, timings,
progress. Hooks get a read-only `Round` and never see the engine; the hooks' order is written once, here:
`initial_state`, the local epochs, `client_side`, `server_side` (the footprint's replay calls them too).

What the loop carries from one round to the next is the engine's `state_dict` (the `State`, the local optimizer's
state and the loop's records): a checkpoint saves it and `load_state_dict` goes on from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import NamedTuple

import torch

from ..cache import ClientData
from ..devices import resolve_device
from .cohort import Cohort, aside_names, cohort_size, models_like, put_models, slice_size
from .config import batched
from .evaluate import live_metrics, record
from .guards import Diverged, nan_cause
from .hparams import HParams
from .models import Params, expand_hc
from .schedule import batch_order, evaluates, participation, plan_steps, took_part
from .steps import LocalSteps

BUILTIN = f"{__name__.split('.')[0]}.algorithms."  # the modules of featcache's own algorithms


@dataclass
class State:
    """Everything that evolves over rounds; tensors lead with [H, C] (models) except `server` ([H, ...])."""

    params: Params  # updated in place by the optimizer during local training: clone what you keep across rounds
    buffers: Params  # likewise updated in place during local training (BN statistics): clone what you keep
    client: dict = field(default_factory=dict)  # per-model algorithm state, e.g. local prototypes [H, C, K, d]
    server: dict = field(default_factory=dict)  # per-config server state, e.g. global prototypes [H, K, d]

    def groups(self) -> dict:
        """The four groups by name (params, buffers, client, server), as the live trees."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
    hp: HParams  # per-configuration hyperparameters, name -> [H] float32
    cfg: MappingProxyType  # the run's shared (structural) settings, read-only
    data: ClientData  # the clients' training data (padded [C, Nmax, ...] + counts [C])
    device: torch.device
    clients: torch.Tensor | None = None  # [H, P] int64 the participants' ids where they are not every client

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """[H, ...] -> [H, C, ...] (a view): a per-configuration value for every client."""
        return expand_hc(t, self.C)


@dataclass(frozen=True)
class Frame:
    """The facts every `Round` of a run shares; `round` cuts one. The engine's, and the footprint's (on the meta
    device): both make their Rounds here."""

    steps_per_epoch: int
    client_steps: torch.Tensor  # [C]
    seeds: torch.Tensor  # [H] on the host
    hp: HParams
    cfg: MappingProxyType  # the shared settings (`rounds` among them)
    data: ClientData
    device: torch.device

    def round(self, rnd: int, part=None, epoch: int = 0, step: int = 0) -> Round:
        """The `Round` of round `rnd` (-1: before round 1); part [H, C] bool, host lists or a tensor (default: every
        client)."""
        H, C = len(self.seeds), self.data.features.shape[0]
        clients = None  # [H, P] from host lists where every configuration has P < C participants
        if part is None:
            part = torch.ones(H, C, dtype=torch.bool, device=self.device)
        elif not torch.is_tensor(part):
            ids = [[c for c, p in enumerate(row) if p] for row in part]
            if len({len(row) for row in ids}) == 1 and len(ids[0]) < C:
                clients = torch.tensor(ids, device=self.device)
            part = torch.tensor(part, dtype=torch.bool)
        return Round(
            round=rnd,
            rounds=self.cfg["rounds"],
            epoch=epoch,
            step=step,
            steps_per_epoch=self.steps_per_epoch,
            client_steps=self.client_steps,
            part=part.to(self.device),
            H=H,
            C=C,
            seeds=self.seeds,
            hp=self.hp,
            cfg=self.cfg,
            data=self.data,
            device=self.device,
            clients=clients,
        )


class Local(NamedTuple):
    """What a round's local training computed (`Clients.fit`), on the device."""

    bad: torch.Tensor  # [H, C] bool: the models whose loss was NaN/Inf at some step
    loss: torch.Tensor  # [H, C] each model's mean loss over the steps it took (NaN where it took none)
    now: Round  # the round's context
    # (uploads name -> [H, P or C, ...], weights [H, P or C]) where the backend ran the clients' side or set the
    # participants' trained tensors aside; None: the clients' side runs on the state (`client_side`)
    sent: tuple[dict, torch.Tensor] | None = None


@dataclass
class Loop:
    """The round loop's records so far: per evaluation round its record (`evaluate.record`) and round number, per
    round the floats one client uploaded and the seconds it took."""

    records: list[dict] = field(default_factory=list)
    eval_rounds: list[int] = field(default_factory=list)
    upload_floats: list[int] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)

    def result(self) -> dict:
        """The records stacked over the evaluation rounds ([R_eval, H, C] each, None where a record holds None),
        `acc` the test accuracy, beside the evaluation rounds, upload sizes and timings."""
        first = self.records[0]
        stacked = {k: None if first[k] is None else torch.stack([r[k] for r in self.records]) for k in first}
        return stacked | {
            "acc": stacked["test_acc"],
            "eval_rounds": self.eval_rounds,
            "upload_floats": self.upload_floats,
            "round_seconds": self.round_seconds,
        }


# -- the hooks, in the order every round runs them ----------------------------------------------------------------
def setup(algo, cfgs: list[dict], data: ClientData, device: torch.device):
    """(`algo` bound to the shared settings of configurations `cfgs`, the minibatch plan, the run's `Frame`) on
    `data` (on `device`): the engine's, and a Flower client's of its own rows."""
    cfg, floats = batched(cfgs, algo)  # the shared settings; name -> [H] the per-configuration floats
    plan = plan_steps(data, cfg["batch_size"], cfg["drop_last"])
    seeds = torch.tensor([c["seed"] for c in cfgs])  # [H] on the host
    frame = Frame(plan.steps, plan.client_steps, seeds, HParams.of(floats, device), cfg, data, device)
    return algo.bind(cfg), plan, frame


def first_models(algo, frame: Frame) -> list[tuple[Params, Params]]:
    """Round 1's model of each configuration, `algo.init`'s from its own seed."""
    d_in, K = frame.data.features.shape[-1], frame.data.num_classes
    return [algo.init(frame.cfg, d_in, K, torch.Generator().manual_seed(int(s))) for s in frame.seeds]


def initial_state(algo, models: list[tuple[Params, Params]], frame: Frame) -> State:
    """Round 1's state: one model per configuration (`models`: `algo.init`'s (params, buffers) each), broadcast to
    its clients (a client's own copy is made when it first changes), then the algorithm's `init_state`."""
    C = frame.data.features.shape[0]
    stack = lambda trees: {k: expand_hc(torch.stack([t[k] for t in trees]).to(frame.device), C) for k in trees[0]}
    state = State(params=stack([p for p, _ in models]), buffers=stack([b for _, b in models]))
    algo.init_state(state, frame.round(-1))
    return state


def client_side(algo, state: State, now: Round) -> dict:
    """After local training, on the clients: `after_local`, then what each client sends, name -> [H, C, ...]."""
    algo.after_local(state, now)
    return algo.upload(state, now)


def server_side(algo, state: State, now: Round, uploads: dict, weights: torch.Tensor):
    """On the server: `aggregate` the uploads over each configuration's clients (weights [H, C] or [H, P], 0 where
    absent) and `download` the result to the clients; returns that result (what a client downloads)."""
    server = algo.aggregate(uploads, weights, state, now)
    algo.download(state, server, now)
    return server


def take_models(saved: dict, keep: list[int]) -> dict:
    """The `state_dict` of the models `keep` (indices into H, in order) alone: the State's tensors, the optimizer's
    (host step counts too) and the loop's records taken on their leading H axis. Layouts are kept where kernels read
    them (a broadcast over clients stays one, each model's block keeps its strides) and so is memory that two entries
    share, so a fresh Engine of those models' configurations that loads it goes on as if it had trained them alone (a
    search's pruned trials leave the batch this way)."""
    memo: dict = {}

    def rows(t: torch.Tensor) -> torch.Tensor:
        at = (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if at not in memo:
            memo[at] = _take_rows(t, keep)
        return memo[at]

    def tree(x, lists: bool = False):
        if torch.is_tensor(x):
            return rows(x)
        if isinstance(x, dict):
            return {k: tree(v, lists) for k, v in x.items()}
        return [x[i] for i in keep] if lists and isinstance(x, list) else x  # host per-model lists: [H][C] counts

    out = {k: tree(saved[k]) for k in ("params", "buffers", "client", "server")}
    loop = dict(saved["loop"]) | {"records": [tree(r) for r in saved["loop"]["records"]]}
    return out | {"optimizer": tree(saved["optimizer"], lists=True), "loop": loop}


def _take_rows(t: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """t [H, ...] at rows `keep`, in t's layout: a broadcast over dim 1 (clients) re-expanded, a model block dense
    with H outermost copied into the same strides; anything else a contiguous copy."""
    index = torch.tensor(keep, dtype=torch.long, device=t.device)
    if t.dim() >= 2 and t.stride(1) == 0 and t.shape[1] > 1:
        return _take_rows(t.select(1, 0), keep).unsqueeze(1).expand(len(keep), *t.shape[1:])
    picked = t.index_select(0, index)
    if t.dim() < 2 or t.numel() == 0 or t.stride(0) * t.shape[0] != t.numel() or t.is_contiguous():
        return picked
    out = t.new_empty(len(keep) * t.stride(0)).as_strided(picked.shape, t.stride())
    return out.copy_(picked)


class Clients:
    """A client backend: how the round loop (`Engine.run`) runs a round's clients. The defaults are those of clients
    in this process that share the engine's `State` (its `download` is theirs); a backend declares what it cannot
    run (`refuse`)."""

    aside: tuple[str, ...] = ()  # the names whose participants' tensors go to the server as trained (`Vectorized`)

    def refuse(self, algo, H: int) -> None:
        """Raise a `UserError` (one line) where these clients cannot run the bound `algo` over H configurations."""

    def initial(self, algo):
        """The algorithm whose `init_state` makes round 1's state on the engine's side."""
        return algo

    def fit(self, eng: Engine, state: State, now: Round, part: list, aside: tuple = ()) -> Local:
        """Round `now`'s local epochs of its participants `part` ([H][C] host bools): `state` trained in place,
        except the names `aside` (returned in `Local.sent`)."""
        raise NotImplementedError

    def take(self, eng: Engine, now: Round, server) -> None:
        """Every client's `download` of what the server aggregated (`server_side`), where it holds its own state."""

    def score(self, eng: Engine, now: Round, round_loss: torch.Tensor, logs: bool) -> dict:
        """The evaluation record after round `now` (`evaluate.record`'s keys; only test_acc without `logs`)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The clients' optimizer state a checkpoint saves (`load_state_dict` takes it back)."""
        raise NotImplementedError(f"{type(self).__name__} clients are not checkpointed")

    def load_state_dict(self, saved: dict) -> None:
        self.state_dict()


class Vectorized(Clients):
    """The default backend: every participant of every configuration in one vmapped step per minibatch, scored all
    at once."""

    def __init__(self, eng: Engine, capture: str | None, at_once: int | None):
        """`at_once`: the most models per configuration one pass of local training holds (None: all the round's
        participants); a round trains its participants in slices of that many, with the same result."""
        algo, keeps = eng.algo, eng.algo.keeps_optimizer_state
        self.P = cohort_size(eng.C, eng.cfg["participation"], keeps)  # models trained per configuration
        self.at_once = S = slice_size(self.P, at_once, keeps)
        # the shared tensors `serve` reads from the participants as they trained, never written into the [H, C] state
        self.aside = aside_names(algo, eng.state, eng.C, self.P)
        self.sent: dict = {}  # name -> [H, P, ...] the participants' tensors `aside` as trained, reused every round
        self.runner = LocalSteps(algo, eng.cfg["optimizer"], eng.hp, eng.train, eng.plan, eng.state, S, capture)
        self._seeds = eng.seeds.to(eng.device)  # [H] for batch orders built on the device

    def fit(self, eng: Engine, state: State, now: Round, part: list, aside: tuple = ()) -> Local:
        """Nothing in here reads a device tensor back (`Engine.read_round` does, once)."""
        algo, data, plan, N = eng.algo, eng.train, eng.plan, eng.train.features.shape[1]
        bad = torch.zeros(eng.H, eng.C, dtype=torch.bool, device=eng.device)  # [H, C]
        loss = torch.full((eng.H, eng.C), torch.nan, device=eng.device)  # [H, C]
        sent = self.sent
        for cohort in Cohort.slices(part, self.P, self.at_once, eng.device, plan.order):  # [H, S] models
            self.runner.start(state, now, cohort)
            for epoch in range(algo.local_epochs()):
                at = replace(now, epoch=epoch)
                frozen = frozenset(k for k in state.params if not algo.trainable(k, at))
                ctx = cohort.take_tree(algo.context(state, at))  # server and client state do not change in local steps
                ids = None if cohort.everyone else cohort.ids
                order = batch_order(self._seeds, now.round, epoch, data.counts, N, ids)  # [H, P, N]
                for s in range(plan.steps):
                    self.runner.step(plan.rows(order, s), ctx, replace(at, step=s), frozen)  # rows [H, P, B]
            done, mean, trained = self.runner.finish(state, aside)  # [H, S], [H, S], name -> [H, S, ...]
            bad, loss = cohort.put(bad, done), cohort.put(loss, mean)
            if aside and cohort.real == self.P and all(row == sorted(row) for row in cohort.host):
                sent = trained  # every participant, in id order: the uploads are the trained tensors themselves
            elif aside:  # each slice's real models into their places among the participants (P < C: listed)
                assert now.clients is not None
                places = torch.searchsorted(now.clients, cohort.ids[:, : cohort.real])  # [H, real]
                for k, t in trained.items():  # (one buffer for the run: a new one each round would fragment the heap)
                    put_models(self.sent.setdefault(k, models_like(t, self.P)), places, t[:, : cohort.real])
        return Local(bad, loss, now, (dict(sent), data.counts[now.clients].float()) if aside else None)  # [H, C]

    def score(self, eng: Engine, now: Round, round_loss: torch.Tensor, logs: bool) -> dict:
        """Where `predict` is personal, clients that took part in no round since the last evaluation keep its
        figures."""
        loop, algo, rate = eng.loop, eng.algo, eng.cfg["participation"]
        last = loop.records[-1] if loop.records and algo.personal_predict else None
        stale = None if last is None else took_part(eng.seeds, loop.eval_rounds[-1], now.round, eng.C, rate)
        first = not loop.records
        return record(algo, eng.state, eng.train, eng.test, now, round_loss, logs, first, last, stale, self.at_once)

    def state_dict(self) -> dict:
        return self.runner.opt.state_dict()

    def load_state_dict(self, saved: dict) -> None:
        self.runner.opt.load_state_dict(saved)


class Engine:
    """Trains H configurations x C clients of one algorithm on cached features."""

    def __init__(
        self,
        algo,
        cfgs: list[dict],
        train: ClientData,
        test: ClientData,
        device: str | torch.device = "cpu",
        capture: str | None = "auto",
        at_once: int | None = None,
        clients: Clients | None = None,
    ):
        """`clients`: the client backend (default: `Vectorized(capture, at_once)`)."""
        self.cfgs, self.device = cfgs, resolve_device(device)
        self.train, self.test = train.to(self.device), test.to(self.device)
        self.algo, self.plan, self.frame = setup(algo, cfgs, self.train, self.device)  # a bound copy of `algo`
        self.cfg, self.seeds, self.hp = self.frame.cfg, self.frame.seeds, self.frame.hp  # shared; [H] host; [H]
        self.H, self.C = len(cfgs), train.features.shape[0]
        self.clients = clients or Clients()  # `Vectorized` below, once the state it trains exists
        self.clients.refuse(self.algo, self.H)
        self.state = self.init_state()  # trained in place by `run`
        if clients is None:
            self.clients = Vectorized(self, capture, at_once)
        self.loop = Loop()  # the records so far
        self.last_round: Round | None = None  # the context of the last round run

    def state_dict(self) -> dict:
        """What the round loop carries from one round to the next (a checkpoint's content), as the live objects: the
        `State` groups, the local optimizer's `state_dict` and the loop's records. Their memory layouts are part of
        it (strides, broadcast views, which tensors share memory): kernels round differently on another layout."""
        return self.state.groups() | {"optimizer": self.clients.state_dict(), "loop": dict(vars(self.loop))}

    def load_state_dict(self, saved: dict) -> None:
        """Go on from a `state_dict` (tensors on this engine's device, in the layouts they were saved in), before the
        first round this engine runs."""
        self.state = State(**{k: saved[k] for k in self.state.groups()})
        self.clients.load_state_dict(saved["optimizer"])
        self.loop = Loop(**saved["loop"])

    def round_context(self, rnd: int, part=None, epoch: int = 0, step: int = 0) -> Round:
        """The `Round` of round `rnd` (`Frame.round`)."""
        return self.frame.round(rnd, part, epoch, step)

    def init_state(self) -> State:
        """The models of round 1, each configuration from its own seed, and the algorithm's initial state."""
        return initial_state(self.clients.initial(self.algo), first_models(self.algo, self.frame), self.frame)

    def local_train(self, state: State, rnd: int, part, aside: tuple = ()) -> Local:
        """Round `rnd`'s local epochs for its participants `part` [H][C] bool, host data (nested lists, or a CPU
        tensor), run by the client backend (`Clients.fit`). The names `aside` stay out of `state`: the participants'
        trained tensors are returned in `Local.sent`."""
        part = part.tolist() if torch.is_tensor(part) else part
        return self.clients.fit(self, state, self.round_context(rnd, part), part, aside)

    def read_round(self, local: Local, rnd: int) -> torch.Tensor:
        """One device read per round: refuse to go on when any model's loss was NaN/Inf; return the round's mean
        local training loss [H, C] on the host (NaN for models that sat the round out)."""
        both = torch.stack([local.bad.to(local.loss.dtype), local.loss]).cpu()  # [2, H, C]
        if bool(both[0].any()):
            bad = both[0].any(1).nonzero().flatten().tolist()
            raise Diverged(nan_cause(self.algo, self.cfgs, bad, rnd), bad)
        return both[1]

    def serve(self, state: State, local: Local) -> int:
        """The round's server side over each configuration's participants, on what they sent (`Local.sent`), or on
        the clients' side run on `state`; every client then takes the result (`Clients.take`). Returns the floats
        one client uploads."""
        now = local.now
        if local.sent is None:
            uploads, weights = client_side(self.algo, state, now), self.train.counts[None].float() * now.part  # [H, C]
        else:
            uploads, weights = local.sent
        self.clients.take(self, now, server_side(self.algo, state, now, uploads, weights))  # weights [H, C] or [H, P]
        return sum(v[0, 0].numel() for v in uploads.values())

    def evaluate(self, now: Round, round_loss: torch.Tensor, logs: bool) -> dict:
        """Record an evaluation after round `now` (`Clients.score`); returns `live_metrics`'s figures."""
        loop, algo = self.loop, self.algo
        try:
            figures = self.clients.score(self, now, round_loss, logs)
        except Diverged as e:  # NaN scores: a built-in's models diverged; a plug-in's first ones may be its bug
            if loop.records or type(algo).__module__.startswith(BUILTIN):
                raise Diverged(nan_cause(algo, self.cfgs, e.models, now.round, "the scores"), e.models) from None
            raise
        loop.records.append(figures)
        loop.eval_rounds.append(now.round + 1)
        return live_metrics(self.seeds, figures["test_acc"], round_loss)

    def run(self, progress=None, logs: bool = True, checkpoint=None, until: int | None = None) -> dict:
        """Train all rounds, calling `progress(round, rounds, live)` after each (`live`: `evaluate`'s figures at an
        evaluation round, else None); returns `Loop.result` (acc = test_acc [R_eval, H, C], test_loss, train_acc,
        train_loss [R_eval, H, C], global_acc [R_eval, H] or None, the evaluation rounds, upload sizes, timings).
        logs=False records test accuracy only: a grid's selection needs nothing else, and the other records add a
        forward pass over every training row per evaluation. `checkpoint` (runs.checkpoint.Checkpoint) loads the
        `state_dict` its file holds, and is offered the `state_dict` at the start of each round to save. `until` stops
        after that many rounds (default: all; a search's rung), and a later call goes on from there."""
        if checkpoint:
            checkpoint.restore(self.state_dict, self.load_state_dict)
        R = self.cfg["rounds"]
        end = R if until is None else min(until, R)
        for rnd in range(len(self.loop.round_seconds), end):  # from round 1, or where the checkpoint left off
            if checkpoint:
                checkpoint.offer(rnd, self.state_dict)
            t0 = time.perf_counter()
            part = participation(self.seeds, rnd, self.C, self.cfg["participation"]).tolist()  # [H][C] host
            local = self.local_train(self.state, rnd, part, self.clients.aside)
            round_loss = self.read_round(local, rnd)  # [H, C] host
            now = self.last_round = local.now
            self.loop.upload_floats.append(self.serve(self.state, local))
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.loop.round_seconds.append(time.perf_counter() - t0)
            live = self.evaluate(now, round_loss, logs) if evaluates(rnd, self.cfg) else None
            if progress:
                progress(rnd + 1, R, live)
        return self.loop.result()
