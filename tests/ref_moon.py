"""A transcription of MOON's released code (QinbinLi/MOON @ 8fcba3c4, main.py): `train_net_fedcon` and the
`args.alg == 'moon'` branch of the round loop (model_buffer_size = 1, pool_option FIFO, no server momentum, no
files loaded), in plain torch, written from that code for tests/test_moon_release.py.

What it takes from outside, as the release takes it from its data loaders and `init_nets`: the networks (a dict of
tensors each; `forward` is the head featcache trains, ModelFedCon's (h, proj, out) reduced to (proj, out)), the
parties of each round (the release's `party_list_rounds`), each party's minibatches (its DataLoader's; drop_last)
and the optimizer's settings. Every party's own initial network (`nets`) is separate from the global one, as
`init_nets(args.net_config, args.n_parties)` and `init_nets(..., 1)` draw them."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


def forward(net: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pro, out) of the head: pro = ReLU(FC(x)), out = FC(pro)."""
    pro = torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])
    return pro, pro @ net["cls0.weight"].T + net["cls0.bias"]


def train_net_fedcon(net, global_net, previous_nets, batches, epochs, lr, reg, mu, temperature):
    """One party's local training (train_net_fedcon, args_optimizer == 'adam'); returns per epoch
    (epoch_loss, epoch_loss1, epoch_loss2)."""
    params = [p.requires_grad_(True) for p in net.values()]
    optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, params), lr=lr, weight_decay=reg)
    criterion = nn.CrossEntropyLoss()
    cos = torch.nn.CosineSimilarity(dim=-1)
    logs = []
    for epoch in range(epochs):
        epoch_loss_collector, epoch_loss1_collector, epoch_loss2_collector = [], [], []
        for x, target in batches(epoch):
            optimizer.zero_grad()
            target = target.long()
            pro1, out = forward(net, x)
            with torch.no_grad():
                pro2, _ = forward(global_net, x)
            posi = cos(pro1, pro2)
            logits = posi.reshape(-1, 1)
            for previous_net in previous_nets:
                with torch.no_grad():
                    pro3, _ = forward(previous_net, x)
                nega = cos(pro1, pro3)
                logits = torch.cat((logits, nega.reshape(-1, 1)), dim=1)
            logits /= temperature
            labels = torch.zeros(x.size(0)).long()
            loss2 = mu * criterion(logits, labels)
            loss1 = criterion(out, target)
            loss = loss1 + loss2
            loss.backward()
            optimizer.step()
            epoch_loss_collector.append(loss.item())
            epoch_loss1_collector.append(loss1.item())
            epoch_loss2_collector.append(loss2.item())
        n = len(epoch_loss_collector)
        logs.append((sum(epoch_loss_collector) / n, sum(epoch_loss1_collector) / n, sum(epoch_loss2_collector) / n))
    for p in params:
        p.requires_grad_(False)
    return logs


def moon(global_w, nets, party_list_rounds, sizes, batches, epochs, lr, reg, mu, temperature, model_buffer_size=1):
    """The round loop. global_w: the global network; nets: every party's own network (list); sizes: each party's
    len(net_dataidx_map[r]); batches(round, party, epoch) -> [(x, target)]. Returns (global network after each
    round, per round {party: its train_net_fedcon logs})."""
    global_w = {k: v.clone() for k, v in global_w.items()}
    nets = [{k: v.clone() for k, v in net.items()} for net in nets]
    old_nets_pool: list = []
    globals_, logs = [], []
    for round in range(len(party_list_rounds)):
        party_list_this_round = party_list_rounds[round]
        global_model = {k: v.clone() for k, v in global_w.items()}  # global_model.eval(), requires_grad False
        nets_this_round = {k: nets[k] for k in party_list_this_round}
        for net in nets_this_round.values():
            for k in net:  # net.load_state_dict(global_w)
                net[k] = global_w[k].clone()
        round_logs = {}
        for net_id, net in nets_this_round.items():  # local_train_net
            prev_models = [old_nets_pool[i][net_id] for i in range(len(old_nets_pool))]
            round_logs[net_id] = train_net_fedcon(
                net,
                global_model,
                prev_models,
                lambda epoch, r=round, n=net_id: batches(r, n, epoch),
                epochs,
                lr,
                reg,
                mu,
                temperature,
            )
            nets[net_id] = net
        total_data_points = sum(sizes[r] for r in party_list_this_round)
        fed_avg_freqs = [sizes[r] / total_data_points for r in party_list_this_round]
        for net_id, net in enumerate(nets_this_round.values()):
            net_para = net
            if net_id == 0:
                for key in net_para:
                    global_w[key] = net_para[key] * fed_avg_freqs[net_id]
            else:
                for key in net_para:
                    global_w[key] += net_para[key] * fed_avg_freqs[net_id]
        globals_.append({k: v.clone() for k, v in global_w.items()})
        logs.append(round_logs)
        if len(old_nets_pool) < model_buffer_size:
            old_nets_pool.append(copy.deepcopy(nets))
        else:  # FIFO
            old_nets = copy.deepcopy(nets)
            for i in range(model_buffer_size - 2, -1, -1):
                old_nets_pool[i] = old_nets_pool[i + 1]
            old_nets_pool[model_buffer_size - 1] = old_nets
    return globals_, logs
