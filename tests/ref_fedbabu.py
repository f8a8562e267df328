"""A transcription of FedBABU as PFLlib releases it (TsingZ0/PFLlib @ d832e76f6a23b833038949ec1e4fdefe63a4d350,
system/flcore/servers/serverbabu.py `FedBABU.train`, `receive_models`; system/flcore/clients/clientbabu.py
`clientBABU.__init__`, `train`, `set_parameters`, `fine_tune`; system/flcore/servers/serverbase.py `send_models`,
`aggregate_parameters`, `add_parameters`, `evaluate`; system/flcore/clients/clientbase.py `test_metrics` and the
client's optimizer), in plain torch, written from that code for tests/test_algo_fedbabu.py.

What it takes from outside, as the release takes it from its data loaders and `select_clients`: the initial model
(one dict of tensors: `BaseHeadSplit(base, head)`, base = FC + ReLU, head = the last FC; every client's model and the
server's `global_model = copy.deepcopy(args.model)` start from it), the selected clients of each iteration, each
client's training-set size, its minibatches for training and for fine-tuning (DataLoaders with drop_last=True) and
its test rows. Defaults of the release: no slow clients, client_drop_rate 0, eval_gap 1, no learning-rate decay,
the client's SGD without momentum or weight decay, created once over every parameter."""

from __future__ import annotations

import torch
import torch.nn as nn

BASE, HEAD = ("proj0.weight", "proj0.bias"), ("cls0.weight", "cls0.bias")  # model.base, model.head parameters


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    """BaseHeadSplit.forward: out = self.base(x); out = self.head(out)."""
    out = torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])
    return out @ net["cls0.weight"].T + net["cls0.bias"]


def requires_grad(training: bool) -> tuple[str, ...]:
    """The parameters with requires_grad: clientBABU.__init__ sets it False on the head for training; fine_tune
    (which_module=['base', 'head']) sets it True again, the base left as it is."""
    return BASE if training else BASE + HEAD


def sgd_epochs(net: dict, batches, epochs: int, lr: float, trained: tuple[str, ...]) -> None:
    """The loop of clientBABU.train and clientBABU.fine_tune: the client's SGD over every parameter, of which those
    without requires_grad get no gradient and so are skipped by the step."""
    for k in trained:
        net[k].requires_grad_(True)
    optimizer = torch.optim.SGD(list(net.values()), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        for x, y in batches(epoch):
            output = forward(net, x)
            loss = loss_fn(output, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for v in net.values():
        v.requires_grad_(False)


def train(net: dict, batches, local_epochs: int, lr: float) -> None:
    """clientBABU.train."""
    sgd_epochs(net, batches, local_epochs, lr, requires_grad(training=True))


def fine_tune(net: dict, batches, fine_tuning_epochs: int, lr: float) -> None:
    """clientBABU.fine_tune(which_module=['base', 'head'])."""
    sgd_epochs(net, batches, fine_tuning_epochs, lr, requires_grad(training=False))


def set_parameters(net: dict, global_model: dict) -> None:
    """clientBABU.set_parameters(base): zip(base.parameters(), self.model.base.parameters()) -- the server passes
    its whole global_model first (base parameters first, so the zip takes them), then the aggregated base."""
    for k in BASE:
        net[k] = global_model[k].clone()


def aggregate_parameters(uploaded_weights: list[float], uploaded_models: list[dict]) -> dict:
    """Server.aggregate_parameters with add_parameters: Σ w_k · client base."""
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


def fedbabu(x0: dict, selected_rounds, sizes, batches, finetune_batches, test, local_epochs, fine_tuning_epochs, lr):
    """FedBABU.train over len(selected_rounds) iterations (the release's global_rounds + 1), then every client's
    fine_tune and the last evaluation. batches(i, client, epoch), finetune_batches(client, epoch) -> [(x, y)];
    test(client) -> (x, y). Returns (the server's base after each iteration's aggregation, per iteration the
    (correct, rows) of each client evaluated after send_models and before training, every client's model before
    fine-tuning, after it, and the (correct, rows) of the fine-tuned models)."""
    C = len(sizes)
    clients = [{k: v.clone() for k, v in x0.items()} for _ in range(C)]
    global_model = {k: v.clone() for k, v in x0.items()}  # copy.deepcopy(args.model)
    bases, evaluations = [], []
    for i, selected_clients in enumerate(selected_rounds):
        for client in clients:  # send_models
            set_parameters(client, global_model)
        evaluations.append([test_metrics(clients[c], *test(c)) for c in range(C)])
        for c in selected_clients:
            train(clients[c], lambda epoch, i=i, c=c: batches(i, c, epoch), local_epochs, lr)
        tot_samples = sum(sizes[c] for c in selected_clients)  # receive_models
        uploaded_weights = [sizes[c] / tot_samples for c in selected_clients]
        uploaded_models = [{k: clients[c][k] for k in BASE} for c in selected_clients]  # client.model.base
        global_model = aggregate_parameters(uploaded_weights, uploaded_models)
        bases.append({k: v.clone() for k, v in global_model.items()})
    before = [{k: v.clone() for k, v in client.items()} for client in clients]
    for c, client in enumerate(clients):
        fine_tune(client, lambda epoch, c=c: finetune_batches(c, epoch), fine_tuning_epochs, lr)
    final = [test_metrics(clients[c], *test(c)) for c in range(C)]
    return bases, evaluations, before, clients, final
