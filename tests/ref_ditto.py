"""A transcription of PFLlib's Ditto (TsingZ0/PFLlib @ d832e76f6a23b833038949ec1e4fdefe63a4d350,
system/flcore/clients/clientditto.py, system/flcore/servers/serverditto.py, PerturbedGradientDescent of
system/flcore/optimizers/fedoptimizer.py and the parts of clientbase.py / serverbase.py they use), in plain torch,
written from that code for tests/test_algo_ditto.py.

What it takes from outside, as the release takes it from its arguments and data loaders: the initial model (a dict
of tensors; `forward` is the head featcache trains, FC + ReLU + FC), the clients selected each round
(`select_clients`), each client's minibatches (`load_train_data`'s DataLoader, drop_last=True; ptrain and train each
open one), args.mu (λ), args.plocal_epochs, args.local_epochs and args.local_learning_rate. No slow clients, no
drops, no learning-rate decay."""

from __future__ import annotations

import torch
import torch.nn as nn


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"]) @ net["cls0.weight"].T + net["cls0.bias"]


class PerturbedGradientDescent(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01, mu=0.0):
        default = dict(lr=lr, mu=mu)
        super().__init__(params, default)

    @torch.no_grad()
    def step(self, global_params):
        for group in self.param_groups:
            for p, g in zip(group["params"], global_params):
                d_p = p.grad.data + group["mu"] * (p.data - g.data)
                p.data.add_(d_p, alpha=-group["lr"])


class ClientDitto:
    def __init__(self, model: dict, lr: float, mu: float, local_epochs: int, plocal_epochs: int):
        self.model = {k: v.clone().requires_grad_(True) for k, v in model.items()}  # copy.deepcopy(args.model)
        self.loss = nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.values(), lr=lr)
        self.local_epochs, self.plocal_epochs = local_epochs, plocal_epochs
        self.model_per = {k: v.detach().clone().requires_grad_(True) for k, v in self.model.items()}  # deepcopy
        self.optimizer_per = PerturbedGradientDescent(self.model_per.values(), lr=lr, mu=mu)

    def set_parameters(self, model: dict):
        for new_param, old_param in zip(model.values(), self.model.values()):
            old_param.data = new_param.data.clone()

    def train(self, trainloader):
        for epoch in range(self.local_epochs):
            for x, y in trainloader(epoch):
                output = forward(self.model, x)
                loss = self.loss(output, y)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()

    def ptrain(self, trainloader):
        for epoch in range(self.plocal_epochs):
            for x, y in trainloader(epoch):
                output = forward(self.model_per, x)
                loss = self.loss(output, y)
                self.optimizer_per.zero_grad()
                loss.backward()
                self.optimizer_per.step(self.model.values())


def ditto(model: dict, selected_rounds, train_samples, batches, local_epochs, plocal_epochs, lr, mu):
    """Ditto.train's round loop. selected_rounds: the clients selected in each round; train_samples: each client's
    training rows; batches(round, client, epoch) -> [(x, y)]. Returns per round (the global model after aggregation,
    every client's personal model)."""
    clients = [ClientDitto(model, lr, mu, local_epochs, plocal_epochs) for _ in train_samples]
    global_model = {k: v.clone() for k, v in model.items()}
    out = []
    for i, selected_clients in enumerate(selected_rounds):
        for client in clients:  # send_models
            client.set_parameters(global_model)
        for c in selected_clients:
            loader = lambda epoch, r=i, c=c: batches(r, c, epoch)
            clients[c].ptrain(loader)
            clients[c].train(loader)
        # receive_models
        tot_samples = sum(train_samples[c] for c in selected_clients)
        uploaded_weights = [train_samples[c] / tot_samples for c in selected_clients]
        uploaded_models = [{k: v.detach() for k, v in clients[c].model.items()} for c in selected_clients]
        # aggregate_parameters
        global_model = {k: torch.zeros_like(v) for k, v in uploaded_models[0].items()}
        for w, client_model in zip(uploaded_weights, uploaded_models):
            for k in global_model:
                global_model[k] += client_model[k].clone() * w
        out.append(
            (
                {k: v.clone() for k, v in global_model.items()},
                [{k: v.detach().clone() for k, v in c.model_per.items()} for c in clients],
            )
        )
    return out
