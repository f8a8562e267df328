"""A transcription of FedDBE as PFLlib releases it (TsingZ0/PFLlib @ d832e76f6a23b833038949ec1e4fdefe63a4d350,
system/flcore/clients/clientdbe.py: `clientDBE.__init__`, `train`, `reset_running_stats`, `detach_running`,
`test_metrics`; system/flcore/servers/serverdbe.py: `FedDBE.__init__` (the initialization period) and `train`;
serverbase.py `send_models`, `receive_models`, `aggregate_parameters`, `add_parameters`; clientbase.py
`set_parameters`, the client's SGD and CrossEntropyLoss), in plain torch, written from that code for
tests/test_algo_feddbe.py. The same client and server as the authors' TsingZ0/DBE @ 193f4355 (clientDBE.py,
serverDBE.py). No slow clients, no client drops, no learning-rate decay, eval_gap 1 (PFLlib's defaults).

What it takes from outside, as PFLlib takes it from its data loaders and `select_clients`: the initial model (one dict
of tensors, `BaseHeadSplit(base, head)` with base = FC + ReLU and head = the last FC: every client's model and the
server's global model start from it), the clients that train in the initialization period (the release: every
client), the selected clients of each iteration, each client's training-set size, its minibatches (its DataLoader's,
drop_last=True) at each stage (0: the initialization period, i + 1: iteration i) and its test rows."""

from __future__ import annotations

import torch
import torch.nn as nn

BASE, HEAD = ("proj0.weight", "proj0.bias"), ("cls0.weight", "cls0.bias")  # model.base, model.head parameters


def base(net: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])


def head(net: dict, rep: torch.Tensor) -> torch.Tensor:
    return rep @ net["cls0.weight"].T + net["cls0.bias"]


def reg_loss_of(running_mean: torch.Tensor, global_mean: torch.Tensor) -> torch.Tensor:
    """clientDBE.train's MR term (before the κ weight)."""
    return torch.mean(0.5 * (running_mean - global_mean) ** 2)


class ClientDBE:
    def __init__(self, x0: dict, lr: float, klw: float, momentum: float):
        self.model = {k: v.clone().requires_grad_(True) for k, v in x0.items()}  # copy.deepcopy(args.model)
        self.optimizer = torch.optim.SGD(list(self.model.values()), lr=lr)  # clientbase: plain SGD
        self.loss = nn.CrossEntropyLoss()
        self.klw, self.momentum = klw, momentum
        self.global_mean = None
        d = x0["proj0.bias"].shape[0]
        self.running_mean = torch.zeros(d)  # torch.zeros_like(rep[0])
        self.num_batches_tracked = torch.tensor(0, dtype=torch.long)
        self.client_mean = nn.Parameter(torch.zeros(d))
        self.opt_client_mean = torch.optim.SGD([self.client_mean], lr=lr)

    def train(self, batches, local_epochs: int) -> None:
        self.reset_running_stats()
        for epoch in range(local_epochs):
            for x, y in batches(epoch):
                rep = base(self.model, x)
                running_mean = torch.mean(rep, dim=0)
                if self.num_batches_tracked is not None:
                    self.num_batches_tracked.add_(1)
                self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * running_mean
                if self.global_mean is not None:
                    reg_loss = reg_loss_of(self.running_mean, self.global_mean)
                    output = head(self.model, rep + self.client_mean)
                    loss = self.loss(output, y)
                    loss = loss + reg_loss * self.klw
                else:
                    output = head(self.model, rep)
                    loss = self.loss(output, y)
                self.opt_client_mean.zero_grad()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                self.opt_client_mean.step()
                self.detach_running()

    def reset_running_stats(self) -> None:
        self.running_mean.zero_()
        self.num_batches_tracked.zero_()

    def detach_running(self) -> None:
        self.running_mean.detach_()

    def set_parameters(self, model: dict) -> None:
        """clientbase.set_parameters: old_param.data = new_param.data.clone()."""
        for k, p in self.model.items():
            p.data = model[k].data.clone()

    def test_metrics(self, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
        with torch.no_grad():
            rep = base(self.model, x)
            output = head(self.model, rep + self.client_mean)
        return int((torch.argmax(output, dim=1) == y).sum()), len(y)


def upload_weights(sizes: list[int], clients: list[int]) -> list[float]:
    """receive_models (and the initialization period's weights): train_samples / tot_samples."""
    tot_samples = sum(sizes[c] for c in clients)
    return [sizes[c] / tot_samples for c in clients]


def aggregate_parameters(uploaded_weights: list[float], uploaded_models: list[dict]) -> dict:
    """Server.aggregate_parameters with add_parameters: Σ w_k · client model (every parameter: base and head)."""
    global_model = {k: torch.zeros_like(v) for k, v in uploaded_models[0].items()}
    for w, client_model in zip(uploaded_weights, uploaded_models):
        for k in global_model:
            global_model[k] += client_model[k].data.clone() * w
    return global_model


def feddbe(x0: dict, init_clients, selected_rounds, sizes, batches, test, local_epochs, lr, klw, momentum):
    """FedDBE.__init__'s initialization period, then FedDBE.train over len(selected_rounds) iterations.
    batches(stage, client, epoch) -> [(x, y)] (stage 0: the initialization period, i + 1: iteration i);
    test(client) -> (x, y). Returns (the global model after each iteration's aggregation, the clients after the last
    iteration, per iteration the (correct, rows) of each client evaluated after send_models and before training, the
    global mean)."""
    C = len(sizes)
    clients = [ClientDBE(x0, lr, klw, momentum) for _ in range(C)]
    global_model = {k: v.clone() for k, v in x0.items()}  # copy.deepcopy(args.model)
    for c in init_clients:  # client.train(): no DBE yet (global_mean is None)
        clients[c].train(lambda epoch, c=c: batches(0, c, epoch), local_epochs)
    global_mean = 0
    for cid, w in zip(init_clients, upload_weights(sizes, init_clients)):
        global_mean += clients[cid].running_mean * w
    for client in clients:  # the release hands it to self.selected_clients = self.clients
        client.global_mean = global_mean.data.clone()
    models, evaluations = [], []
    for i, selected_clients in enumerate(selected_rounds):
        for client in clients:  # send_models: every client
            client.set_parameters(global_model)
        evaluations.append([clients[c].test_metrics(*test(c)) for c in range(C)])
        for c in selected_clients:
            clients[c].train(lambda epoch, i=i, c=c: batches(i + 1, c, epoch), local_epochs)
        uploaded = [clients[c].model for c in selected_clients]
        global_model = aggregate_parameters(upload_weights(sizes, selected_clients), uploaded)
        models.append({k: v.clone() for k, v in global_model.items()})
    return models, clients, evaluations, global_mean
