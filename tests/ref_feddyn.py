"""A transcription of PFLlib's FedDyn (TsingZ0/PFLlib @ d832e76f6a23b833038949ec1e4fdefe63a4d350,
system/flcore/clients/clientdyn.py, system/flcore/servers/serverdyn.py and the parts of clientbase.py / serverbase.py
they use), in plain torch, written from that code for tests/test_algo_feddyn.py.

What it takes from outside, as the release takes it from its arguments and data loaders: the initial model (a dict
of tensors; `forward` is the head featcache trains, FC + ReLU + FC), the clients selected each round (`select_clients`,
in the order `receive_models` lists them), each client's minibatches (its DataLoader's, drop_last=True) and
args.alpha / args.local_learning_rate. Clients train with torch.optim.SGD(lr) (clientbase.py: no momentum, no weight
decay), one optimizer per client for the whole run; no slow clients, no drops, no learning-rate decay."""

from __future__ import annotations

import torch
import torch.nn as nn


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"]) @ net["cls0.weight"].T + net["cls0.bias"]


def model_parameter_vector(model: dict) -> torch.Tensor:
    param = [p.view(-1) for p in model.values()]
    return torch.cat(param, dim=0)


class ClientDyn:
    def __init__(self, model: dict, lr: float, alpha: float):
        self.model = {k: v.clone().requires_grad_(True) for k, v in model.items()}  # copy.deepcopy(args.model)
        self.loss = nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.values(), lr=lr)
        self.alpha = alpha
        self.global_model_vector = None
        self.old_grad = torch.zeros_like(model_parameter_vector(self.model))

    def train(self, batches, local_epochs: int):
        for epoch in range(local_epochs):
            for x, y in batches(epoch):
                output = forward(self.model, x)
                loss = self.loss(output, y)
                if self.global_model_vector is not None:
                    v1 = model_parameter_vector(self.model)
                    loss += self.alpha / 2 * torch.norm(v1 - self.global_model_vector, 2)
                    loss -= torch.dot(v1, self.old_grad)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
        if self.global_model_vector is not None:
            v1 = model_parameter_vector(self.model).detach()
            self.old_grad = self.old_grad - self.alpha * (v1 - self.global_model_vector)

    def set_parameters(self, model: dict):
        for new_param, old_param in zip(model.values(), self.model.values()):
            old_param.data = new_param.data.clone()
        self.global_model_vector = model_parameter_vector(model).detach().clone()


def feddyn(model: dict, selected_rounds, batches, local_epochs: int, lr: float, alpha: float):
    """FedDyn.train's round loop. selected_rounds: the clients selected in each round; batches(round, client, epoch)
    -> [(x, y)]. Returns the global model after each round's aggregation and the clients."""
    num_clients = max(max(s) for s in selected_rounds) + 1
    clients = [ClientDyn(model, lr, alpha) for _ in range(num_clients)]
    global_model = {k: v.clone() for k, v in model.items()}
    server_state = {k: torch.zeros_like(v) for k, v in model.items()}
    globals_ = []
    for i, selected_clients in enumerate(selected_rounds):
        for client in clients:  # send_models
            client.set_parameters(global_model)
        for c in selected_clients:
            clients[c].train(lambda epoch, r=i, c=c: batches(r, c, epoch), local_epochs)
        uploaded_models = [{k: v.detach() for k, v in clients[c].model.items()} for c in selected_clients]
        num_join_clients = len(selected_clients)
        # update_server_state
        model_delta = {k: torch.zeros_like(v) for k, v in uploaded_models[0].items()}
        for client_model in uploaded_models:
            for k in global_model:
                model_delta[k] += (client_model[k] - global_model[k]) / num_clients
        for k in server_state:
            server_state[k] -= alpha * model_delta[k]
        # aggregate_parameters
        global_model = {k: torch.zeros_like(v) for k, v in uploaded_models[0].items()}
        for client_model in uploaded_models:
            for k in global_model:
                global_model[k] += client_model[k].clone() / num_join_clients
        for k in global_model:
            global_model[k] -= (1 / alpha) * server_state[k]
        globals_.append({k: v.clone() for k, v in global_model.items()})
    return globals_, clients
