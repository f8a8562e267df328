"""The local steps of a run, the one place that runs them: eager, or captured once per kind and replayed (the
capture protocol, and what a captured step may read and write: capture.py).

A step trains the round's cohort (cohort.py: its participants, [H, P] models, most local steps first) on their
next minibatches in one vmapped forward and backward, then the optimizer's masked update (models without a batch
keep their values) and the algorithm's `after_step`. Only the prefix of the cohort that still has a batch at that
step takes part ([H, n] views of every [H, P] tensor, no copy), so a round costs the steps its clients have, not P
times the largest client's. The runner's static slots hold the cohort's client ids and who of it trains `part`
[H, P], each (batch width, prefix)'s rows and validity, and each kind's context, refilled once per epoch of each
round.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch.func import vmap

from ..cache import ClientData
from .capture import Graphs, Static, disarmed, resolve_mode, signature
from .cohort import Cohort
from .guards import check_loss
from .hparams import HParams
from .optim import clip_grad_norms, clip_sets, group_of, optimizer_for
from .schedule import Plan

Params = dict[str, torch.Tensor]


class Held(NamedTuple):
    """The tensors a step updates in place: the current ones for an eager step, those of the moment of capture for
    a captured one (what a CUDA graph holds: one replaced since, rather than updated, shows up as a difference)."""

    params: Params  # name -> [H, C, ...] the optimizer's
    buffers: Params  # name -> [H, C, ...]
    acc: dict  # bad, loss, steps: [H, C] each, summed over a round


class Batch(NamedTuple):
    """One step's rows, for the prefix of n models that still has a batch: the fresh ones of an eager step, or a
    (batch width, n)'s static slots."""

    idx: torch.Tensor  # [H, n, B] rows of each model's client
    valid: torch.Tensor  # [n, B] or [H, n, B] rows that are real samples
    host: list | None  # [H][n] host bools: the models that step (eager steps; the fused optimizers group by it)


def prefix(tree: dict, n: int) -> dict:
    """The first n models of every [H, P, ...] tensor of a (nested) dict: [H, n, ...] views."""
    return {k: prefix(v, n) if isinstance(v, dict) else v[:, :n] if torch.is_tensor(v) else v for k, v in tree.items()}


def add_penalty(algo, loss: torch.Tensor, grads: Params, params: Params, ctx: dict) -> torch.Tensor:
    """The algorithm's `penalty` added to the stacked losses [H, n] (returned) and, in place and in their layouts,
    to the gradients name -> [H, n, ...]: the engine's step and the plain loop's (as [1, 1] stacks)."""
    term = algo.penalty({k: v.detach() for k, v in params.items()}, ctx)
    if term is None:
        return loss
    value, extra = term
    for k, g in extra.items():
        grads[k].add_(g)
    return loss + value


@dataclass
class _Context:
    """The static slot of one kind's context and the (call, epoch) it was last filled for."""

    slot: Static
    loaded: tuple


