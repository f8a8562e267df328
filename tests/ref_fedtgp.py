"""A transcription of FedTGP as its authors release it (TsingZ0/FedTGP @ c77cbbb31eb30d13066cd11f7f4a2e732aeaae24,
system/flcore/servers/servertgp.py `FedTGP.__init__`, `train`, `receive_protos`, `update_TGP`, `proto_cluster`,
`Trainable_Global_Prototypes`; system/flcore/clients/clienttgp.py `clientTGP.train`, `collect_protos`,
`test_metrics`, `agg_func`; system/flcore/clients/clientbase.py the CrossEntropyLoss; the same two algorithm files as
TsingZ0/HtFLlib @ e959261d906f40377410bc4d9d13ba3f6af56782), in plain torch, written from that code for
tests/test_algo_fedtgp.py.

What it takes from outside, as the release takes it from its data loaders, `select_clients`, nn.Embedding/nn.Linear
initialisation and DataLoader's shuffle: the initial client model (one dict of tensors: BaseHeadSplit with base =
FC + ReLU and head = the last FC; every client starts from it), the initial TGP (a dict: embedings.weight [K, d],
middle.0 = Linear(d, d), fc = Linear(d, d)), the selected clients of each iteration, each client's training
minibatches, the rows of its prototype pass (`collect_protos`' loader) and its test rows, and the order of each pass
of the server's shuffled loader over the uploaded prototypes. Defaults of the release: no slow clients, eval_gap 1,
plain SGD (the server's at the clients' learning rate, `self.server_learning_rate = args.local_learning_rate`)."""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


def base(net: dict, x: torch.Tensor) -> torch.Tensor:
    """model.base: FC + ReLU."""
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])


def head(net: dict, rep: torch.Tensor) -> torch.Tensor:
    """model.head: the last FC."""
    return rep @ net["cls0.weight"].T + net["cls0.bias"]


def TGP(tgp: dict, class_id) -> torch.Tensor:
    """Trainable_Global_Prototypes.forward: fc(middle(embedings(class_id))), middle = Linear + ReLU."""
    emb = tgp["embedings.weight"][torch.as_tensor(class_id)]
    mid = torch.relu(emb @ tgp["middle.0.weight"].T + tgp["middle.0.bias"])
    return mid @ tgp["fc.weight"].T + tgp["fc.bias"]


def train(model: dict, batches, global_protos, local_epochs: int, lr: float, lamda: float) -> None:
    """clientTGP.train (without collect_protos, called after it by the round loop)."""
    params = [p.requires_grad_(True) for p in model.values()]
    optimizer = torch.optim.SGD(params, lr=lr)
    loss_fn, loss_mse = nn.CrossEntropyLoss(), nn.MSELoss()
    for step in range(local_epochs):
        for x, y in batches(step):
            rep = base(model, x)
            output = head(model, rep)
            loss = loss_fn(output, y)

            if global_protos is not None:
                proto_new = copy.deepcopy(rep.detach())
                for i, yy in enumerate(y):
                    y_c = yy.item()
                    if type(global_protos[y_c]) != type([]):  # noqa: E721 (the release's test)
                        proto_new[i, :] = global_protos[y_c].data
                loss += loss_mse(proto_new, rep) * lamda

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for p in params:
        p.requires_grad_(False)


def agg_func(protos):
    """clienttgp.agg_func (FedProto's): each label's list of representations summed in order, / its length."""
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
    """clientTGP.collect_protos: model.eval(), base(x) of every row of the loader, per label."""
    protos = defaultdict(list)
    with torch.no_grad():
        for x, y in loader:
            rep = base(model, x)
            for i, yy in enumerate(y):
                y_c = yy.item()
                protos[y_c].append(rep[i, :].detach().data)
    return agg_func(protos)


def proto_cluster(protos_list):
    proto_clusters = defaultdict(list)
    for protos in protos_list:
        for k in protos.keys():
            proto_clusters[k].append(protos[k])

    for k in proto_clusters.keys():
        protos = torch.stack(proto_clusters[k])
        proto_clusters[k] = torch.mean(protos, dim=0).detach()

    return proto_clusters


def receive_protos(client_protos: dict, selected_clients, num_classes: int):
    """FedTGP.receive_protos: (uploaded_protos, each entry's (client, class) for `shuffle` alone, max_gap)."""
    uploaded_protos, keys = [], []
    uploaded_protos_per_client = []
    for c in selected_clients:
        protos = client_protos[c]
        for k in protos.keys():
            uploaded_protos.append((protos[k], k))
            keys.append((c, k))
        uploaded_protos_per_client.append(protos)

    # calculate class-wise minimum distance
    gap = torch.ones(num_classes) * 1e9
    avg_protos = proto_cluster(uploaded_protos_per_client)
    for k1 in avg_protos.keys():
        for k2 in avg_protos.keys():
            if k1 > k2:
                dis = torch.norm(avg_protos[k1] - avg_protos[k2], p=2)
                gap[k1] = torch.min(gap[k1], dis)
                gap[k2] = torch.min(gap[k2], dis)
    min_gap = torch.min(gap)
    for i in range(len(gap)):
        if gap[i] > torch.tensor(1e8):
            gap[i] = min_gap
    max_gap = torch.max(gap)
    return uploaded_protos, keys, max_gap


