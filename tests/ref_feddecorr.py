"""A transcription of FedDecorr as released (bytedance/FedDecorr @ 973e4af2: `loss.py` `FedDecorrLoss` and
`approach/fedavg.py` `FedAvg.local_training`, `_local_training` with `--feddecorr`, `global_aggregation`), in plain
torch, written from that code for tests/test_algo_feddecorr.py.

What it takes from outside, as the release takes it from `main.py`: the global network (a dict of tensors; `forward`
returns (out, features) as the release's networks do with return_features=True, here the head featcache trains), the
parties of each round (`party_list_rounds`), each party's minibatches (its DataLoader's: shuffled, drop_last False),
its dataset size and the optimizer's settings (SGD with lr, momentum `rho` and weight decay, created afresh in every
local training)."""

from __future__ import annotations

import torch
import torch.nn as nn


def forward(net: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, features): features = ReLU(FC(x)), out = FC(features)."""
    features = torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])
    return features @ net["cls0.weight"].T + net["cls0.bias"], features


class FedDecorrLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.eps = 1e-8

    def _off_diagonal(self, mat):
        n, m = mat.shape
        assert n == m
        return mat.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()

    def forward(self, x):
        N, C = x.shape
        if N == 1:
            return 0.0
        x = x - x.mean(dim=0, keepdim=True)
        x = x / torch.sqrt(self.eps + x.var(dim=0, keepdim=True))
        corr_mat = torch.matmul(x.t(), x)
        loss = (self._off_diagonal(corr_mat).pow(2)).mean()
        loss = loss / N
        return loss


def _local_training(net, batches, epochs, lr, rho, weight_decay, feddecorr_coef):
    params = [p.requires_grad_(True) for p in net.values()]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=rho, weight_decay=weight_decay)
    criterion = nn.CrossEntropyLoss()
    feddecorr = FedDecorrLoss()
    for epoch in range(epochs):
        for x, target in batches(epoch):
            target = target.long()
            optimizer.zero_grad()
            out, features = forward(net, x)
            loss = criterion(out, target)
            loss_feddecorr = feddecorr(features)
            loss = loss + feddecorr_coef * loss_feddecorr
            loss.backward()
            optimizer.step()
    for p in params:
        p.requires_grad_(False)


def feddecorr(global_w, party_list_rounds, sizes, batches, epochs, lr, rho, weight_decay, feddecorr_coef):
    """run_fed. sizes[c]: len(party2loaders[c].dataset); batches(round, party, epoch) -> [(x, target)]. Returns the
    global network after each round."""
    global_w = {k: v.clone() for k, v in global_w.items()}
    out = []
    for comm_round, party_list_this_round in enumerate(party_list_rounds):
        nets_this_round = {k: {n: v.clone() for n, v in global_w.items()} for k in party_list_this_round}
        for party_id, net in nets_this_round.items():
            _local_training(
                net,
                lambda e, r=comm_round, c=party_id: batches(r, c, e),
                epochs,
                lr,
                rho,
                weight_decay,
                feddecorr_coef,
            )
        total_data_points = sum(sizes[r] for r in nets_this_round)
        fed_avg_freqs = [sizes[r] / total_data_points for r in nets_this_round]
        for net_id, net in enumerate(nets_this_round.values()):
            if net_id == 0:
                for key in net:
                    global_w[key] = net[key] * fed_avg_freqs[net_id]
            else:
                for key in net:
                    global_w[key] += net[key] * fed_avg_freqs[net_id]
        out.append({k: v.clone() for k, v in global_w.items()})
    return out
