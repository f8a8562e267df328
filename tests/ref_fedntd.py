"""A transcription of FedNTD as PFLlib releases it (TsingZ0/PFLlib @ d832e76f6a23b833038949ec1e4fdefe63a4d350,
system/flcore/clients/clientntd.py: `clientNTD.train`, `set_parameters`, `_ntd_loss`, `refine_as_not_true`;
system/flcore/servers/serverntd.py: `FedNTD.train`, `add_parameters`; serverbase.py `receive_models`,
`aggregate_parameters`; clientbase.py: SGD and CrossEntropyLoss), in plain torch, written from that code for
tests/test_algo_fedntd.py. No slow clients, no client drops, no learning-rate decay (PFLlib's defaults).

What it takes from outside, as PFLlib takes it from its data loaders and `select_clients`: the global model (a dict
of tensors; `forward` is the head featcache trains), the clients of each round, each client's minibatches (its
DataLoader's, drop_last=True) and the optimizer's settings."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    """The head's logits: FC(ReLU(FC(x)))."""
    pro = torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])
    return pro @ net["cls0.weight"].T + net["cls0.bias"]


def refine_as_not_true(logits, targets, num_classes):
    nt_positions = torch.arange(0, num_classes).to(logits.device)
    nt_positions = nt_positions.repeat(logits.size(0), 1)
    nt_positions = nt_positions[nt_positions[:, :] != targets.view(-1, 1)]
    nt_positions = nt_positions.view(-1, num_classes - 1)
    logits = torch.gather(logits, 1, nt_positions)
    return logits


def ntd_loss(logits, dg_logits, targets, num_classes, tau):
    """clientNTD._ntd_loss."""
    KLDiv = nn.KLDivLoss(reduction="batchmean")
    logits = refine_as_not_true(logits, targets, num_classes)
    pred_probs = F.log_softmax(logits / tau, dim=1)
    with torch.no_grad():
        dg_logits = refine_as_not_true(dg_logits, targets, num_classes)
        dg_probs = torch.softmax(dg_logits / tau, dim=1)
    loss = (tau**2) * KLDiv(pred_probs, dg_probs)
    return loss


def train_client(model, global_model, batches, epochs, lr, beta, tau, num_classes):
    """clientNTD.train after set_parameters(global_model): model holds a copy of the global parameters."""
    params = [p.requires_grad_(True) for p in model.values()]
    optimizer = torch.optim.SGD(params, lr=lr)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        for x, y in batches(epoch):
            output = forward(model, x)
            output_g = forward(global_model, x)
            loss = criterion(output, y)
            loss += ntd_loss(output, output_g, y, num_classes, tau) * beta
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for p in params:
        p.requires_grad_(False)


def fedntd(global_w, selected_rounds, batches, epochs, lr, beta, tau, num_classes):
    """The round loop. selected_rounds: the clients of each round; batches(round, client, epoch) -> [(x, y)].
    Returns the global model after each round."""
    global_model = {k: v.clone() for k, v in global_w.items()}
    out = []
    for i, selected in enumerate(selected_rounds):
        uploaded = []
        for c in selected:  # send_models: set_parameters copies the data, keeps the server's model as global_model
            model = {k: v.clone() for k, v in global_model.items()}
            frozen = global_model  # model.eval().requires_grad_(False)
            train_client(model, frozen, lambda e, i=i, c=c: batches(i, c, e), epochs, lr, beta, tau, num_classes)
            uploaded.append(model)
        new = {k: torch.zeros_like(v) for k, v in uploaded[0].items()}  # aggregate_parameters
        for client_model in uploaded:  # add_parameters: / num_join_clients
            for k in new:
                new[k] += client_model[k].clone() / len(selected)
        global_model = new
        out.append({k: v.clone() for k, v in global_model.items()})
    return out
