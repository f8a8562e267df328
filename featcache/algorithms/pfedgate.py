"""pFedGate (Chen et al., "Efficient Personalized Federated Learning via Sparse Model-Adaptation", ICML 2023) as
released (yxdyc/pFedGate, at the commit featcache/algorithms/README.md names): pFedGate/gated_learner.py (GatedLearner),
models/gating_layers.py (GatingLayer), models/knapsack_solver.py (found_max_value_greedy), models/adapted_op.py
(adapted_forward), pFedGate/gate_aggregator.py (_mix_load_three_model), utils/optim.py (get_optimizer), with the
flags of its scripts/README.md (block_wise_prune=1, fine_grained_block_split=5, bi_level_opt=0).

Differences from FedAvg:
- every client keeps a gating layer φ_i = Linear(D, M) + BatchNorm1d(M) (never uploaded) over the M sub-blocks of
  the head: each parameter tensor, classifier included, is split into `blocks` contiguous sub-blocks of its
  flattened elements (size ⌈n/blocks⌉, the last one shorter);
- per minibatch: gates t = mean over the batch of sigmoid(φ_i(x)) ∈ (0, 1)^M (one sparse model per batch);
  ranking scores g = max(t, s_min), s_min = min(max(1/blocks, 0.1), s); each group of sub-blocks (linear layers,
  other layers) keeps, besides every tensor's always-kept first sub-block, the greedy 0-1 knapsack choice by value
  round(10·g) (descending; ties by block order) under capacity round(Σ sizes · (s − s_min)); the model's sub-block j
  is scaled by t_j · (1 − sg(g_j) + g_j) (value t_j, straight-through gradient) where kept, by 0 where not; with
  s = 1 nothing is dropped and sub-block j is scaled by t_j;
- the sparse model's logits pass through a ReLU (adapted_forward); the loss is their cross-entropy, one backward
  step for both θ and φ_i (bi_level_opt=0);
- the gating layer has its own optimizer (rate `lr_gate`); each optimizer clips its gradient norm at 10 and keeps
  its momentum across rounds (one optimizer per client for the whole run); weight decay 5e-4, SGD momentum 0.9;
- the server averages θ over all clients weighted by the rows each trained (non-participants count with the
  global model they hold, their n_k); every client restarts from it;
- inference: each client scores its test rows in consecutive batches of `batch_size` rows, one gated model per
  batch (the gating BN with its running statistics), with the θ it holds after its own local training (the
  global model where it sat the round out).
Global model: none (every prediction goes through a client's gates). The paper is not followed separately: no
statement of it that differs from the code was established, so there is no `pfedgate-official`.

Deviations from the release:
- no input normalisation before the gating layer (the release's SwitchNorm2d normalises image channels);
- the sparse model is featcache's head, not the release's CNNs; with bn=True the BN's weight and bias are gated as
  the release's non-linear blocks (its models have no BN: untested);
- knapsack ties go to the lower block (numpy 1.19.5's argsort, which the release pins, is stable at this size;
  newer numpy's SIMD argsort orders ties otherwise);
- a one-row minibatch trains and a one-row test batch is scored (the release skips both);
- no learning-rate schedule (the release's default `constant`; its scripts use multi_step or reduce_on_plateau), no
  `seperate_trans` (the CIFAR-100 scripts' second gating network), no bi_level_opt=1 (argparse's default);
- partial participation follows online_aggregate=1 (a non-participant weighs n_k with the global model it holds and
  is evaluated with it), not online_aggregate=0's average of stale models;
- defaults SGD lr = lr_gate = 0.05 (its CIFAR-10 s = 0.5 script); batch size is the engine's 32 (scripts: 128).
"""

from __future__ import annotations

import functools
import math

import torch

from .base import FedAvg, masked_ce
from .heads import batch_norm, bn_init, linear, linear_init
from ..training.config import Setting
from ..training.optim import Group
from .registry import register

GATE = "gate0"  # the gating layer: Linear gate0 + BatchNorm1d gate0.bn
HELD = "held."  # buffers: the θ each client holds for inference (its trained model, or the global one)
MAX_NORM = 10.0  # torch.nn.utils.clip_grad_norm_(..., max_norm=10) on each optimizer's parameters
SCALE = 10  # GatedLearner.gated_scores_scale_factor: knapsack values are round(10·g)


