"""The one round loop. Every algorithm runs here; algorithms only supply hooks (see algorithms/base.py).

Models carry two leading axes [H, C]: H configurations (hyperparameter settings x seeds) and C clients. One round:

    broadcast context -> local epochs (the round's participants, H*P models, in one vmapped step per minibatch)
    -> after_local -> upload -> aggregate over clients of each configuration -> download -> evaluate

The local steps run in `LocalSteps` (steps.py: eager or captured as CUDA graphs) on the round's cohort (cohort.py:
its participants gathered from the [H, C] state and written back, in slices of `at_once` where memory asks for it;
with FedAvg's server the shared tensors go to `serve` instead), the minibatch plan comes from schedule.py,
evaluation (every `eval_every` rounds and after the last) from evaluate.py; the round's mean local training loss is
accumulated on the device and read back once per round with the NaN check. Hooks get a read-only `Round` and never
see the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from ..cache import ClientData
from ..devices import resolve_device
from ..errors import UserError
from .config import shared_settings, structural_keys
from .evaluate import record
from .guards import nan_cause
from .hparams import HParams
from .cohort import Cohort, cohort_size, sets_aside, slice_size
from .models import Params, expand_hc
from .schedule import batch_order, participation, plan_steps
from .steps import LocalSteps

STATE_GROUPS = ("params", "buffers", "client", "server")


@dataclass
class State:
    """Everything that evolves over rounds; tensors lead with [H, C] (models) except `server` ([H, ...])."""

    params: Params  # updated in place by the optimizer during local training: clone what you keep across rounds
    buffers: Params  # likewise updated in place during local training (BN statistics): clone what you keep
    client: dict = field(default_factory=dict)  # per-model algorithm state, e.g. local prototypes [H, C, K, d]
    server: dict = field(default_factory=dict)  # per-config server state, e.g. global prototypes [H, K, d]


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
    ):
        """`at_once`: the most models per configuration one pass of local training holds (None: all the round's
        participants); a round trains its participants in slices of that many, with the same result."""
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
        self.seeds = torch.tensor([c["seed"] for c in cfgs])  # [H] on the host
        self._seeds = self.seeds.to(self.device)  # [H] for batch orders built on the device
        floats = [k for k in cfgs[0] if k not in structural and k != "seed"]
        self.hp = HParams.of({k: [float(c[k]) for c in cfgs] for k in floats}, self.device)  # name -> [H]
        self.plan = plan_steps(self.train, self.cfg["batch_size"], self.cfg["drop_last"])
        self.state = self.init_state()  # trained in place by `run`
        self.P = cohort_size(self.C, self.cfg["participation"], self.algo.keeps_optimizer_state)  # models trained
        self.at_once = slice_size(self.P, at_once, self.algo.keeps_optimizer_state)
        # the shared tensors `serve` reads from the participants as they trained, never written into the [H, C] state
        names = (*self.state.params, *self.state.buffers)
        self.aside = (
            tuple(k for k in names if self.algo.shared(k))
            if sets_aside(self.algo, self.C, self.P, self.at_once)
            else ()
        )
        self.runner = LocalSteps(
            self.algo, self.cfg["optimizer"], self.hp, self.train, self.plan, self.state, self.at_once, capture
        )
        self.last_round: Round | None = None  # the context of the last round run
        self.round_loss: torch.Tensor | None = None  # [H, C] the last local_train's mean loss per model (device)
        self.uploads: dict = {}  # name -> [H, P, ...] the last local_train's participants' tensors set aside

    def state_dict(self) -> dict:
        """What the round loop carries from one round to the next (a checkpoint's content): the `State` groups and
        the local optimizer's `state_dict`, as the live tensors. Their memory layouts are part of it (strides,
        broadcast views, which tensors share memory): kernels round differently on another layout."""
        groups = {group: getattr(self.state, group) for group in STATE_GROUPS}
        return groups | {"optimizer": self.runner.opt.state_dict()}

    def load_state_dict(self, saved: dict) -> None:
        """Go on from a `state_dict` (tensors on this engine's device, in the layouts they were saved in), before the
        first round this engine runs."""
        for group in STATE_GROUPS:
            setattr(self.state, group, saved[group])
        self.runner.opt.load_state_dict(saved["optimizer"])

    def round_context(self, rnd: int, part=None, epoch: int = 0, step: int = 0) -> Round:
        """The `Round` of round `rnd` (-1: before round 1); part [H, C] bool, host lists or a tensor (default: every
        client)."""
        clients = None  # [H, P] from host lists where every configuration has P < C participants
        if part is None:
            part = torch.ones(self.H, self.C, dtype=torch.bool, device=self.device)
        elif not torch.is_tensor(part):
            ids = [[c for c, p in enumerate(row) if p] for row in part]
            if len({len(row) for row in ids}) == 1 and len(ids[0]) < self.C:
                clients = torch.tensor(ids, device=self.device)
            part = torch.tensor(part, dtype=torch.bool)
        return Round(
            round=rnd,
            rounds=self.cfg["rounds"],
            epoch=epoch,
            step=step,
            steps_per_epoch=self.plan.steps,
            client_steps=self.plan.client_steps,
            part=part.to(self.device),
            H=self.H,
            C=self.C,
            seeds=self.seeds,
            hp=self.hp,
            cfg=self.cfg,
            data=self.train,
            device=self.device,
            clients=clients,
        )

    def init_state(self) -> State:
        """The models of round 1, each configuration from its own seed, and the algorithm's initial state."""
        d_in, K = self.train.features.shape[-1], self.train.num_classes
        per_h = [self.algo.init(self.cfg, d_in, K, torch.Generator().manual_seed(int(s))) for s in self.seeds]
        # one model per configuration, broadcast to its clients: a client's own copy is made when it first changes
        stack = lambda dicts: {
            k: expand_hc(torch.stack([d[k] for d in dicts]).to(self.device), self.C) for k in dicts[0]
        }
        state = State(params=stack([p for p, _ in per_h]), buffers=stack([b for _, b in per_h]))
        self.algo.init_state(state, self.round_context(-1))
        return state

    def local_train(self, state: State, rnd: int, part, aside: tuple = ()) -> torch.Tensor:
        """The round's local epochs for its participants. `part` [H][C] bool is host data (nested lists, or a CPU
        tensor), so nothing in here reads a device tensor back: returns the models whose loss was NaN/Inf at some
        step, [H, C] bool on the device, and leaves each model's mean loss in `self.round_loss` ([H, C] on the
        device, NaN where a model took no step), for the caller to read once per round (`read_round`). The names
        `aside` stay out of `state`: the participants' trained tensors go to `self.uploads` ([H, P, ...])."""
        algo, data, part_host = self.algo, self.train, part.tolist() if torch.is_tensor(part) else part
        now = self.round_context(rnd, part_host)
        bad = torch.zeros(self.H, self.C, dtype=torch.bool, device=self.device)  # [H, C]
        self.round_loss = torch.full((self.H, self.C), torch.nan, device=self.device)  # [H, C]
        for cohort in Cohort.slices(part_host, self.P, self.at_once, self.device):  # the models trained: [H, P]
            self.runner.start(state, now, cohort)
            for epoch in range(algo.local_epochs()):
                at = replace(now, epoch=epoch)
                frozen = frozenset(k for k in state.params if not algo.trainable(k, at))
                ctx = cohort.take_tree(algo.context(state, at))  # server and client state do not change in local steps
                order = batch_order(
                    self._seeds,
                    rnd,
                    epoch,
                    data.counts,
                    data.features.shape[1],
                    None if cohort.everyone else cohort.ids,
                )  # [H, P, N]
                for s in range(self.plan.steps):
                    self.runner.step(self.plan.rows(order, s), ctx, replace(at, step=s), frozen)  # rows [H, P, B]
            done, loss, self.uploads = self.runner.finish(state, aside)  # [H, P], [H, P], name -> [H, P, ...]
            bad, self.round_loss = cohort.put(bad, done), cohort.put(self.round_loss, loss)
        return bad

    def read_round(self, bad: torch.Tensor, rnd: int) -> torch.Tensor:
        """One device read per round: refuse to go on when any model's loss was NaN/Inf (bad [H, C]); return the
        round's mean local training loss [H, C] on the host (NaN for models that sat the round out)."""
        both = torch.stack([bad.to(self.round_loss.dtype), self.round_loss]).cpu()  # [2, H, C]
        if bool(both[0].any()):
            raise UserError(nan_cause(self.algo, self.cfgs, both[0].any(1).nonzero().flatten().tolist(), rnd))
        return both[1]

    def serve(self, state: State, now: Round) -> int:
        """The round's server side: after_local, upload, aggregate over each configuration's participants, download.
        Returns the floats one client uploads (the uploads themselves are freed on return)."""
        algo = self.algo
        if self.aside:  # FedAvg's server: the participants' uploads [H, P, ...] as trained
            uploads, weights = self.uploads, self.train.counts[now.clients].float()  # [H, P]
        else:
            algo.after_local(state, now)
            uploads = algo.upload(state, now)  # name -> [H, C, ...]
            weights = self.train.counts[None].float() * now.part  # [H, C]
        algo.download(state, algo.aggregate(uploads, weights, state, now), now)
        self.uploads = {}
        return sum(v[0, 0].numel() for v in uploads.values())

    def trained_since(self, start: int, rnd: int) -> list:
        """[H][C] host bools: the clients that took part in any of rounds start..rnd (0-based, inclusive), from the
        seeded draws (so a resumed run knows them too)."""
        part = torch.zeros(self.H, self.C, dtype=torch.bool)
        for r in range(start, rnd + 1):
            part |= participation(self.seeds, r, self.C, self.cfg["participation"])
        return part.tolist()

    def live_metrics(self, test_acc: torch.Tensor, round_loss: torch.Tensor) -> dict:
        """What an evaluation round tells a watcher, per configuration (host floats): the seed, the client-mean test
        accuracy in % and the mean local training loss over the clients that took part (test_acc, round_loss [H, C])."""
        return {
            "seeds": self.seeds.tolist(),
            "test_acc": (100 * test_acc.double().mean(1)).tolist(),
            "train_loss": round_loss.double().nanmean(1).tolist(),
        }

    def run(self, progress=None, logs: bool = True, checkpoint=None) -> dict:
        """Train all rounds, calling `progress(round, rounds, live)` after each (`live`: `live_metrics` at an
        evaluation round, else None); returns, stacked over the evaluation rounds, the records of `evaluate.record` (acc
        = test_acc [R_eval, H, C], test_loss, train_acc, train_loss [R_eval, H, C], global_acc [R_eval, H] or None),
        the evaluation rounds, upload sizes and timings. logs=False records test accuracy only: a grid's selection
        needs nothing else, and the other records add a forward pass over every training row per evaluation.
        `checkpoint` (checkpoint.Checkpoint) resumes the loop where its file left it and may save the loop's state,
        `carried`, at the start of each round."""
        state, algo, R = self.state, self.algo, self.cfg["rounds"]
        records, rounds, upload_floats, times = [], [], [], []
        carried = {"records": records, "eval_rounds": rounds, "upload_floats": upload_floats, "round_seconds": times}
        first = checkpoint.restore(self, carried) if checkpoint else 0
        for rnd in range(first, R):
            if checkpoint:
                checkpoint.offer(self, rnd, carried)
            t0 = time.perf_counter()
            part_host = participation(self.seeds, rnd, self.C, self.cfg["participation"]).tolist()  # [H][C] host
            round_loss = self.read_round(self.local_train(state, rnd, part_host, self.aside), rnd)  # [H, C] host
            now = self.last_round = self.round_context(rnd, part_host)
            upload_floats.append(self.serve(state, now))
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            live = None
            if (rnd + 1) % self.cfg["eval_every"] == 0 or rnd == R - 1:
                last = records[-1] if records and algo.personal_predict else None  # its figures kept where unchanged
                records.append(
                    record(
                        algo,
                        state,
                        self.train,
                        self.test,
                        now,
                        round_loss,
                        logs,
                        first=not records,
                        last=last,
                        stale=None if last is None else self.trained_since(rounds[-1], rnd),
                        width=self.at_once,
                    )
                )
                rounds.append(rnd + 1)
                live = self.live_metrics(records[-1]["test_acc"], round_loss)
            if progress:
                progress(rnd + 1, R, live)
        stacked = {k: None if records[0][k] is None else torch.stack([r[k] for r in records]) for k in records[0]}
        return stacked | {
            "acc": stacked["test_acc"],
            "eval_rounds": rounds,
            "upload_floats": upload_floats,
            "round_seconds": times,
        }