class LocalSteps:
    """Runs every local step of one engine: `start` a round, `step` per minibatch, `finish` the round."""

    cohort: Cohort  # the round's (`start`)

    def __init__(
        self,
        algo,
        optimizer: str,
        hp: HParams,
        data: ClientData,
        plan: Plan,
        state,
        P: int,
        capture: str | None = "auto",
    ):
        """Trains cohorts of P models per configuration (P = C: every client, the state's own tensors in place)."""
        device = data.features.device
        self.algo, self.data, self.plan = algo, data, plan
        self.loss_fn = vmap(vmap(algo.local_loss))  # [H, C] losses; summed, each model gets exactly its own gradient
        mode = resolve_mode(capture, device) if algo.capturable else "off"
        self.graphs = None if mode == "off" else Graphs(mode, device)  # the captured steps, by kind
        kind = optimizer_for(optimizer, device, masked=self.graphs is not None)
        H, C = next(iter(state.params.values())).shape[:2]
        # the state's own tensors where the cohort is all of it in order, else [H, P, ...] of the optimizer's own
        own = P == C and plan.order == sorted(plan.order)
        params = state.params if own else {k: v[:, :P] for k, v in state.params.items()}
        groups = {k: group_of(algo.groups, k) for k in params}  # name -> its optimizer Group
        self.opt = kind(params, hp, scale={k: algo.cfg.get(g.lr_scale, 1.0) for k, g in groups.items()}, groups=groups)
        self.clips = clip_sets(algo.groups, params)  # [(max_norm, names)] of the groups that clip
        self.buffers = {k: v[:, :P].clone() for k, v in state.buffers.items()}  # the cohort's buffers [H, P, ...]
        z = torch.zeros(H, P, device=device)
        self.acc = {"bad": z.bool(), "loss": z.clone(), "steps": z.clone()}  # [H, P] each, summed over a round
        self.part = torch.zeros(H, P, dtype=torch.bool, device=device)  # who of the cohort trains this round
        self.clients = torch.arange(P, device=device).repeat(H, 1)[..., None]  # [H, P, 1] the cohort's client ids
        self.valid: list = []  # per step, the cohort's real rows of its prefix: [n, B] or [H, n, B]
        self.host: list = []  # per step, host [H][n] bools: which of the prefix trains and still has a batch
        self.batches: dict[tuple, Batch] = {}  # (batch width, prefix) -> its slots
        self.contexts: dict[tuple, _Context] = {}  # kind -> its context slot
        self.calls = 0  # rounds started so far: when each context slot was last filled
        tensors = (data.features, data.labels, data.counts, data.views)
        self._fixed = frozenset(t.untyped_storage().data_ptr() for t in tensors if t is not None)  # stays put

    def start(self, state, now, cohort: Cohort) -> None:
        """Begin round `now`'s local steps for `cohort`: its starting models are copied into the optimizer's and the
        buffers' tensors (which `state` then holds where the cohort is everyone); the sums start from zero, moments
        and step counts too unless the algorithm `keeps_optimizer_state`."""
        # the cohort's models gathered straight into the optimizer's and the buffers' own tensors
        params = self.opt.load(cohort.take_into(self.opt.params, state.params), keep=self.algo.keeps_optimizer_state)
        buffers = cohort.take_into(self.buffers, state.buffers)
        if cohort.everyone:
            state.params, state.buffers = params, buffers
        for t in self.acc.values():
            t.zero_()
        self.calls += 1
        self.cohort = cohort
        self.part.copy_(now.part if cohort.everyone else now.part.gather(1, cohort.ids))  # [H, P]
        self.clients.copy_(cohort.ids[..., None])  # [H, P, 1]
        self.host, self.valid = [], []
        for has, valid in zip(self.plan.has_batch, self.plan.valid):
            host = [[p and has[c] for p, c in zip(ps, row)] for ps, row in zip(cohort.part, cohort.host)]  # [H][P]
            n = max((len(row) - row[::-1].index(True) for row in host if any(row)), default=0)  # last trainer + 1
            self.host.append([row[:n] for row in host])  # [H][n]: the cohort's step order makes it a prefix
            self.valid.append(cohort.take_clients(valid)[..., :n, :])  # [n, B] or [H, n, B]

    def step(self, idx: torch.Tensor, ctx: dict, at, frozen: frozenset) -> None:
        """One local step of every model on the rows idx [H, C, B] (step at.step of its epoch), with the epoch's
        context and `frozen` the names not trained, by the prefix of the cohort that still has a batch (none: no
        step): replayed where its kind is captured, else eager."""
        host, valid = self.host[at.step], self.valid[at.step]
        n = len(host[0])
        if n == 0:
            return None
        idx = idx[:, :n]  # [H, n, B]
        if self.graphs is not None:
            key = (frozen, idx.shape[-1], n, signature(ctx))
            if self.graphs.admits(key):
                return self._replay(self.graphs, key, idx, valid, ctx, at, frozen)
        # the live dicts: a fused optimizer's first step may give a parameter a new tensor that after_step must see
        return self._step(Held(self.opt.params, self.buffers, self.acc), Batch(idx, valid, host), ctx, at, frozen)

    def finish(self, state, aside: tuple = ()) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """End the round: the trained models into `state`, except the names `aside`, returned as the cohort's
        [H, P, ...] tensors in its order (valid until the next `start`); also returns which of the cohort's
        models' loss was NaN/Inf at some step and each one's mean loss over the steps it took (NaN where it took
        none), [H, P] each, on the device."""
        cohort = self.cohort
        # (the first step may have given a parameter its gradient's layout: the optimizer's dict is the live one)
        trained = self.opt.params | self.buffers  # name -> [H, P, ...]
        state.params = {
            k: state.params[k] if k in aside else cohort.put(state.params[k], v) for k, v in self.opt.params.items()
        }
        state.buffers = {
            k: state.buffers[k] if k in aside else cohort.put(state.buffers[k], v) for k, v in self.buffers.items()
        }
        acc = self.acc  # (the sums are zeroed and refilled next round)
        kept = {k: trained[k] for k in aside}  # name -> [H, P, ...] in the cohort's order
        return acc["bad"].clone(), acc["loss"] / acc["steps"], kept  # [H, P], [H, P]

    def _step(self, held: Held, batch: Batch, ctx: dict, at, frozen) -> None:
        """The step itself (eager, or the function a graph captures) on the prefix of n models that has a batch,
        updating `held` in place (the optimizer through its own tensors, which it slices as the gradients are)."""
        idx, n = batch.idx, batch.idx.shape[1]
        params, buffers, acc, ctx = (prefix(t, n) for t in (*held, ctx))  # [H, n, ...] views
        data, c_idx = self.data, self.clients[:, :n]  # [H, n, 1]
        valid = batch.valid.expand_as(idx)  # [H, n, B]
        active = valid.any(-1) & self.part[:, :n]  # [H, n]
        x = data.features[c_idx, idx]  # [H, n, B, D]
        y = data.labels[c_idx, idx]  # [H, n, B]
        extra = {"views": data.views[c_idx, idx]} if data.views is not None else {}  # [H, n, B, V, D]
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss, new_buffers = self.loss_fn(leaves, buffers, x, y, valid, ctx | extra)  # [H, n]
        grads = dict(zip(leaves, torch.autograd.grad(loss.sum(), list(leaves.values()), allow_unused=True)))
        grads = {k: torch.zeros_like(leaves[k]) if g is None else g for k, g in grads.items()}
        loss = add_penalty(self.algo, loss.detach(), grads, params, ctx)  # [H, n]
        check_loss(self.algo, loss, active.shape)
        grads = clip_grad_norms(grads, self.clips, frozen)  # per model and group, where a group declares a norm
        acc["bad"] |= ~torch.isfinite(loss) & active  # [H, n] read once, after the round
        acc["loss"] += torch.where(active, loss, 0.0)  # [H, n]
        acc["steps"] += active  # [H, n]
        with torch.no_grad():
            self.opt.step(grads, active, frozen, batch.host)  # in place
            self.algo.after_step(prefix(held.params, n), ctx, active, at)  # (the step may have relaid a parameter)
            for k, v in new_buffers.items():
                buffers[k].copy_(torch.where(active.reshape(*active.shape, *[1] * (v.dim() - 2)), v, buffers[k]))

    def _replay(self, graphs: Graphs, key: tuple, idx: torch.Tensor, valid, ctx: dict, at, frozen) -> None:
        """The step through the graph of its kind (trained names, batch width, prefix, context structure): this
        step's rows and, once per epoch, its context go into the static slots, then the graph replays; a kind seen
        for the first time is captured (warm-up disarmed: no model takes part)."""
        width = (idx.shape[-1], idx.shape[1])
        if width not in self.batches:
            self.batches[width] = Batch(idx.clone(), valid.clone(), None)
        slot = self.batches[width]
        slot.idx.copy_(idx)  # [H, n, B]
        slot.valid.copy_(valid)  # [n, B] or [H, n, B]
        stamp = (self.calls, at.epoch)  # the context changes between epochs and rounds only
        if key not in graphs:
            context = self.contexts[key] = _Context(Static(ctx, self._fixed), stamp)
            held = Held(dict(self.opt.params), dict(self.buffers), dict(self.acc))
            now = replace(at, part=self.part)  # the Round the captured hooks see (its step: the capture's)
            fn = lambda: self._step(held, slot, context.slot.tree, now, frozen)
            graphs.capture(key, fn, disarmed(self.part))
        elif self.contexts[key].loaded != stamp:
            self.contexts[key].slot.load(ctx)
            self.contexts[key].loaded = stamp
        graphs.run(key)
