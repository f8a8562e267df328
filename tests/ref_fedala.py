"""A transcription of FedALA as PFLlib releases it (TsingZ0/PFLlib @ d832e76f6a23b833038949ec1e4fdefe63a4d350,
system/utils/ALA.py: `ALA.__init__`, `adaptive_local_aggregation`; system/flcore/clients/clientala.py:
`clientALA.train`, `local_initialization`; system/flcore/servers/serverala.py: `FedALA.train`, `send_models`;
serverbase.py: `receive_models`, `aggregate_parameters`, `add_parameters`; clientbase.py: SGD, CrossEntropyLoss;
the authors' TsingZ0/FedALA @ a7a9b21342859005f22fc0bffbdb1846975de53b holds the same ALA.py), in plain torch,
written from that code for tests/test_algo_fedala.py. No slow clients, no client drops, no learning-rate decay
(PFLlib's defaults); the convergence message ALA prints is left out.

What it takes from outside, as the release takes it from its arguments, data and random module: the initial model (a
dict of tensors, in `parameters()` order; `forward` is the head featcache trains, FC + ReLU + FC), the clients
selected each round, each client's training rows (read_client_data's list, in order) and minibatches
(`load_train_data`'s DataLoader, drop_last=True), the offset `random.randint` draws in each ALA (`offsets(round,
client)`, checked against the range the release draws from), args.eta, args.rand_percent, args.layer_idx,
args.batch_size and args.local_learning_rate, ALA's threshold and num_pre_loss."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"]) @ net["cls0.weight"].T + net["cls0.bias"]


class Planned:
    """`random` as ALA uses it: randint(a, b) returns the planned offset, which must lie in [a, b]."""

    def __init__(self):
        self.offset = 0

    def randint(self, a: int, b: int) -> int:
        assert a <= self.offset <= b, (a, self.offset, b)
        return self.offset


def batches_of(rows: list, batch_size: int) -> list:
    """DataLoader(rows, batch_size, drop_last=False): consecutive rows, the last batch short."""
    out = []
    for s in range(0, len(rows), batch_size):
        chunk = rows[s : s + batch_size]
        out.append((torch.stack([x for x, _ in chunk]), torch.stack([y for _, y in chunk])))
    return out


class ALA:
    def __init__(self, cid, loss, train_data, batch_size, rand_percent, layer_idx=0, eta=1.0, threshold=0.1,
                 num_pre_loss=10):  # fmt: skip
        self.cid = cid
        self.loss = loss
        self.train_data = train_data
        self.batch_size = batch_size
        self.rand_percent = rand_percent
        self.layer_idx = layer_idx
        self.eta = eta
        self.threshold = threshold
        self.num_pre_loss = num_pre_loss
        self.random = Planned()

        self.weights = None  # Learnable local aggregation weights.
        self.start_phase = True
        self.epochs = []  # (not in the release) the weight-learning epochs of each ALA that ran, for the tests

    def adaptive_local_aggregation(self, global_model: dict, local_model: dict) -> None:
        # randomly sample partial local training data
        rand_ratio = self.rand_percent / 100
        rand_num = int(rand_ratio * len(self.train_data))
        rand_idx = self.random.randint(0, len(self.train_data) - rand_num)
        rand_loader = batches_of(self.train_data[rand_idx : rand_idx + rand_num], self.batch_size)

        # obtain the references of the parameters
        params_g = list(global_model.values())
        params = list(local_model.values())

        # deactivate ALA at the 1st communication iteration
        if torch.sum(params_g[0] - params[0]) == 0:
            return

        # preserve all the updates in the lower layers
        for param, param_g in zip(params[: -self.layer_idx], params_g[: -self.layer_idx]):
            param.data = param_g.data.clone()

        # temp local model only for weight learning
        model_t = {k: v.detach().clone().requires_grad_(True) for k, v in local_model.items()}  # copy.deepcopy
        params_t = list(model_t.values())

        # only consider higher layers
        params_p = params[-self.layer_idx :]
        params_gp = params_g[-self.layer_idx :]
        params_tp = params_t[-self.layer_idx :]

        # frozen the lower layers to reduce computational cost in Pytorch
        for param in params_t[: -self.layer_idx]:
            param.requires_grad = False

        # used to obtain the gradient of higher layers
        # no need to use optimizer.step(), so lr=0
        optimizer = torch.optim.SGD(params_tp, lr=0)

        # initialize the weight to all ones in the beginning
        if self.weights is None:
            self.weights = [torch.ones_like(param.data) for param in params_p]

        # initialize the higher layers in the temp local model
        for param_t, param, param_g, weight in zip(params_tp, params_p, params_gp, self.weights):
            param_t.data = param + (param_g - param) * weight

        # weight learning
        losses = []  # record losses
        cnt = 0  # weight training iteration counter
        while True:
            for x, y in rand_loader:
                optimizer.zero_grad()
                output = forward(model_t, x)
                loss_value = self.loss(output, y)  # modify according to the local objective
                loss_value.backward()

                # update weight in this batch
                for param_t, param, param_g, weight in zip(params_tp, params_p, params_gp, self.weights):
                    weight.data = torch.clamp(weight - self.eta * (param_t.grad * (param_g - param)), 0, 1)

                # update temp local model in this batch
                for param_t, param, param_g, weight in zip(params_tp, params_p, params_gp, self.weights):
                    param_t.data = param + (param_g - param) * weight

            losses.append(loss_value.item())
            cnt += 1

            # only train one epoch in the subsequent iterations
            if not self.start_phase:
                break

            # train the weight until convergence
            if len(losses) > self.num_pre_loss and np.std(losses[-self.num_pre_loss :]) < self.threshold:
                break

        self.start_phase = False
        self.epochs.append(cnt)

        # obtain initialized local model
        for param, param_t in zip(params_p, params_tp):
            param.data = param_t.data.clone()


class ClientALA:
    def __init__(self, cid, model: dict, train_data, lr, local_epochs, batch_size, eta, rand_percent, layer_idx,
                 threshold, num_pre_loss):  # fmt: skip
        self.model = {k: v.clone().requires_grad_(True) for k, v in model.items()}  # copy.deepcopy(args.model)
        self.loss = nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.values(), lr=lr)
        self.local_epochs = local_epochs
        self.ALA = ALA(cid, self.loss, train_data, batch_size, rand_percent, layer_idx, eta, threshold, num_pre_loss)

    def train(self, trainloader):
        for epoch in range(self.local_epochs):
            for x, y in trainloader(epoch):
                output = forward(self.model, x)
                loss = self.loss(output, y)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()

    def local_initialization(self, received_global_model):
        self.ALA.adaptive_local_aggregation(received_global_model, self.model)

    def test_metrics(self, x: torch.Tensor, y: torch.Tensor) -> int:
        with torch.no_grad():
            return int((torch.argmax(forward(self.model, x), dim=1) == y).sum())


def fedala(model: dict, selected_rounds, train_data, batches, offsets, lr, local_epochs, batch_size, eta,
           rand_percent, layer_idx, threshold=0.1, num_pre_loss=10, tests=None):  # fmt: skip
    """FedALA.train's round loop over len(selected_rounds) rounds and the next round's send_models, where the
    clients' models are read. train_data: each client's [(x, y)] rows; batches(round, client, epoch) -> [(x, y)];
    offsets(round, client) -> the row offset ALA draws in that round's send_models; tests: each client's (x, y) test
    rows, or None. Returns per round (the global model after aggregation, every client's model after the next
    send_models, each one's correct test predictions at that round's evaluation or None, the clients)."""
    clients = [
        ClientALA(c, model, rows, lr, local_epochs, batch_size, eta, rand_percent, layer_idx, threshold, num_pre_loss)
        for c, rows in enumerate(train_data)
    ]
    global_model = {k: v.clone() for k, v in model.items()}
    out = []
    for i in range(len(selected_rounds) + 1):
        for c, client in enumerate(clients):  # send_models
            client.ALA.random.offset = offsets(i, c)
            client.local_initialization(global_model)
        if i > 0:  # the evaluation after send_models
            hits = None if tests is None else [c.test_metrics(*t) for c, t in zip(clients, tests)]
            models = [{k: v.detach().clone() for k, v in c.model.items()} for c in clients]
            out.append(({k: v.clone() for k, v in global_model.items()}, models, hits, clients))
        if i == len(selected_rounds):
            break
        selected_clients = selected_rounds[i]
        for c in selected_clients:
            clients[c].train(lambda epoch, r=i, c=c: batches(r, c, epoch))
        # receive_models
        tot_samples = sum(len(train_data[c]) for c in selected_clients)
        uploaded_weights = [len(train_data[c]) / tot_samples for c in selected_clients]
        uploaded_models = [{k: v.detach() for k, v in clients[c].model.items()} for c in selected_clients]
        # aggregate_parameters
        global_model = {k: torch.zeros_like(v) for k, v in uploaded_models[0].items()}
        for w, client_model in zip(uploaded_weights, uploaded_models):
            for k in global_model:
                global_model[k] += client_model[k].clone() * w
    return out
