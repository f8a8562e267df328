"""A plain per-client training loop: the reference that the vectorized engine must equal (allclose).

Each client trains alone, one Python iteration per client and per minibatch, with torch.optim on ordinary leaf
tensors and autograd (no vmap, no stacking, no masks beyond the real batch rows). It borrows only the algorithm's
per-client local loss and the engine's batch order (a pure function of seed, round, epoch, client); the round's
server hooks are the algorithm's own, as the engine runs them.
"""

from __future__ import annotations

import torch

from featcache.engine import Engine, batch_order, participation

OPT = {"adam": lambda groups, c: torch.optim.Adam(groups, lr=c["lr"], weight_decay=c["weight_decay"]),
       "sgd": lambda groups, c: torch.optim.SGD(groups, lr=c["lr"], weight_decay=c["weight_decay"],
                                                momentum=c["momentum"])}


def plain_loop(algo, cfg: dict, train, test) -> torch.Tensor:
    """Per-round test accuracy [R, C] of one configuration, trained client by client."""
    eng = Engine(algo, [cfg], train, test)
    eng.round = -1
    state = eng.init_state()
    B, C = cfg["batch_size"], eng.C
    accs = []
    for rnd in range(cfg["rounds"]):
        eng.round = rnd
        part = participation(eng.seeds, rnd, C, cfg["participation"])[0]  # [C]
        ctx = algo.context(state, eng)
        for c in range(C):
            if not part[c]:
                continue
            params = {k: v[0, c].clone().requires_grad_(True) for k, v in state.params.items()}
            buffers = {k: v[0, c].clone() for k, v in state.buffers.items()}
            ctx_c = torch.utils._pytree.tree_map(lambda t: t[0, c], ctx)
            groups = [{"params": [p], "lr": cfg["lr"] * algo.lr_scale(k)} for k, p in params.items()]
            opt = OPT[cfg["optimizer"]](groups, cfg)
            n = int(train.counts[c])
            n_eff = n // B * B if cfg["drop_last"] else n
            for epoch in range(algo.local_epochs()):
                for k, p in params.items():
                    p.requires_grad_(algo.trainable(k, epoch))
                order = batch_order(eng.seeds, rnd, epoch, train.counts, train.features.shape[1])[0, c]
                for s in range(0, n_eff, B):
                    rows = order[s : min(s + B, n_eff)]
                    x, y = train.features[c, rows], train.labels[c, rows]
                    extra = {"views": train.views[c, rows]} if train.views is not None else {}
                    loss, new = algo.local_loss(params, buffers, x, y, torch.ones(len(rows), dtype=torch.bool),
                                                ctx_c | extra)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    buffers.update({k: v.detach() for k, v in new.items()})
            for k in params:
                state.params[k][0, c] = params[k].detach()
            for k in buffers:
                state.buffers[k][0, c] = buffers[k]
        algo.after_local(state, eng)
        uploads = algo.upload(state, eng)
        server = algo.aggregate(uploads, train.counts[None].float() * part, state, eng)
        algo.download(state, server, part[None], eng)
        ctx = algo.context(state, eng)
        accs.append(torch.stack([_client_accuracy(algo, state, ctx, test, c) for c in range(C)]))
    return torch.stack(accs)


def _client_accuracy(algo, state, ctx, test, c: int) -> torch.Tensor:
    """One client's test accuracy with its own model, computed alone."""
    n = int(test.counts[c])
    params = {k: v[0, c] for k, v in state.params.items()}
    buffers = {k: v[0, c] for k, v in state.buffers.items()}
    ctx_c = torch.utils._pytree.tree_map(lambda t: t[0, c], ctx)
    with torch.no_grad():
        scores = algo.predict(params, buffers, test.features[c, :n], ctx_c)  # [n, K]
    return (scores.argmax(-1) == test.labels[c, :n]).float().mean()
