"""A plain per-client training loop: the reference that the vectorized engine must equal (allclose).

Each client trains alone, one Python iteration per client and per minibatch, with torch.optim on ordinary leaf
tensors and autograd (no vmap, no stacking, no masks beyond the real batch rows). It borrows only the algorithm's
per-client local loss and the engine's batch order (a pure function of seed, round, epoch, client); the round's
server hooks are the algorithm's own, as the engine runs them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from featcache.engine import Engine, batch_order, participation

OPT = {"adam": lambda groups, c: torch.optim.Adam(groups, lr=c["lr"], weight_decay=c["weight_decay"]),
       "sgd": lambda groups, c: torch.optim.SGD(groups, lr=c["lr"], weight_decay=c["weight_decay"],
                                                momentum=c["momentum"])}


def plain_loop(algo, cfg: dict, train, test, device="cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One configuration trained client by client: per-round test accuracy [R, C] and the trained parameters
    name -> [C, ...] (after the last round's download)."""
    eng = Engine(algo, [cfg], train, test, device)
    algo, train, test = eng.algo, eng.train, eng.test  # bound to the run's shared settings; data on the device
    seeds = eng.seeds.to(eng.device)
    state = eng.init_state()
    B, C = cfg["batch_size"], eng.C
    accs = []
    for rnd in range(cfg["rounds"]):
        part = participation(eng.seeds, rnd, C, cfg["participation"])  # [1, C]
        now = eng.round_context(rnd, part)
        ctxs = [algo.context(state, replace(now, epoch=e)) for e in range(algo.local_epochs())]  # before training
        for c in range(C):
            if not part[0, c]:
                continue
            params = {k: v[0, c].clone().requires_grad_(True) for k, v in state.params.items()}
            buffers = {k: v[0, c].clone() for k, v in state.buffers.items()}
            groups = [{"params": [p], "lr": cfg["lr"] * algo.lr_scale(k)} for k, p in params.items()]
            opt = OPT[cfg["optimizer"]](groups, cfg)
            n = int(train.counts[c])
            n_eff = n // B * B if cfg["drop_last"] else n
            for epoch in range(algo.local_epochs()):
                ctx_c = torch.utils._pytree.tree_map(lambda t: t[0, c], ctxs[epoch])
                for k, p in params.items():
                    p.requires_grad_(algo.trainable(k, replace(now, epoch=epoch)))
                order = batch_order(seeds, rnd, epoch, train.counts, train.features.shape[1])[0, c]
                for s in range(0, n_eff, B):
                    rows = order[s : min(s + B, n_eff)]
                    x, y = train.features[c, rows], train.labels[c, rows]
                    extra = {"views": train.views[c, rows]} if train.views is not None else {}
                    loss, new = algo.local_loss(params, buffers, x, y,
                                                torch.ones(len(rows), dtype=torch.bool, device=x.device), ctx_c | extra)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    with torch.no_grad():  # the per-step hook on this one model, as a [1, 1] stack
                        ctx_11 = torch.utils._pytree.tree_map(lambda t: t[0:1, c : c + 1], ctxs[epoch])
                        algo.after_step({k: p[None, None] for k, p in params.items()}, ctx_11,
                                        torch.ones(1, 1, dtype=torch.bool, device=x.device),
                                        replace(now, epoch=epoch, step=s // B))
                    buffers.update({k: v.detach() for k, v in new.items()})
            for k in params:
                state.params[k][0, c] = params[k].detach()
            for k in buffers:
                state.buffers[k][0, c] = buffers[k]
        algo.after_local(state, now)
        uploads = algo.upload(state, now)
        server = algo.aggregate(uploads, train.counts[None].float() * now.part, state, now)
        algo.download(state, server, now)
        ctx = algo.context(state, now)
        accs.append(torch.stack([_client_accuracy(algo, state, ctx, test, c) for c in range(C)]))
    return torch.stack(accs), {k: v[0].clone() for k, v in state.params.items()}


def _client_accuracy(algo, state, ctx, test, c: int) -> torch.Tensor:
    """One client's test accuracy with its own model, computed alone."""
    n = int(test.counts[c])
    params = {k: v[0, c] for k, v in state.params.items()}
    buffers = {k: v[0, c] for k, v in state.buffers.items()}
    ctx_c = torch.utils._pytree.tree_map(lambda t: t[0, c], ctx)
    with torch.no_grad():
        scores = algo.predict(params, buffers, test.features[c, :n], ctx_c)  # [n, K]
    return (scores.argmax(-1) == test.labels[c, :n]).float().mean()
