"""A transcription of APFL as PFLlib releases it (TsingZ0/PFLlib @ d832e76f6a23b833038949ec1e4fdefe63a4d350,
system/flcore/clients/clientapfl.py: `clientAPFL.__init__`, `train`, `alpha_update`, `test_metrics`;
system/flcore/servers/serverapfl.py: `APFL.train`; serverbase.py: `send_models`, `receive_models`,
`aggregate_parameters`, `add_parameters`; clientbase.py: `set_parameters`, SGD, CrossEntropyLoss), in plain torch,
written from that code for tests/test_algo_apfl.py. No slow clients, no client drops, no learning-rate decay
(PFLlib's defaults).

What it takes from outside, as PFLlib takes it from its arguments, data loaders and `select_clients`: the initial
model (a dict of tensors; `forward` is the head featcache trains, FC + ReLU + FC), the clients selected each round,
each client's minibatches (`load_train_data`'s DataLoader, drop_last=True), each client's training rows (the
server's weights), args.alpha and args.local_learning_rate."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"]) @ net["cls0.weight"].T + net["cls0.bias"]


class ClientAPFL:
    def __init__(self, model: dict, alpha: float, lr: float, local_epochs: int):
        self.model = {k: v.clone().requires_grad_(True) for k, v in model.items()}  # copy.deepcopy(args.model)
        self.loss = nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.values(), lr=lr)
        self.learning_rate = lr
        self.local_epochs = local_epochs
        self.alpha = alpha
        self.model_per = {k: v.detach().clone().requires_grad_(True) for k, v in self.model.items()}  # deepcopy
        self.optimizer_per = torch.optim.SGD(self.model_per.values(), lr=lr)

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

                output_per = forward(self.model_per, x)
                loss_per = self.loss(output_per, y)
                self.optimizer_per.zero_grad()
                loss_per.backward()
                self.optimizer_per.step()

                self.alpha_update()

        for lp, p in zip(self.model_per.values(), self.model.values()):
            lp.data = (1 - self.alpha) * p + self.alpha * lp

    def alpha_update(self):
        grad_alpha = 0
        for l_params, p_params in zip(self.model.values(), self.model_per.values()):
            dif = p_params.data - l_params.data
            grad = self.alpha * p_params.grad.data + (1 - self.alpha) * l_params.grad.data
            grad_alpha += dif.view(-1).dot(grad.view(-1))  # the release's `.T` of the 1-d view (a no-op) left out

        grad_alpha += 0.02 * self.alpha
        self.alpha = self.alpha - self.learning_rate * grad_alpha
        self.alpha = np.clip(self.alpha.item(), 0.0, 1.0)

    def test_metrics(self, x: torch.Tensor, y: torch.Tensor) -> int:
        with torch.no_grad():
            output = forward(self.model_per, x)
            return int((torch.argmax(output, dim=1) == y).sum())


def apfl(model: dict, selected_rounds, train_samples, batches, local_epochs, lr, alpha, tests=None):
    """APFL.train's round loop. selected_rounds: the clients selected in each round; train_samples: each client's
    training rows; batches(round, client, epoch) -> [(x, y)]; tests: each client's (x, y) test rows, or None.
    Returns per round (the global model after aggregation, every client's (model_per, alpha), the correct test
    predictions of every client's model_per at the next round's evaluation, or None without tests)."""
    clients = [ClientAPFL(model, alpha, lr, local_epochs) for _ in train_samples]
    global_model = {k: v.clone() for k, v in model.items()}
    out = []
    for i, selected_clients in enumerate(selected_rounds):
        for client in clients:  # send_models
            client.set_parameters(global_model)
        for c in selected_clients:
            clients[c].train(lambda epoch, r=i, c=c: batches(r, c, epoch))
        # receive_models
        tot_samples = sum(train_samples[c] for c in selected_clients)
        uploaded_weights = [train_samples[c] / tot_samples for c in selected_clients]
        uploaded_models = [{k: v.detach() for k, v in clients[c].model.items()} for c in selected_clients]
        # aggregate_parameters
        global_model = {k: torch.zeros_like(v) for k, v in uploaded_models[0].items()}
        for w, client_model in zip(uploaded_weights, uploaded_models):
            for k in global_model:
                global_model[k] += client_model[k].clone() * w
        # the next round's evaluate() scores model_per, which send_models leaves alone
        hits = None if tests is None else [c.test_metrics(*t) for c, t in zip(clients, tests)]
        out.append(
            (
                {k: v.clone() for k, v in global_model.items()},
                [({k: v.detach().clone() for k, v in c.model_per.items()}, float(c.alpha)) for c in clients],
                hits,
            )
        )
    return out
