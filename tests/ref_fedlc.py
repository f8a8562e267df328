"""A transcription of FedLC as FL-bench releases it (KarhouTam/FL-bench @ 06e658bc, `src/client/fedlc.py`
`FedLCClient` with its `logit_calibrated_loss`, and what it inherits: `src/client/fedavg.py` `FedAvgClient.fit`,
`set_parameters`, `package`, and `src/server/fedavg.py` `FedAvgServer.aggregate_client_updates` with
`return_diff = False`), in plain torch, written from that code for tests/test_algo_fedlc.py.

What it takes from outside, as FL-bench takes it from its data indices, client sampler and config: the global
network (a dict of tensors; `forward` is the head featcache trains), each round's selected clients, each client's
training labels (`dataset.targets[indices["train"]]`), its minibatches (its shuffled DataLoader's, drop_last False)
and the optimizer's settings (FL-bench's default `sgd`; `reset_optimizer_on_global_epoch: true`, so each round starts
from the initial optimizer state)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    """The head's logits: FC(ReLU(FC(x)))."""
    pro = torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])
    return pro @ net["cls0.weight"].T + net["cls0.bias"]


def label_counts(targets, num_classes: int) -> torch.Tensor:
    """FedLCClient.__init__: the client's training-label counts, 1e-8 for a class it lacks."""
    counter = Counter(np.array(targets))
    return torch.tensor([counter.get(i, 1e-8) for i in range(num_classes)])


def logit_calibrated_loss(logit, y, counts, tau):
    cal_logit = torch.exp(logit - (tau * torch.pow(counts, -1 / 4).unsqueeze(0).expand((logit.shape[0], -1))))
    y_logit = torch.gather(cal_logit, dim=-1, index=y.unsqueeze(1))
    loss = -torch.log(y_logit / cal_logit.sum(dim=-1, keepdim=True))
    return loss.sum() / logit.shape[0]


def fit(model, criterion, batches, local_epoch, lr, momentum, weight_decay):
    """FedAvgClient.fit with a fresh SGD optimizer (the initial optimizer state)."""
    params = [p.requires_grad_(True) for p in model.values()]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    for epoch in range(local_epoch):
        for x, y in batches(epoch):
            if len(x) <= 1:  # FL-bench discards one-row batches
                continue
            logit = forward(model, x)
            loss = criterion(logit, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for p in params:
        p.requires_grad_(False)


def fedlc(global_w, selected_rounds, targets, num_classes, batches, local_epoch, lr, momentum, weight_decay, tau):
    """The round loop. targets[c]: client c's training labels; batches(round, client, epoch) -> [(x, y)]. Returns the
    global network after each round."""
    public = {k: v.clone() for k, v in global_w.items()}
    counts = [label_counts(t, num_classes) for t in targets]
    out = []
    for round, selected in enumerate(selected_rounds):
        packages = {}
        for client_id in selected:
            model = {k: v.clone() for k, v in public.items()}  # set_parameters: load the regular params
            criterion = lambda logit, y, c=counts[client_id]: logit_calibrated_loss(logit, y, c, tau)
            fit(
                model,
                criterion,
                lambda e, r=round, c=client_id: batches(r, c, e),
                local_epoch,
                lr,
                momentum,
                weight_decay,
            )
            packages[client_id] = {"weight": len(targets[client_id]), "regular_model_params": model}
        client_weights = [package["weight"] for package in packages.values()]
        weights = torch.tensor(client_weights) / sum(client_weights)
        for name in public:
            client_params = torch.stack(
                [package["regular_model_params"][name] for package in packages.values()], dim=-1
            )
            public[name] = torch.sum(client_params * weights, dim=-1)
        out.append({k: v.clone() for k, v in public.items()})
    return out
