"""A transcription of FedGH as TsingZ0 releases it, in plain torch, written from that code for
tests/test_algo_fedgh.py: HtFLlib (TsingZ0/HtFLlib @ e959261d906f40377410bc4d9d13ba3f6af56782,
system/flcore/servers/servergh.py `FedGH.__init__`, `train`, `receive_protos`, `train_head`;
system/flcore/clients/clientgh.py `clientGH.train`, `set_parameters`, `collect_protos`, `agg_func`;
system/flcore/servers/serverbase.py `send_parameters`; system/flcore/clients/clientbase.py `test_metrics` and the
CrossEntropyLoss), and PFLlib's (TsingZ0/PFLlib @ d832e76f6a23b833038949ec1e4fdefe63a4d350, the same two files),
which differs in one place that matters (`pflib_head`): its server's header `self.head = self.clients[0].model.head`
is client 0's own header module, so client 0's local training moves it (and its opt_h, created once, is plain SGD:
no state). PFLlib's server makes one pass (`server_epochs` = 1).

What it takes from outside, as the releases take it from their data loaders, `select_clients` and DataLoader's
shuffle: the initial model (one dict of tensors: BaseHeadSplit with base = FC + ReLU and head = the last FC; every
client starts from it, the server's header from client 0's), the selected clients of each iteration, each client's
training minibatches (its DataLoader's), the rows of its prototype pass (`collect_protos`' loader) and its test rows,
and the order of each pass of the server's shuffled loader over the uploaded prototypes. Defaults of the releases:
no slow clients, client_drop_rate 0 (receive_protos' random.sample then only reorders the clients, which the
shuffled loader reorders anyway), eval_gap 1, plain SGD."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

BASE, HEAD = ("proj0.weight", "proj0.bias"), ("cls0.weight", "cls0.bias")  # model.base, model.head parameters


def base(net: dict, x: torch.Tensor) -> torch.Tensor:
    """model.base: FC + ReLU."""
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])


def head(net: dict, rep: torch.Tensor) -> torch.Tensor:
    """model.head: the last FC."""
    return rep @ net["cls0.weight"].T + net["cls0.bias"]


def train(model: dict, batches, local_epochs: int, lr: float) -> None:
    """clientGH.train: the whole model on CrossEntropyLoss, a fresh torch.optim.SGD(model.parameters(), lr)."""
    params = [p.requires_grad_(True) for p in model.values()]
    optimizer = torch.optim.SGD(params, lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(local_epochs):
        for x, y in batches(step):
            output = head(model, base(model, x))
            loss = loss_fn(output, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for p in params:
        p.requires_grad_(False)


def set_parameters(model: dict, server_head: dict) -> None:
    """clientGH.set_parameters: old_param.data = new_param.data.clone() over the head's parameters."""
    for k in HEAD:
        model[k] = server_head[k].clone()


def agg_func(protos):
    """clientgh.agg_func (FedProto's): each label's list of representations summed in order, / its length."""
    for [label, proto_list] in protos.items():
        if len(proto_list) > 1:
            proto = 0 * proto_list[0].data
            for i in proto_list:
                proto += i.data
            protos[label] = proto / len(proto_list)
        else:
            protos[label] = proto_list[0]
    return protos


def collect_protos(model: dict, loader) -> dict:
    """clientGH.collect_protos: model.eval(), base(x) of every row of the loader, per label."""
    protos = defaultdict(list)
    with torch.no_grad():
        for x, y in loader:
            rep = base(model, x)
            for i, yy in enumerate(y):
                y_c = yy.item()
                protos[y_c].append(rep[i, :].detach().data)
    return agg_func(protos)


def train_head(server_head: dict, uploaded, shuffle, batch_size: int, server_lr: float, server_epochs: int) -> None:
    """FedGH.train_head: DataLoader(uploaded_protos, batch_size, drop_last=False, shuffle=True), a fresh
    torch.optim.SGD(head.parameters(), lr=server_learning_rate), server_epochs passes of CrossEntropyLoss.
    shuffle(epoch) -> the permutation of uploaded's entries the loader's sampler draws for that pass."""
    params = [server_head[k].requires_grad_(True) for k in HEAD]
    opt_h = torch.optim.SGD(params, lr=server_lr)
    CEloss = nn.CrossEntropyLoss()
    for epoch in range(server_epochs):
        proto_loader = DataLoader([uploaded[j] for j in shuffle(epoch)], batch_size, drop_last=False, shuffle=False)
        for p, y in proto_loader:
            out = head(server_head, p)
            loss = CEloss(out, y)
            opt_h.zero_grad()
            loss.backward()
            opt_h.step()
    for p in params:
        p.requires_grad_(False)


def test_metrics(model: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """clientbase.test_metrics: (correct, rows) of model(x) = head(base(x))."""
    with torch.no_grad():
        output = head(model, base(model, x))
    return int((torch.argmax(output, dim=1) == y).sum()), len(y)


def fedgh(
    x0: dict,
    n_clients: int,
    selected_rounds,
    batches,
    proto_rows,
    test,
    shuffle,
    local_epochs: int,
    lr: float,
    batch_size: int,
    server_lr: float,
    server_epochs: int,
    pflib_head: bool = False,
):
    """FedGH.train over len(selected_rounds) iterations. batches(i, client, epoch) -> [(x, y)]; proto_rows(i, client)
    -> [(x, y)] (collect_protos' loader); test(client) -> (x, y); shuffle(i, epoch, keys) -> the permutation of the
    uploaded prototypes, keys their (client, class) in upload order. Returns (the server's header after each
    iteration, every client's model after each iteration, per iteration each client's (correct, rows) after
    send_parameters and before training)."""
    clients = [{k: v.clone() for k, v in x0.items()} for _ in range(n_clients)]  # a BaseHeadSplit per client
    server_head = {k: x0[k].clone() for k in HEAD}  # load_item(self.clients[0].role, 'model').head
    heads, models, evaluations = [], [], []
    for i, selected_clients in enumerate(selected_rounds):
        for client in clients:  # send_parameters: every client, not only the selected ones
            set_parameters(client, server_head)
        evaluations.append([test_metrics(clients[c], *test(c)) for c in range(n_clients)])
        protos = {}
        for c in selected_clients:
            train(clients[c], lambda epoch, i=i, c=c: batches(i, c, epoch), local_epochs, lr)
            protos[c] = collect_protos(clients[c], proto_rows(i, c))
        if pflib_head:  # PFLlib: self.head is clients[0].model.head, trained with client 0 when it took part
            server_head = clients[0]
        uploaded_protos, keys = [], []  # receive_protos (keys: each entry's (client, class), for `shuffle` alone)
        for c in selected_clients:
            for cc in protos[c].keys():
                y = torch.tensor(cc, dtype=torch.int64)
                uploaded_protos.append((protos[c][cc], y))
                keys.append((c, cc))
        shuffled = lambda epoch, i=i, keys=keys: shuffle(i, epoch, keys)
        train_head(server_head, uploaded_protos, shuffled, batch_size, server_lr, server_epochs)
        heads.append({k: server_head[k].clone() for k in HEAD})
        models.append([{k: v.clone() for k, v in client.items()} for client in clients])
    return heads, models, evaluations
