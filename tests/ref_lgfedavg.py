"""A transcription of LG-FedAvg as PFLlib releases it (TsingZ0/PFLlib @ d832e76f6a23b833038949ec1e4fdefe63a4d350,
system/flcore/servers/serverlg.py `LG_FedAvg.train`, `receive_models`; system/flcore/clients/clientlg.py
`clientLG.train`, `set_parameters`; system/flcore/servers/serverbase.py `send_models`, `aggregate_parameters`,
`add_parameters`, `evaluate`; system/flcore/clients/clientbase.py `test_metrics` and the client's optimizer), in plain
torch, written from that code for tests/test_algo_lgfedavg.py.

What it takes from outside, as the release takes it from its data loaders and `select_clients`: the initial model
(one dict of tensors: `BaseHeadSplit(base, head)` with base = FC + ReLU and head = the last FC, PFLlib's `model.fc`;
every client's model and the server's `global_model = deepcopy(args.model.head)` start from it), the selected clients
of each iteration, each client's training-set size, each client's minibatches (its DataLoader's: drop_last=True) and
test rows. Defaults of the release: no slow clients, client_drop_rate 0, eval_gap 1, no learning-rate decay, SGD
without momentum or weight decay (clientbase: `torch.optim.SGD(self.model.parameters(), lr=self.learning_rate)`)."""

from __future__ import annotations

import torch
import torch.nn as nn

BASE, HEAD = ("proj0.weight", "proj0.bias"), ("cls0.weight", "cls0.bias")  # model.base, model.head parameters


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    """BaseHeadSplit.forward: out = self.base(x); out = self.head(out)."""
    out = torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])
    return out @ net["cls0.weight"].T + net["cls0.bias"]


def client_train(net: dict, batches, local_epochs: int, lr: float) -> None:
    """clientLG.train: every parameter of the model trained on the task loss (the optimizer is the client's, plain
    SGD, created once; without momentum it keeps no state between rounds)."""
    params = [p.requires_grad_(True) for p in net.values()]
    optimizer = torch.optim.SGD(params, lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(local_epochs):
        for x, y in batches(epoch):
            output = forward(net, x)
            loss = loss_fn(output, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for p in params:
        p.requires_grad_(False)


def set_parameters(net: dict, head: dict) -> None:
    """clientLG.set_parameters: old_param.data = new_param.data.clone() over the head's parameters."""
    for k in HEAD:
        net[k] = head[k].clone()


def upload_weights(sizes: list[int], active: list[int]) -> list[float]:
    """receive_models: each uploading client's train_samples / tot_samples."""
    tot_samples = sum(sizes[c] for c in active)
    return [sizes[c] / tot_samples for c in active]


def aggregate_parameters(uploaded_weights: list[float], uploaded_models: list[dict]) -> dict:
    """Server.aggregate_parameters with add_parameters: Σ w_k · client head."""
    global_model = {k: torch.zeros_like(v) for k, v in uploaded_models[0].items()}
    for w, client_model in zip(uploaded_weights, uploaded_models):
        for k in global_model:
            global_model[k] += client_model[k].clone() * w
    return global_model


def test_metrics(net: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """clientbase.test_metrics: (correct, rows) of the client's model on its test rows."""
    with torch.no_grad():
        output = forward(net, x)
    return int((torch.argmax(output, dim=1) == y).sum()), len(y)


def lg_fedavg(x0: dict, selected_rounds, sizes, batches, test, local_epochs: int, lr: float):
    """LG_FedAvg.train over len(selected_rounds) iterations (the release's global_rounds + 1). batches(i, client,
    epoch) -> [(x, y)]; test(client) -> (x, y). Returns (the server's head after each iteration's aggregation, every
    client's model after the last iteration, per iteration the (correct, rows) of each client evaluated after
    send_models and before training)."""
    C = len(sizes)
    clients = [{k: v.clone() for k, v in x0.items()} for _ in range(C)]  # copy.deepcopy(args.model) per client
    global_model = {k: x0[k].clone() for k in HEAD}  # copy.deepcopy(args.model.head)
    heads, evaluations = [], []
    for i, selected_clients in enumerate(selected_rounds):
        for client in clients:  # send_models: every client, not only the selected ones
            set_parameters(client, global_model)
        evaluations.append([test_metrics(clients[c], *test(c)) for c in range(C)])
        for c in selected_clients:
            client_train(clients[c], lambda epoch, i=i, c=c: batches(i, c, epoch), local_epochs, lr)
        uploaded_weights = upload_weights(sizes, selected_clients)
        uploaded_models = [{k: clients[c][k] for k in HEAD} for c in selected_clients]  # client.model.head
        global_model = aggregate_parameters(uploaded_weights, uploaded_models)
        heads.append({k: v.clone() for k, v in global_model.items()})
    return heads, clients, evaluations