def update_TGP(
    tgp: dict, uploaded_protos, shuffle, max_gap, num_classes, batch_size, server_lr, server_epochs, margin_threthold
):
    """FedTGP.update_TGP: server_epochs passes of a DataLoader(uploaded_protos, batch_size, drop_last=False,
    shuffle=True) (shuffle(epoch) -> the permutation its sampler draws), a fresh SGD per round. Returns the global
    prototypes TGP(class_id) of every class."""
    params = [p.requires_grad_(True) for p in tgp.values()]
    TGP_opt = torch.optim.SGD(params, lr=server_lr)
    CEloss = nn.CrossEntropyLoss()
    for e in range(server_epochs):
        proto_loader = DataLoader([uploaded_protos[j] for j in shuffle(e)], batch_size, drop_last=False, shuffle=False)
        for proto, y in proto_loader:
            y = torch.Tensor(y).type(torch.int64)

            proto_gen = TGP(tgp, list(range(num_classes)))

            features_square = torch.sum(torch.pow(proto, 2), 1, keepdim=True)
            centers_square = torch.sum(torch.pow(proto_gen, 2), 1, keepdim=True)
            features_into_centers = torch.matmul(proto, proto_gen.T)
            dist = features_square - 2 * features_into_centers + centers_square.T
            dist = torch.sqrt(dist)

            one_hot = F.one_hot(y, num_classes)
            margin = min(max_gap.item(), margin_threthold)
            dist = dist + one_hot * margin
            loss = CEloss(-dist, y)

            TGP_opt.zero_grad()
            loss.backward()
            TGP_opt.step()
    for p in params:
        p.requires_grad_(False)

    global_protos = defaultdict(list)
    for class_id in range(num_classes):
        global_protos[class_id] = TGP(tgp, torch.tensor(class_id)).detach()
    return global_protos


def test_metrics(model: dict, x: torch.Tensor, y: torch.Tensor, global_protos) -> tuple[int, int]:
    """clientTGP.test_metrics: argmin over the global prototypes of MSE(rep, proto); (0, 0) before any exists."""
    if global_protos is None:
        return 0, 0
    loss_mse = nn.MSELoss()
    with torch.no_grad():
        rep = base(model, x)
        output = float("inf") * torch.ones(y.shape[0], len(global_protos))
        for i, r in enumerate(rep):
            for j, pro in global_protos.items():
                if type(pro) != type([]):  # noqa: E721 (the release's test)
                    output[i, j] = loss_mse(r, pro)
    return int((torch.argmin(output, dim=1) == y).sum()), len(y)


def fedtgp(
    x0: dict,
    tgp0: dict,
    n_clients: int,
    num_classes: int,
    selected_rounds,
    batches,
    proto_rows,
    test,
    shuffle,
    local_epochs: int,
    lr: float,
    lamda: float,
    batch_size: int,
    server_epochs: int,
    margin_threthold: float,
):
    """FedTGP.train over len(selected_rounds) iterations. batches(i, client, epoch) -> [(x, y)]; proto_rows(i,
    client) -> [(x, y)]; test(client) -> (x, y); shuffle(i, epoch, keys) -> the permutation of the uploaded
    prototypes, keys their (client, class) in upload order. Returns (the TGP and the global prototypes [K, d] after
    each iteration, every client's model after each iteration, per iteration each client's (correct, rows) before
    training)."""
    clients = [{k: v.clone() for k, v in x0.items()} for _ in range(n_clients)]
    tgp = {k: v.clone() for k, v in tgp0.items()}
    global_protos = None  # load_item('Server', 'global_protos') before the first update_TGP
    rounds, models, evaluations = [], [], []
    for i, selected_clients in enumerate(selected_rounds):
        evaluations.append([test_metrics(clients[c], *test(c), global_protos) for c in range(n_clients)])
        protos = {}
        for c in selected_clients:
            train(clients[c], lambda step, i=i, c=c: batches(i, c, step), global_protos, local_epochs, lr, lamda)
            protos[c] = collect_protos(clients[c], proto_rows(i, c))
        uploaded_protos, keys, max_gap = receive_protos(protos, selected_clients, num_classes)
        shuffled = lambda e, i=i, keys=keys: shuffle(i, e, keys)
        global_protos = update_TGP(
            tgp, uploaded_protos, shuffled, max_gap, num_classes, batch_size, lr, server_epochs, margin_threthold
        )
        rounds.append(
            ({k: v.clone() for k, v in tgp.items()}, torch.stack([global_protos[k] for k in range(num_classes)]))
        )
        models.append([{k: v.clone() for k, v in client.items()} for client in clients])
    return rounds, models, evaluations
