"""One client's local epochs in plain torch: torch.optim on ordinary leaf tensors, one Python step per minibatch,
autograd (no vmap, no stacking, no masks beyond the real batch rows), torch.nn.utils.clip_grad_norm_ where a group
clips. The per-client reference `featcache.testing.plain_loop` holds the engine against, and how a Flower client
(featcache.flower) trains: one function, so the two cannot train a client differently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..cache import ClientData
from .engine import Round
from .models import Params
from .optim import clip_sets, group_of
from .schedule import trained_rows
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
