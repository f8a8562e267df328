"""Three rounds of `fedpcl-official`, `fedproc-official` and `fedproto-official` against transcriptions of the
released code's client update, prototype pass, server aggregation and inference, each written from that code in its
own per-client style (dictionaries of prototype lists, loops over labels, torch.optim on plain tensors), never with
featcache's helpers: yuetan031/FedPCL (exps/federated_main.py FedPCL, lib/update.py update_weights_lg,
test_inference_twoway, lib/utils.py agg_func, proto_aggregation), MuXutong/FedProc (main.py, train.py
train_net_fedproc, get_global_class_center, ContrastLoss.py SupConLoss_new, model.py ModelFedCon) and
yuetan031/FedProto (exps/federated_main.py FedProto_taskheter, lib/update.py update_weights_het,
test_inference_new_het_lt, lib/utils.py agg_func, proto_aggregation).

Both sides start from the same parameters and read the same rows in the same order: the released DataLoader(shuffle=
True, drop_last=True) becomes featcache's batch_order for (seed, round, epoch), and its prototype pass the same with
the pass's own epoch id. Each comparison has a negative control that must fail: one hyperparameter changed, or the
prototype pass over all rows instead of the loader's drop_last rows."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from conftest import configure

from featcache.algorithms import create
from featcache.algorithms.protos import PASS_EPOCH
from featcache.training.engine import Engine
from featcache.training.schedule import batch_order
from tests.synthetic import synthetic_clients
from tests.test_algo_official import released_conloss

TRAIN = synthetic_clients(C=3, n=(10, 16), D=16, K=4, seed=0)  # 14, 13, 10 rows: drop_last drops 2, 1, 2
TEST = synthetic_clients(C=3, n=(10, 16), D=16, K=4, seed=1)
NUM_USERS, NUM_CLASSES, OUT_DIM, LOCAL_BS, TRAIN_EP, ROUNDS, SEED = 3, 4, 8, 4, 2, 3, 0
TOL = 1e-5


def trainloader(idx: int, rnd: int, epoch: int, drop_last: bool = True):
    """One pass of client idx's DataLoader(shuffle=True, batch_size=LOCAL_BS, drop_last): its batches of (images,
    labels), shuffled by featcache's batch_order for (seed, rnd, epoch)."""
    n = int(TRAIN.counts[idx])
    order = batch_order(torch.tensor([SEED]), rnd, epoch, TRAIN.counts, TRAIN.features.shape[1])[0, idx][:n]
    if drop_last:
        order = order[: n // LOCAL_BS * LOCAL_BS]
    return [
        (TRAIN.features[idx, order[s : s + LOCAL_BS]], TRAIN.labels[idx, order[s : s + LOCAL_BS]])
        for s in range(0, len(order), LOCAL_BS)
    ]


def held_out(idx: int):
    n = int(TEST.counts[idx])
    return TEST.features[idx, :n], TEST.labels[idx, :n]


def featcache_run(name: str, **settings):
    """featcache's run of `name` on the same data: (initial parameters name -> [...] (every client starts from
    them), trained parameters name -> [C, ...], per client the scores `predict` gives on its test rows)."""
    algo = create(name)
    cfg = configure(
        algo, proj_dim=OUT_DIM, rounds=ROUNDS, batch_size=LOCAL_BS, local_epochs=TRAIN_EP, seed=SEED, **settings
    )
    eng = Engine(algo, [cfg], TRAIN, TEST)
    init = {k: v[0, 0].clone() for k, v in eng.state.params.items()}
    eng.run()
    ctx = eng.algo.context(eng.state, eng.last_round)
    scores = []
    for c in range(NUM_USERS):
        params = {k: v[0, c] for k, v in eng.state.params.items()}
        buffers = {k: v[0, c] for k, v in eng.state.buffers.items()}
        ctx_c = torch.utils._pytree.tree_map(lambda t: t[0, c], ctx)
        with torch.no_grad():
            scores.append(eng.algo.predict(params, buffers, held_out(c)[0], ctx_c))
    return init, {k: v[0].clone() for k, v in eng.state.params.items()}, scores


def largest_difference(pairs) -> float:
    return max(float((a - b).abs().max()) for a, b in pairs)


# -- FedPCL --------------------------------------------------------------------------------------------------------
def projanddeci(model, x):
    """lib/models/models.py ProjandDeci.forward (the backbones' features are the cached ones)."""
    x = F.relu(x @ model["fc1.weight"].T + model["fc1.bias"])
    x1 = F.normalize(x, dim=1)
    x = F.relu(x1 @ model["fc2.weight"].T + model["fc2.bias"])
    x = F.normalize(x, dim=1)
    return F.log_softmax(x, dim=1), x1


def agg_func(protos):
    """FedPCL lib/utils.py agg_func."""
    agg_protos = {}
    for [label, proto_list] in protos.items():
        proto = torch.stack(proto_list)
        agg_protos[label] = torch.mean(proto, dim=0).data
    return agg_protos


def proto_aggregation(local_protos_list):
    """FedPCL lib/utils.py proto_aggregation."""
    agg_protos_label = dict()
    for idx in local_protos_list:
        local_protos = local_protos_list[idx]
        for label in local_protos.keys():
            if label in agg_protos_label:
                agg_protos_label[label].append(local_protos[label])
            else:
                agg_protos_label[label] = [local_protos[label]]
    for [label, proto_list] in agg_protos_label.items():
        if len(proto_list) > 1:
            proto = 0 * proto_list[0].data
            for i in proto_list:
                proto += i.data
            agg_protos_label[label] = proto / len(proto_list)
        else:
            agg_protos_label[label] = proto_list[0].data
    return agg_protos_label


def update_weights_lg(idx, global_protos, global_avg_protos, model, global_round, lr, pass_drop_last):
    """lib/update.py LocalUpdate.update_weights_lg for alg=fedpcl, optimizer=adam; the two views are the same
    cached crop."""
    model = {k: v.clone().requires_grad_(True) for k, v in model.items()}
    optimizer = torch.optim.Adam(model.values(), lr=lr, weight_decay=1e-4)
    for iter in range(TRAIN_EP):
        for batch_idx, (images, labels) in enumerate(trainloader(idx, global_round, iter)):
            images = torch.cat([images, images], dim=0)
            log_probs, features = projanddeci(model, images)
            bsz = labels.shape[0]
            lp1, lp2 = torch.split(log_probs, [bsz, bsz], dim=0)
            loss1 = F.nll_loss(lp1, labels)
            loss2 = 0 * loss1
            if len(global_protos) == NUM_USERS:
                f1, f2 = torch.split(features, [bsz, bsz], dim=0)
                features = torch.cat([f1.unsqueeze(1), f2.unsqueeze(1)], dim=1)
                for i in range(NUM_USERS):
                    for label in global_avg_protos.keys():
                        if label not in global_protos[i].keys():
                            global_protos[i][label] = global_avg_protos[label]
                    loss2 += released_conloss(features, labels, global_protos[i])
            loss = loss2
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    agg_protos_label = {}  # generate representation: one more pass of the (reshuffled) trainloader
    for batch_idx, (images, label_g) in enumerate(trainloader(idx, global_round, PASS_EPOCH, pass_drop_last)):
        _, features = projanddeci(model, images)
        for i in range(len(label_g)):
            if label_g[i].item() in agg_protos_label:
                agg_protos_label[label_g[i].item()].append(features[i, :])
            else:
                agg_protos_label[label_g[i].item()] = [features[i, :]]
    return {k: v.detach() for k, v in model.items()}, agg_protos_label


def inference_twoway(idx, local_protos, model):
    """lib/update.py LocalTest.test_inference_twoway: the distance matrix (nn.MSELoss to the client's own
    prototypes, 100 elsewhere) whose argmin is the prediction."""
    images, _ = held_out(idx)
    _, features = projanddeci(model, images)
    dist = 100 * torch.ones(size=(images.shape[0], NUM_CLASSES))
    for i in range(images.shape[0]):
        for j in range(NUM_CLASSES):
            if j in local_protos.keys():
                dist[i, j] = F.mse_loss(features[i, :], local_protos[j])
    return dist


def released_fedpcl(init, lr, pass_drop_last=True):
    """exps/federated_main.py FedPCL: per client its trained model and its test distance matrix."""
    g = torch.Generator().manual_seed(7)  # fc2 only feeds 0 * loss1: featcache's head has no classifier
    fc2 = {"fc2.weight": torch.randn(NUM_CLASSES, OUT_DIM, generator=g) * 0.3, "fc2.bias": torch.zeros(NUM_CLASSES)}
    local_model_list = [
        {"fc1.weight": init["proj0.weight"], "fc1.bias": init["proj0.bias"]} | fc2 for _ in range(NUM_USERS)
    ]
    global_protos, global_avg_protos, local_protos = {}, {}, {}
    for round in range(ROUNDS):
        local_weights = []
        for idx in range(NUM_USERS):
            w, protos = update_weights_lg(
                idx, global_protos, global_avg_protos, copy.deepcopy(local_model_list[idx]), round, lr, pass_drop_last
            )
            local_weights.append(w)
            local_protos[idx] = agg_func(protos)
        for idx in range(NUM_USERS):
            local_model_list[idx] = local_weights[idx]
        global_avg_protos = proto_aggregation(local_protos)
        global_protos = copy.deepcopy(local_protos)
    with torch.no_grad():
        dists = [inference_twoway(idx, local_protos[idx], local_model_list[idx]) for idx in range(NUM_USERS)]
    return local_model_list, dists


def compare_fedpcl(ours, ref) -> float:
    _, params, scores = ours
    models, dists = ref
    pairs = []
    for c in range(NUM_USERS):
        pairs += [
            (params["proj0.weight"][c], models[c]["fc1.weight"]),
            (params["proj0.bias"][c], models[c]["fc1.bias"]),
        ]
        owned = torch.isfinite(scores[c])  # [n, K] the classes of the client's own prototypes
        assert torch.equal(owned, dists[c] != 100)
        pairs.append((-scores[c][owned] / OUT_DIM, dists[c][owned]))  # squared distance vs nn.MSELoss
        assert torch.equal(scores[c].argmax(-1), dists[c].argmin(-1))
    return largest_difference(pairs)


def test_fedpcl_official_equals_the_released_rounds():
    ours = featcache_run("fedpcl-official", optimizer="adam", lr=0.01, weight_decay=1e-4)
    assert compare_fedpcl(ours, released_fedpcl(ours[0], lr=0.01)) <= TOL


def test_fedpcl_official_differs_from_a_pass_over_all_rows():
    ours = featcache_run("fedpcl-official", optimizer="adam", lr=0.01, weight_decay=1e-4)
    assert compare_fedpcl(ours, released_fedpcl(ours[0], lr=0.01, pass_drop_last=False)) > 100 * TOL


# -- FedProc -------------------------------------------------------------------------------------------------------
def model_fedcon(net, x):
    """model.py ModelFedCon.forward (the base model's features are the cached ones): h, normalised x, logits."""
    h = x
    x = F.relu(h @ net["l1.weight"].T + net["l1.bias"])
    x = x @ net["l2.weight"].T + net["l2.bias"]
    x = F.normalize(x, p=2, dim=1)
    y = x @ net["l3.weight"].T + net["l3.bias"]
    return h, x, y


def supconloss_new(features, labels, center):
    """ContrastLoss.py SupConLoss_new.forward."""
    center = torch.stack(tuple(center), -1)
    center = F.normalize(center, p=2, dim=0)
    batch_size = features.shape[0]
    l_sc = None
    for i in range(batch_size):
        current_label = labels[i].item()
        current_feature = features[i]
        current_center = center[:, current_label]
        numerator = torch.exp(current_feature.matmul(current_center))
        denominator = torch.mm(current_feature.view(1, -1), center)
        denominator = torch.sum(torch.exp(denominator))
        if l_sc is None:
            l_sc = -1 * torch.log(numerator / denominator)
        else:
            l_sc += -1 * torch.log(numerator / denominator)
    return l_sc / batch_size


def train_net_fedproc(round, net_id, net, lr, reg, global_class_center):
    """train.py train_net_fedproc, optimizer=sgd."""
    net = {k: v.clone().requires_grad_(True) for k, v in net.items()}
    optimizer = torch.optim.SGD(net.values(), lr=lr, momentum=0.9, weight_decay=reg)
    if round < 100:
        alpha = round / 100
    else:
        alpha = 1
    for epoch in range(TRAIN_EP):
        for batch_idx, (x, target) in enumerate(trainloader(net_id, round, epoch)):
            optimizer.zero_grad()
            _, feature, out = model_fedcon(net, x)
            CEloss = F.cross_entropy(out, target)
            SCloss = supconloss_new(features=feature, labels=target, center=global_class_center)
            if round == 0:
                loss = CEloss
            else:
                loss = alpha * CEloss + (1 - alpha) * SCloss
            loss.backward()
            optimizer.step()
    return {k: v.detach() for k, v in net.items()}


def get_global_class_center(global_class_center_old, nets, pass_round, pass_drop_last):
    """train.py get_global_class_center: every client's loader pass, class sums and counts, the sample-weighted
    mean; a class nobody holds keeps its old centre (zeros before the first)."""
    local_class_center = []
    class_count = torch.zeros(NUM_USERS, NUM_CLASSES)
    for net_id, net in nets.items():
        class_feature = {}
        with torch.no_grad():
            for batch_idx, (x, target) in enumerate(trainloader(net_id, pass_round, PASS_EPOCH, pass_drop_last)):
                _, features, out = model_fedcon(net, x)
                for label in torch.unique(target):
                    index = torch.eq(target, label)
                    feature = features[index]
                    lab = str(label.numpy())
                    if lab not in class_feature.keys():
                        class_feature[lab] = torch.sum(feature, 0)
                        class_count[net_id][label] = feature.shape[0]
                    else:
                        class_feature[lab] += torch.sum(feature, 0)
                        class_count[net_id][label] += feature.shape[0]
        local_class_center.append(class_feature)
    global_center = [[] for x in range(NUM_CLASSES)]
    for cls in range(NUM_CLASSES):
        for id in range(len(local_class_center)):
            if isinstance(global_center[cls], list):  # the code's `global_center[cls] == []`
                if str(cls) in local_class_center[id]:
                    global_center[cls] = local_class_center[id][str(cls)].clone()
                    inittype = torch.zeros_like(global_center[cls])
            elif str(cls) in local_class_center[id]:
                global_center[cls] += local_class_center[id][str(cls)]
        if isinstance(global_center[cls], list):
            global_center[cls] = inittype if global_class_center_old is None else global_class_center_old[cls]
        else:
            global_center[cls] = global_center[cls] / sum(class_count[:, cls])
    return global_center


def released_fedproc(init, lr, reg, pass_drop_last=True):
    """main.py's fedproc loop: the global model after ROUNDS rounds and its logits on each client's test rows."""
    names = {"l1": "proj0", "l2": "proj1", "l3": "cls0"}
    global_model = {f"{a}.{p}": init[f"{b}.{p}"] for a, b in names.items() for p in ("weight", "bias")}
    flag = 0
    for round in range(ROUNDS):
        global_w = global_model
        nets_this_round = {k: dict(global_w) for k in range(NUM_USERS)}
        if flag == 0:
            global_class_center = get_global_class_center(None, nets_this_round, -1, pass_drop_last)
            flag = 1
        for net_id in nets_this_round:
            nets_this_round[net_id] = train_net_fedproc(
                round, net_id, nets_this_round[net_id], lr, reg, global_class_center
            )
        global_class_center_old = copy.deepcopy(global_class_center)
        global_class_center = get_global_class_center(global_class_center_old, nets_this_round, round, pass_drop_last)
        total_data_points = sum(int(TRAIN.counts[r]) for r in range(NUM_USERS))
        fed_avg_freqs = [int(TRAIN.counts[r]) / total_data_points for r in range(NUM_USERS)]
        global_w = {}
        for net_id, net in enumerate(nets_this_round.values()):
            for key in net:
                global_w[key] = net[key] * fed_avg_freqs[net_id] + (global_w[key] if net_id else 0)
        global_model = global_w
    with torch.no_grad():
        logits = [model_fedcon(global_model, held_out(idx)[0])[2] for idx in range(NUM_USERS)]
    return {names[k.split(".")[0]] + "." + k.split(".")[1]: v for k, v in global_model.items()}, logits


def compare_fedproc(ours, ref) -> float:
    _, params, scores = ours
    model, logits = ref
    pairs = [(params[k][c], model[k]) for k in model for c in range(NUM_USERS)]  # every client holds the global model
    return largest_difference(pairs + list(zip(scores, logits)))


def test_fedproc_official_equals_the_released_rounds():
    ours = featcache_run("fedproc-official", optimizer="sgd", momentum=0.9, lr=0.05, weight_decay=1e-5)
    assert compare_fedproc(ours, released_fedproc(ours[0], lr=0.05, reg=1e-5)) <= TOL


def test_fedproc_official_differs_from_a_pass_over_all_rows():
    ours = featcache_run("fedproc-official", optimizer="sgd", momentum=0.9, lr=0.05, weight_decay=1e-5)
    assert compare_fedproc(ours, released_fedproc(ours[0], lr=0.05, reg=1e-5, pass_drop_last=False)) > 100 * TOL


# -- FedProto ------------------------------------------------------------------------------------------------------
def cnn(model, images):
    """lib/models/models.py CNNMnist.forward's head on cached features: x1 = ReLU(fc1(x)) is the prototype,
    log_softmax(fc2(x1)) the output (the head has no dropout)."""
    x1 = F.relu(images @ model["fc1.weight"].T + model["fc1.bias"])
    x = x1 @ model["fc2.weight"].T + model["fc2.bias"]
    return F.log_softmax(x, dim=1), x1


def update_weights_het(idx, global_protos, model, global_round, lr, ld):
    """lib/update.py LocalUpdate.update_weights_het, optimizer=sgd: the prototypes of the last epoch's batches."""
    model = {k: v.clone().requires_grad_(True) for k, v in model.items()}
    optimizer = torch.optim.SGD(model.values(), lr=lr, momentum=0.5)
    for iter in range(TRAIN_EP):
        agg_protos_label = {}
        for batch_idx, (images, label_g) in enumerate(trainloader(idx, global_round, iter)):
            labels = label_g
            log_probs, protos = cnn(model, images)
            loss1 = F.nll_loss(log_probs, labels)
            if len(global_protos) == 0:
                loss2 = 0 * loss1
            else:
                proto_new = copy.deepcopy(protos.data)
                i = 0
                for label in labels:
                    if label.item() in global_protos.keys():
                        proto_new[i, :] = global_protos[label.item()][0].data
                    i += 1
                loss2 = F.mse_loss(proto_new, protos)
            loss = loss1 + loss2 * ld
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            for i in range(len(labels)):
                if label_g[i].item() in agg_protos_label:
                    agg_protos_label[label_g[i].item()].append(protos[i, :])
                else:
                    agg_protos_label[label_g[i].item()] = [protos[i, :]]
    return {k: v.detach() for k, v in model.items()}, agg_protos_label


def agg_func_proto(protos):
    """FedProto lib/utils.py agg_func."""
    for [label, proto_list] in protos.items():
        if len(proto_list) > 1:
            proto = 0 * proto_list[0].data
            for i in proto_list:
                proto += i.data
            protos[label] = proto / len(proto_list)
        else:
            protos[label] = proto_list[0]
    return protos


def proto_aggregation_proto(local_protos_list):
    """FedProto lib/utils.py proto_aggregation: {label: [the mean over the clients that sent it]}."""
    agg_protos_label = dict()
    for idx in local_protos_list:
        local_protos = local_protos_list[idx]
        for label in local_protos.keys():
            if label in agg_protos_label:
                agg_protos_label[label].append(local_protos[label])
            else:
                agg_protos_label[label] = [local_protos[label]]
    for [label, proto_list] in agg_protos_label.items():
        if len(proto_list) > 1:
            proto = 0 * proto_list[0].data
            for i in proto_list:
                proto += i.data
            agg_protos_label[label] = [proto / len(proto_list)]
        else:
            agg_protos_label[label] = [proto_list[0].data]
    return agg_protos_label


def released_fedproto(init, lr, ld):
    """exps/federated_main.py FedProto_taskheter: per client its trained model and the log-probabilities of
    test_inference_new_het_lt's local-model test."""
    local_model_list = [
        {
            "fc1.weight": init["proj0.weight"],
            "fc1.bias": init["proj0.bias"],
            "fc2.weight": init["cls0.weight"],
            "fc2.bias": init["cls0.bias"],
        }
        for _ in range(NUM_USERS)
    ]
    global_protos = []
    for round in range(ROUNDS):
        local_weights, local_protos = [], {}
        for idx in range(NUM_USERS):
            w, protos = update_weights_het(idx, global_protos, copy.deepcopy(local_model_list[idx]), round, lr, ld)
            local_weights.append(w)
            local_protos[idx] = agg_func_proto(protos)
        for idx in range(NUM_USERS):
            local_model_list[idx] = local_weights[idx]
        global_protos = proto_aggregation_proto(local_protos)
    with torch.no_grad():
        outputs = [cnn(local_model_list[idx], held_out(idx)[0])[0] for idx in range(NUM_USERS)]
    return local_model_list, outputs


def compare_fedproto(ours, ref) -> float:
    _, params, scores = ours
    models, outputs = ref
    names = {"proj0": "fc1", "cls0": "fc2"}
    pairs = [
        (params[k][c], models[c][names[k.split(".")[0]] + "." + k.split(".")[1]])
        for k in params
        for c in range(NUM_USERS)
    ]
    return largest_difference(pairs + [(F.log_softmax(s, -1), o) for s, o in zip(scores, outputs)])


FEDPROTO_RUN = {"optimizer": "sgd", "momentum": 0.5, "weight_decay": 0.0, "lr": 0.05}


def test_fedproto_official_equals_the_released_rounds():
    ours = featcache_run("fedproto-official", **FEDPROTO_RUN)
    assert compare_fedproto(ours, released_fedproto(ours[0], lr=0.05, ld=1.0)) <= TOL


def test_fedproto_official_differs_with_another_lambda():
    ours = featcache_run("fedproto-official", **FEDPROTO_RUN)
    assert compare_fedproto(ours, released_fedproto(ours[0], lr=0.05, ld=0.5)) > 100 * TOL


def test_fedproto_final_model_pass_differs_from_the_released_rounds():
    """featcache's `fedproto` (prototypes of the final local model over all rows) is not the released code."""
    ours = featcache_run("fedproto", **FEDPROTO_RUN)
    assert compare_fedproto(ours, released_fedproto(ours[0], lr=0.05, ld=1.0)) > 100 * TOL
