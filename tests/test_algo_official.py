"""The `-official` variants against transcriptions of the released code, written here line by line in the released
code's own style (loops, dictionaries, torch.min over a distance matrix), never with the algorithms' helpers:
FedPCL's ConLoss on its two-view batch and its round-0 zero loss (yuetan031/FedPCL lib/losses.py, lib/update.py),
FedProto's nearest-global-prototype inference (yuetan031/FedProto test_inference_new_het_lt) and FedProc's α
schedule (MuXutong/FedProc train.py, train_net_fedproc)."""

from __future__ import annotations

import pytest
import torch
from conftest import configure
import torch.nn.functional as F

from featcache.algorithms import create
from featcache.training.engine import Engine
from tests.synthetic import synthetic_clients


# -- FedPCL: ConLoss on torch.cat([images[0], images[1]]) ----------------------------------------------------------
def released_conloss(features, labels, global_protos, temperature=0.07, base_temperature=0.07):
    """lib/losses.py ConLoss.forward, contrast_mode='all', features [bsz, n_views, d], global_protos {label: [d]}."""
    batch_size = features.shape[0]
    labels = labels.contiguous().view(-1, 1)
    mask = torch.eq(labels, labels.T).float()
    contrast_count = features.shape[1]
    contrast_feature = torch.cat(torch.unbind(features, dim=1), dim=0)
    anchor_count = contrast_count
    anchor_feature = torch.zeros_like(contrast_feature)
    for i in range(batch_size * anchor_count):
        anchor_feature[i, :] = global_protos[labels[i % batch_size].item()]
    anchor_dot_contrast = torch.div(torch.matmul(anchor_feature, contrast_feature.T), temperature)
    logits_max, _ = torch.max(anchor_dot_contrast, dim=1, keepdim=True)
    logits = anchor_dot_contrast - logits_max.detach()
    mask = mask.repeat(anchor_count, contrast_count)
    logits_mask = torch.scatter(torch.ones_like(mask), 1, torch.arange(batch_size * anchor_count).view(-1, 1), 0)
    mask = mask * logits_mask
    exp_logits = torch.exp(logits) * logits_mask
    log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
    mean_log_prob_pos = (mask * log_prob).sum(1) / mask.sum(1)
    loss = -(temperature / base_temperature) * mean_log_prob_pos
    return loss.view(anchor_count, batch_size).mean()


def released_loss2(params, images, labels, client_protos, global_avg_protos):
    """update_weights_lg's loss for fedpcl: the two (identical) views concatenated, ConLoss summed over clients."""
    images = torch.cat([images, images], dim=0)
    features = F.normalize(torch.relu(images @ params["proj0.weight"].T + params["proj0.bias"]), dim=1)
    bsz = labels.shape[0]
    f1, f2 = torch.split(features, [bsz, bsz], dim=0)
    features = torch.cat([f1.unsqueeze(1), f2.unsqueeze(1)], dim=1)
    loss2 = 0
    for protos in client_protos:
        protos = dict(protos)
        for label in global_avg_protos.keys():
            if label not in protos.keys():
                protos[label] = global_avg_protos[label]
        loss2 += released_conloss(features, labels, protos)
    return loss2