class Layout:
    """The sub-blocks of a head: per parameter its (first block, number of blocks, block size), every block's
    size, the knapsack items (all but each tensor's first block) of the linear and of the other layers, and each
    item group's capacity round(Σ sizes · (s − s_min)) (GatingLayer.__init__, GatedLearner._select_top_sub_blocks)."""

    def __init__(self, shapes: tuple, blocks: int, sparsity: float, dtype: torch.dtype):
        self.split, sizes, begin = {}, [], 0
        linear_items: list[int] = []
        other_items: list[int] = []
        for name, numel, is_linear in shapes:
            n = blocks if numel >= blocks else numel
            each = math.ceil(numel / n)
            n = math.ceil(numel / each)
            self.split[name] = (begin, n, each, numel)
            sizes += [each] * (n - 1) + [numel - (n - 1) * each]
            (linear_items if is_linear else other_items).extend(range(begin + 1, begin + n))
            begin += n
        self.M, self.sizes = begin, sizes
        self.s_min = min(max(1 / blocks, 0.1), sparsity)
        self.items = [i for i in (linear_items, other_items) if i]
        cap = lambda items: float(
            torch.round(torch.tensor(float(sum(sizes[i] for i in items)), dtype=dtype) * (sparsity - self.s_min))
        )
        self.capacity = [cap(items) for items in self.items]


def knapsack(value: torch.Tensor, items: list[int], sizes: list[int], capacity: float) -> torch.Tensor:
    """found_max_value_greedy on the blocks `items` of value [..., M]: visit them by value, descending (ties by
    block order), and take each that still fits the capacity. Returns [..., len(items)] bool, in `items` order."""
    v = torch.cat([value[..., i : i + 1] for i in items], -1)  # [..., n]
    order = torch.sort(v, dim=-1, descending=True, stable=True).indices  # [..., n]
    w = torch.cat([v.new_full((1,), float(sizes[i])) for i in items])  # [n] the blocks' sizes
    w = w.expand_as(v).gather(-1, order)  # [..., n] in visiting order
    used, taken = torch.zeros_like(v[..., 0]), []
    for j in range(len(items)):
        fits = used + w[..., j] <= capacity  # [...]
        used = used + fits * w[..., j]
        taken.append(fits)
    return torch.stack(taken, -1).gather(-1, order.argsort(-1))  # [..., n]: visiting order, back to items order


