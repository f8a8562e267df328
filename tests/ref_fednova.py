"""A transcription of FedNova as NIID-Bench releases it (Xtra-Computing/NIID-Bench @
fa47720d0dbf8a42da817d3a0ee05a1dd71fcd5b, experiments.py: `train_net_fednova`, `local_train_net_fednova` and the
`args.alg == 'fednova'` branch of the round loop, is_same_initial=1), in plain torch, written from that code for
tests/test_algo_fednova.py. Neither PFLlib (TsingZ0/PFLlib @ d832e76f) nor FL-bench (KarhouTam/FL-bench @ 06e658bc)
releases FedNova; NIID-Bench is the benchmark release of the same group of baselines (FedAvg, FedProx, SCAFFOLD,
FedNova, MOON).

What it takes from outside, as NIID-Bench takes it from its data loaders and its `np.random.shuffle` of the parties:
the global model (a dict of tensors; `forward` is the head featcache trains), the parties of each round, each
party's minibatches (its DataLoader's, drop_last=False) and the optimizer's settings (lr, args.rho, args.reg)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    """The head's logits: FC(ReLU(FC(x)))."""
    pro = torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])
    return pro @ net["cls0.weight"].T + net["cls0.bias"]


def train_net_fednova(net, global_model, batches, epochs, lr, rho, reg):
    """Returns (a_i, norm_grad)."""
    params = [p.requires_grad_(True) for p in net.values()]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=rho, weight_decay=reg)
    criterion = nn.CrossEntropyLoss()
    tau = 0
    for epoch in range(epochs):
        for x, target in batches(epoch):
            optimizer.zero_grad()
            target = target.long()
            out = forward(net, x)
            loss = criterion(out, target)
            loss.backward()
            optimizer.step()
            tau = tau + 1
    for p in params:
        p.requires_grad_(False)
    a_i = (tau - rho * (1 - pow(rho, tau)) / (1 - rho)) / (1 - rho)
    global_model_para = global_model
    net_para = net
    norm_grad = copy.deepcopy(global_model)
    for key in norm_grad:
        norm_grad[key] = torch.true_divide(global_model_para[key] - net_para[key], a_i)
    return a_i, norm_grad


def fednova(global_w, selected_rounds, sizes, batches, epochs, lr, rho, reg):
    """The round loop. selected_rounds: the parties of each round; sizes: len(net_dataidx_map[i]) per party;
    batches(round, party, epoch) -> [(x, target)]. Returns the global model after each round."""
    global_model = {k: v.clone() for k, v in global_w.items()}
    out = []
    for round, selected in enumerate(selected_rounds):
        global_para = global_model
        nets = {idx: {k: v.clone() for k, v in global_para.items()} for idx in selected}  # load_state_dict
        a_list, d_list, n_list = [], [], []
        for net_id in selected:  # local_train_net_fednova
            a_i, d_i = train_net_fednova(
                nets[net_id], global_model, lambda e, r=round, n=net_id: batches(r, n, e), epochs, lr, rho, reg
            )
            a_list.append(a_i)
            d_list.append(d_i)
            n_list.append(sizes[net_id])
        total_n = sum(n_list)
        d_total_round = copy.deepcopy(global_model)
        for key in d_total_round:
            d_total_round[key] = 0.0
        for i in range(len(selected)):
            d_para = d_list[i]
            for key in d_para:
                d_total_round[key] += d_para[key] * n_list[i] / total_n
        coeff = 0.0
        for i in range(len(selected)):
            coeff = coeff + a_list[i] * n_list[i] / total_n
        updated_model = {k: v.clone() for k, v in global_model.items()}
        for key in updated_model:
            updated_model[key] -= coeff * d_total_round[key]
        global_model = updated_model
        out.append({k: v.clone() for k, v in global_model.items()})
    return out