def test_fedpcl_official_loss_equals_the_released_two_view_conloss():
    g = torch.Generator().manual_seed(0)
    D, d, K, P, B = 6, 5, 4, 3, 8
    params = {"proj0.weight": torch.randn(d, D, generator=g), "proj0.bias": torch.randn(d, generator=g)}
    x, y = torch.randn(B, D, generator=g), torch.tensor([0, 1, 2, 0, 1, 3, 3, 0])
    glob = F.normalize(torch.randn(K, d, generator=g), dim=-1)
    owned = [[0, 1, 2], [0, 3], [1, 2, 3]]  # classes each client holds; the rest are padded with the global ones
    local = F.normalize(torch.randn(P, K, d, generator=g), dim=-1)
    padded = torch.stack([torch.stack([local[p, k] if k in owned[p] else glob[k] for k in range(K)]) for p in range(P)])
    client_protos = [{k: local[p, k] for k in owned[p]} for p in range(P)]
    cfg = configure("fedpcl-official", proj_dim=d)
    algo = create("fedpcl-official", cfg)
    ctx = {"hp": {"tau": torch.tensor(0.07)}, "padded": padded, "prototypes": glob, "started": torch.tensor(1.0)}
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ours, _ = algo.local_loss(leaves, {}, x, y, torch.ones(B, dtype=torch.bool), ctx)
    ref_leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = released_loss2(ref_leaves, x, y, client_protos, {k: glob[k] for k in range(K)})
    torch.testing.assert_close(ours, ref)
    ref_grads = torch.autograd.grad(ref, list(ref_leaves.values()))
    for a, b in zip(torch.autograd.grad(ours, list(leaves.values())), ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    padded_rows = algo.local_loss(params, {}, torch.cat([x, torch.zeros(3, D)]), torch.cat([y, -torch.ones(3).long()]),
                                  torch.arange(B + 3) < B, ctx)[0]
    torch.testing.assert_close(padded_rows, ref.detach())  # padding rows change nothing


def test_fedpcl_official_round_zero_only_decays():
    """Round 0 has no global prototypes in the released code: zero loss, so plain SGD leaves the model as it was."""
    train = synthetic_clients(C=3, n=(10, 16), D=6, K=4, seed=0)
    algo = create("fedpcl-official")
    cfg = configure(algo, proj_dim=5, rounds=2, batch_size=4, optimizer="sgd",
                    momentum=0.0, weight_decay=0.0, lr=0.1)
    eng = Engine(algo, [cfg], train, train)
    state = eng.init_state()
    before = {k: v.clone() for k, v in state.params.items()}
    eng.local_train(state, 0, [[True] * 3])
    for k in before:
        torch.testing.assert_close(state.params[k], before[k], rtol=0, atol=0)
    eng.local_train(state, 1, [[True] * 3])
    assert any(not torch.equal(state.params[k], before[k]) for k in before)


# -- FedProto: infer=proto over the client's own classes ------------------------------------------------------------
def released_proto_predictions(protos, global_protos, classes_list, num_classes):
    """test_inference_new_het_lt: distance 100 everywhere, nn.MSELoss to the global prototypes of the client's
    classes that have one, torch.min."""
    loss_mse = torch.nn.MSELoss()
    a_large_num = 100
    dist = a_large_num * torch.ones(size=(protos.shape[0], num_classes))
    for i in range(protos.shape[0]):
        for j in range(num_classes):
            if j in global_protos.keys() and j in classes_list:
                dist[i, j] = loss_mse(protos[i, :], global_protos[j][0])
    _, pred_labels = torch.min(dist, 1)
    return pred_labels


def test_fedproto_proto_inference_follows_the_released_code():
    train = synthetic_clients(C=3, n=(10, 16), D=6, K=4, seed=0)
    algo = create("fedproto")
    cfg = configure(algo, proj_dim=5, rounds=1, batch_size=4, infer="proto")
    eng = Engine(algo, [cfg], train, train)
    state = eng.init_state()
    g = torch.Generator().manual_seed(1)
    state.server = {"prototypes": torch.randn(1, 4, 5, generator=g), "has": torch.tensor([[True, True, False, True]])}
    own = torch.tensor([[True, False, True, True], [False, True, True, False], [True, True, True, True]])
    state.client["own_classes"] = own[None]
    x = torch.randn(40, 6, generator=g) * 3
    ctx = eng.algo.context(state, eng.round_context(0))
    ctx_all = dict(ctx)
    differ = 0
    for c in range(3):
        params = {k: v[0, c] for k, v in state.params.items()}
        ctx_c = torch.utils._pytree.tree_map(lambda t: t[0, c], ctx)
        ours = eng.algo.predict(params, {}, x, ctx_c).argmax(-1)
        z = torch.relu(x @ params["proj0.weight"].T + params["proj0.bias"])
        glob = {k: [state.server["prototypes"][0, k]] for k in range(4) if state.server["has"][0, k]}
        ref = released_proto_predictions(z, glob, [k for k in range(4) if own[c, k]], 4)
        assert torch.equal(ours, ref), c
        all_classes = eng.algo.bind(dict(eng.algo.cfg) | {"infer": "proto-all"})
        differ += int((all_classes.predict(params, {}, x, torch.utils._pytree.tree_map(lambda t: t[0, c], ctx_all))
                       .argmax(-1) != ours).sum())
    assert differ > 0  # the two readings differ on these tensors


def test_fedproto_own_classes_are_the_training_split_classes():
    train = synthetic_clients(C=3, n=(10, 16), D=6, K=4, seed=0)
    algo = create("fedproto")
    eng = Engine(algo, [configure(algo, proj_dim=5, batch_size=4)], train, train)
    own = eng.init_state().client["own_classes"][0]
    for c in range(3):
        labels = set(train.labels[c, : int(train.counts[c])].tolist())
        assert own[c].tolist() == [k in labels for k in range(4)]


# -- FedProc: α = round/100 capped at 1 -----------------------------------------------------------------------------
def released_weights(round: int) -> tuple[float, float]:
    """train_net_fedproc: (CE weight, SCloss weight)."""
    if round < 100:
        alpha = round / 100
    else:
        alpha = 1
    if round == 0:
        return 1.0, 0.0
    return alpha, 1 - alpha


@pytest.mark.parametrize("rounds", [10, 250])
def test_fedproc_official_alpha_is_the_released_fixed_100_round_schedule(rounds):
    train = synthetic_clients(C=3, n=(10, 16), D=6, K=4, seed=0)
    algo = create("fedproc-official")
    eng = Engine(algo, [configure(algo, proj_dim=5, batch_size=4, rounds=rounds)],
                 train, train)
    state = eng.init_state()
    for t in [0, 1, 5, 9, 50, 99, 100, 101, 249]:
        if t >= rounds:
            continue
        gpc = eng.algo.context(state, eng.round_context(t))["alpha"]  # weight of ℓ_gpc; CE gets 1 − α
        ce_w, sc_w = released_weights(t)
        torch.testing.assert_close(gpc, torch.full_like(gpc, sc_w))
        torch.testing.assert_close(1 - gpc, torch.full_like(gpc, ce_w))