@register
class PFedGate(FedAvg):
    name = "pfedgate"
    paper = "Chen et al., Efficient Personalized Federated Learning via Sparse Model-Adaptation, ICML 2023"
    uploads = "projection + classifier parameters (the gating layer stays on the client)"
    settings = {
        "sparsity": Setting(
            0.5,
            "s, the share of the head's parameters each sparse model keeps",
            lo=0,
            hi=1,
            lo_open=True,
            batched=False,
        ),  # the knapsack's capacity is a per-run constant
        "blocks": Setting(5, "contiguous sub-blocks per parameter tensor (fine_grained_block_split)", lo=1),
        "lr_gate": Setting(0.05, "learning rate of the gating layer's optimizer (lr_gating)", lo=0, lo_open=True),
        "optimizer": "sgd",  # get_optimizer: SGD, momentum 0.9, weight decay 5e-4, for both optimizers
        "lr": 0.05,  # scripts/README.md, CIFAR-10 at s = 0.5: lr_model = lr_gating = 0.05
        "momentum": 0.9,
        "weight_decay": 5e-4,
    }
    limitation = "no input normalisation before the gating layer (cached features, not images)"
    groups = {"": Group(max_norm=MAX_NORM), GATE: Group(lr="lr_gate", max_norm=MAX_NORM)}
    keeps_optimizer_state = True
    fedavg_server = False  # clients hold the θ they trained; every client weighs in (after_local, aggregate, download)
    clients_hold_global = False  # the gating layer stays on the client: no complete server model

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        M = self.layout(tuple(self.shapes(params)), cfg).M
        linear_init(params, GATE, d_in, M, gen)
        bn_init(params, buffers, f"{GATE}.bn", M)
        buffers |= {HELD + k: v.clone() for k, v in params.items() if self.shared(k)}
        return params, buffers

    def shared(self, name):
        return not name.startswith((GATE, HELD))

    # -- the sparse model -------------------------------------------------------------------------------------
    def shapes(self, params):
        """(name, numel, is a linear layer's) of the head's parameters, in the module order of the release's
        named_parameters (projection, its BN, classifier)."""
        for k, v in params.items():
            if self.shared(k):
                yield k, v.numel(), ".bn." not in k

    def layout(self, shapes: tuple, cfg=None) -> Layout:
        cfg = cfg or self.cfg
        return _layout(shapes, cfg["blocks"], cfg["sparsity"], torch.get_default_dtype())

    def gates(self, t: torch.Tensor, lay: Layout) -> torch.Tensor:
        """Batch-mean gates t [..., M] -> the weights of the model's sub-blocks [..., M]
        (get_top_gated_scores + select_top_trans_weights)."""
        if self.cfg["sparsity"] == 1:
            return t
        g = t.clamp(min=lay.s_min)  # [..., M] the ranking scores
        value = torch.round(g.detach().double() * SCALE)  # [..., M]
        keep = torch.ones_like(t, dtype=torch.bool)  # [..., M] each tensor's first block always
        pieces: dict = {}
        for items, cap in zip(lay.items, lay.capacity):
            pieces.update(zip(items, knapsack(value, items, lay.sizes, cap).unbind(-1)))
        keep = torch.stack([pieces.get(i, keep[..., i]) for i in range(lay.M)], -1)  # [..., M]
        return t * (1 - g.detach() + g) * keep  # straight-through: value t, gradient through g too

    def sparse(self, params: dict, w: torch.Tensor, lay: Layout) -> dict:
        """The sparse model: every parameter's sub-block j scaled by w [M] (adapt_prune_model)."""
        out = {}
        for k, (begin, n, each, numel) in lay.split.items():
            scale = w[begin : begin + n, None].expand(n, each).reshape(n * each)[:numel]  # [numel]
            out[k] = params[k] * scale.view(params[k].shape)
        return out

    def batch_gates(self, params, buffers, x, mask, train):
        """t = mean over the valid rows of sigmoid(BN(Linear(x))): [M], and the gating BN's new statistics."""
        logits, new = batch_norm(params, buffers, f"{GATE}.bn", linear(params, GATE, x), mask, train)  # [N, M]
        m = mask.to(logits.dtype)[:, None]  # [N, 1]
        return (torch.sigmoid(logits) * m).sum(0) / m.sum().clamp(min=1), new  # [M]

    def forward(self, params, buffers, x, mask, train):
        """One batch's sparse model: its projection output z, its logits ReLU'd as adapted_forward does, and the
        new BN statistics."""
        lay = self.layout(tuple(self.shapes(params)))
        t, new = self.batch_gates(params, buffers, x, mask, train)
        model = self.sparse(params, self.gates(t, lay), lay)
        z, upd = super().embed(model, buffers, x, mask, train)
        return z, torch.relu(self.logits(model, z)), new | upd  # [N, proj_dim], [N, K]

    def by_test_batch(self, params, buffers, x, rows, out: int):
        """Output `out` of `forward` (0: z, 1: logits) on consecutive batches of batch_size rows, one sparse model
        each, from the θ the client holds (rows [N] bool: the real rows)."""
        held = {k: buffers[HELD + k] if self.shared(k) else v for k, v in params.items()}
        B = self.cfg["batch_size"]
        return torch.cat(
            [
                self.forward(held, buffers, x[s : s + B], rows[s : s + B], train=False)[out]
                for s in range(0, x.shape[0], B)
            ]
        )

    # -- client -----------------------------------------------------------------------------------------------
    def local_loss(self, params, buffers, x, y, mask, ctx):
        _, logits, new = self.forward(params, buffers, x, mask, train=True)
        return masked_ce(logits, y, mask), new

    def predict(self, params, buffers, x, ctx):
        return self.by_test_batch(params, buffers, x, ctx["rows"], 1)  # [N, K]

    def embed(self, params, buffers, x, mask=None, train=False):
        """z of the sparse models `predict` uses (feature analyses; no new statistics)."""
        rows = torch.ones(x.shape[0], dtype=torch.bool, device=x.device) if mask is None else mask
        return self.by_test_batch(params, buffers, x, rows, 0), {}

    # -- server -----------------------------------------------------------------------------------------------
    def after_local(self, state, rnd):
        """Participants hold the θ they trained until the next round (the release evaluates it)."""
        part = rnd.part  # [H, C]
        for k, v in state.params.items():
            if self.shared(k):
                held = state.buffers[HELD + k]
                state.buffers[HELD + k] = torch.where(part.view(*part.shape, *[1] * (v.dim() - 2)), v, held)

    def aggregate(self, uploads, weights, state, rnd):
        """Σ_k w_k θ_k / Σ w over every client: a participant weighs the rows it trained (local epochs × its
        batches' rows), a non-participant its n_k with the global model it holds."""
        n = rnd.data.counts.float()  # [C]
        trained = self.local_epochs() * torch.minimum(n, rnd.client_steps.float() * self.cfg["batch_size"])  # [C]
        w = torch.where(rnd.part, trained, n)  # [H, C]
        return super().aggregate(uploads, w, state, rnd)

    def download(self, state, server, rnd):
        super().download(state, server, rnd)
        for k in server:  # non-participants hold the new global model
            if k in state.params:
                held = state.buffers[HELD + k]
                part = rnd.part.view(*rnd.part.shape, *[1] * (held.dim() - 2))
                state.buffers[HELD + k] = torch.where(part, held, state.params[k])


@functools.lru_cache(maxsize=64)
def _layout(shapes: tuple, blocks: int, sparsity: float, dtype: torch.dtype) -> Layout:
    return Layout(shapes, blocks, sparsity, dtype)
