"""The plain client backend: each client trained and scored alone in plain torch: torch.optim on ordinary leaf
tensors, one Python step per minibatch, autograd (no vmap, no stacking, no masks beyond the real batch rows),
torch.nn.utils.clip_grad_norm_ where a group clips. `Plain` runs the engine's rounds this way (the reference
`featcache.testing.plain_loop` holds the vectorized backend against: the two share the round loop, not the
arithmetic), and a Flower client (featcache.flower) trains with the same `local_epochs`, so the two cannot train a
client differently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..cache import ClientData
from ..errors import UserError
from .engine import Clients, Engine, Local, Round, State
from .models import Params
from .optim import clip_sets, group_of
from .schedule import batch_order, trained_rows
from .steps import add_penalty

OPT: dict[str, Callable[[list[dict], Mapping[str, Any]], torch.optim.Optimizer]] = {
    "adam": lambda groups, c: torch.optim.Adam(groups, lr=c["lr"], weight_decay=c["weight_decay"]),
    "sgd": lambda groups, c: torch.optim.SGD(
        groups, lr=c["lr"], weight_decay=c["weight_decay"], momentum=c["momentum"]
    ),
}


def client_optimizer(algo, cfg: dict, params: Params) -> torch.optim.Optimizer:
    """torch.optim over `params` (name -> leaf tensor), one group per tensor with its `Group`'s rate (times its
    scale) and weight decay."""
    groups = []
    for k, p in params.items():
        g = group_of(algo.groups, k)
        groups.append({"params": [p], "lr": cfg[g.lr] * cfg.get(g.lr_scale, 1.0), "weight_decay": cfg[g.weight_decay]})
    return OPT[cfg["optimizer"]](groups, cfg)


def local_epochs(
    algo,
    cfg: dict,
    now: Round,
    params: Params,
    buffers: Params,
    opt: torch.optim.Optimizer,
    data: ClientData,
    c: int,
    order: Callable[[int], torch.Tensor],
    ctxs: list,
    loss: Callable | None = None,
) -> tuple[torch.Tensor, int]:
    """Round `now`'s local epochs of client `c` of `data` (and of the contexts `ctxs`, one [H, C] tree per epoch,
    made before training): `params` step in place through `opt`, `buffers` take what the loss returns.
    `order(epoch)` is the client's rows in batch order (the engine's `batch_order`); it trains the rows the engine's
    rule trains (`trained_rows`). `loss` replaces `algo.local_loss` and its `penalty` (local_loss's signature).
    Returns (the sum of the step losses, the steps taken)."""
    own, loss = loss, algo.local_loss if loss is None else loss
    B, n = cfg["batch_size"], int(data.counts[c])
    n_eff = trained_rows([n], B, cfg["drop_last"])[0]
    total, steps = torch.zeros((), device=data.features.device), 0
    for epoch in range(algo.local_epochs()):
        at = replace(now, epoch=epoch)
        ctx = tree_map(lambda t: t[0, c], ctxs[epoch])
        ctx_11 = tree_map(lambda t: t[0:1, c : c + 1], ctxs[epoch])  # the per-step hook's [1, 1] stack
        for k, p in params.items():
            p.requires_grad_(algo.trainable(k, at))
        rows_in_order = order(epoch)  # [n or more]
        for s in range(0, n_eff, B):
            rows = rows_in_order[s : min(s + B, n_eff)]
            x, y = data.features[c, rows], data.labels[c, rows]
            extra = {"views": data.views[c, rows]} if data.views is not None else {}
            mask = torch.ones(len(rows), dtype=torch.bool, device=x.device)
            value, new = loss(params, buffers, x, y, mask, ctx | extra)
            opt.zero_grad(set_to_none=True)
            value.backward()
            if own is None:  # the algorithm's closed-form term, as the engine adds it (on [1, 1] stacks)
                grads = {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in params.items()}
                g11, p11 = ({k: t[None, None] for k, t in d.items()} for d in (grads, params))  # views: added in place
                value = add_penalty(algo, value.detach()[None, None], g11, p11, ctx_11)[0, 0]
                for k, p in params.items():
                    if p.requires_grad:
                        p.grad = grads[k]
            for norm, names in clip_sets(algo.groups, params):
                torch.nn.utils.clip_grad_norm_([params[k] for k in names if params[k].requires_grad], norm)
            opt.step()
            with torch.no_grad():  # the per-step hook on this one model, as a [1, 1] stack
                one = torch.ones(1, 1, dtype=torch.bool, device=x.device)
                algo.after_step({k: p[None, None] for k, p in params.items()}, ctx_11, one, replace(at, step=s // B))
            buffers.update({k: v.detach() for k, v in new.items()})
            total, steps = total + value.detach(), steps + 1
    return total, steps


def client_order(seeds: torch.Tensor, rnd: int, c: int, n: int) -> Callable[[int], torch.Tensor]:
    """Client c's n rows in the engine's batch order of each local epoch of round `rnd` (`batch_order` of client c
    alone: the same as among all C clients): epoch -> [n]."""
    counts = torch.full((c + 1,), n, device=seeds.device)
    ids = torch.tensor([[c]], device=seeds.device)
    return lambda epoch: batch_order(seeds, rnd, epoch, counts, n, ids)[0, 0]


def train_alone(
    algo, cfg: dict, now: Round, state: State, c: int, data: ClientData, order, ctxs: list, kept=None, loss=None
) -> tuple[Params, Params, torch.Tensor]:
    """Model (0, c) of `state` trained on client c of `data` (`local_epochs`, its rows in `order`) with an optimizer
    of its own: a fresh one, or the one `kept` (client -> (params, optimizer), where the algorithm keeps optimizer
    state) holds, its leaves taking the new start; `loss(params, x, y, start)` replaces the local loss (`start`: the
    model before training). Returns (params, buffers, the mean loss of its steps)."""
    params = {k: v[0, c].clone().requires_grad_(True) for k, v in state.params.items()}
    if kept is not None and c in kept:
        with torch.no_grad():
            params = {k: p.copy_(params[k]) for k, p in kept[c][0].items()}
        opt = kept[c][1]
    else:
        opt = client_optimizer(algo, cfg, params)
        if kept is not None and algo.keeps_optimizer_state:
            kept[c] = params, opt
    buffers = {k: v[0, c].clone() for k, v in state.buffers.items()}
    if loss is not None:
        start, user = {k: p.detach().clone() for k, p in params.items()}, loss
        loss = lambda p, b, x, y, mask, ctx: (user(p, x, y, start), {})
    total, steps = local_epochs(algo, cfg, now, params, buffers, opt, data, c, order, ctxs, loss)
    return params, buffers, total / steps


class Plain(Clients):
    """Each participant trained alone (`local_epochs`) with an optimizer of its own (kept for the whole run where the
    algorithm keeps optimizer state), and each client scored alone: one configuration. `loss(params, x, y, start)`
    replaces the local loss (`start`: the client's model at the round's start; `featcache.testing.plain_loop`)."""

    def __init__(self, loss: Callable | None = None):
        self.loss = loss
        self.kept: dict = {}  # client -> (params, optimizer) where the algorithm keeps optimizer state

    def refuse(self, algo, H: int) -> None:
        if H != 1:
            raise UserError(f"the plain loop trains one configuration at a time, not {H}: give one")

    def fit(self, eng: Engine, state: State, now: Round, part: list, aside: tuple = ()) -> Local:
        algo, cfg, data = eng.algo, eng.cfgs[0], eng.train
        ctxs = [algo.context(state, replace(now, epoch=e)) for e in range(algo.local_epochs())]  # before training
        seeds = eng.seeds.to(eng.device)
        loss = torch.full((1, eng.C), torch.nan, device=eng.device)  # [1, C]
        for c in (c for c, p in enumerate(part[0]) if p):
            order = client_order(seeds, now.round, c, int(data.counts[c]))
            params, buffers, loss[0, c] = train_alone(algo, cfg, now, state, c, data, order, ctxs, self.kept, self.loss)
            for tree, new in ((state.params, params), (state.buffers, buffers)):
                for k, v in new.items():
                    tree[k] = tree[k].contiguous()  # a model the server broadcast is a view: give it its own memory
                    tree[k][0, c] = v.detach()
        return Local(~loss.isfinite() & now.part, loss, now)

    def score(self, eng: Engine, now: Round, round_loss: torch.Tensor, logs: bool) -> dict:
        """Each client's test accuracy with its own model, computed alone."""
        algo, state, test = eng.algo, eng.state, eng.test
        ctx = algo.context(state, now)
        acc = []
        for c in range(eng.C):
            n = int(test.counts[c])
            params, buffers, ctx_c = (tree_map(lambda t: t[0, c], d) for d in (state.params, state.buffers, ctx))
            with torch.no_grad():
                rows = torch.ones(n, dtype=torch.bool, device=test.features.device)
                scores = algo.predict(params, buffers, test.features[c, :n], ctx_c | {"rows": rows})  # [n, K]
            acc.append((scores.argmax(-1) == test.labels[c, :n]).float().mean())
        return {"test_acc": torch.stack(acc)[None].cpu()}  # [1, C]
