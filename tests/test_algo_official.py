"""The `-official` variants against transcriptions of the released code, written here line by line in the released
code's own style (loops, dictionaries, torch.min over a distance matrix), never with the algorithms' helpers:
FedPCL's ConLoss on its two-view batch and its round-0 zero loss (yuetan031/FedPCL lib/losses.py, lib/update.py),
FedProto's nearest-global-prototype inference (yuetan031/FedProto test_inference_new_het_lt) and FedProc's α
schedule (MuXutong/FedProc train.py, train_net_fedproc)."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from conftest import client_model, configure
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
    padded_rows = algo.local_loss(
        params,
        {},
        torch.cat([x, torch.zeros(3, D)]),
        torch.cat([y, -torch.ones(3).long()]),
        torch.arange(B + 3) < B,
        ctx,
    )[0]
    torch.testing.assert_close(padded_rows, ref.detach())  # padding rows change nothing


def test_fedpcl_official_round_zero_only_decays():
    """Round 0 has no global prototypes in the released code: zero loss, so plain SGD leaves the model as it was."""
    train = synthetic_clients(C=3, n=(10, 16), D=6, K=4, seed=0)
    algo = create("fedpcl-official")
    cfg = configure(algo, proj_dim=5, rounds=2, batch_size=4, optimizer="sgd", momentum=0.0, weight_decay=0.0, lr=0.1)
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
        differ += int(
            (
                all_classes.predict(params, {}, x, torch.utils._pytree.tree_map(lambda t: t[0, c], ctx_all)).argmax(-1)
                != ours
            ).sum()
        )
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
    eng = Engine(algo, [configure(algo, proj_dim=5, batch_size=4, rounds=rounds)], train, train)
    state = eng.init_state()
    for t in [0, 1, 5, 9, 50, 99, 100, 101, 249]:
        if t >= rounds:
            continue
        gpc = eng.algo.context(state, eng.round_context(t))["alpha"]  # weight of ℓ_gpc; CE gets 1 − α
        ce_w, sc_w = released_weights(t)
        torch.testing.assert_close(gpc, torch.full_like(gpc, sc_w))
        torch.testing.assert_close(1 - gpc, torch.full_like(gpc, ce_w))


# -- FedCAC and pFedSD: Fling's client update, server aggregation and inference, 3 rounds ---------------------------
# Written from FLAIR-Community/Fling (fling/component/client/base_client.py, fedcac_client.py, pfedsd_client.py;
# fling/component/group/base_group.py, fedcac_group.py; fling/utils/compress_utils/fed_avg.py) with its defaults
# (include_non_param=True: BN running statistics are in glob_dict; sample_rate=1), one nn.Module per client and
# the engine's minibatch order in place of a shuffled DataLoader. Both run in float64: in float32 the rounding
# differences of two correct implementations grow past 1e-5 within 3 rounds (BatchNorm over a last batch of 2 rows,
# FedCAC's critical-parameter threshold); in float64 they stay below 1e-12. The hyperparameters and the client
# sizes' shares n_k / n (sizes summing to 128) are exact in float32, where featcache keeps them.
FLING_CFG = dict(
    rounds=3,
    local_epochs=2,
    batch_size=8,
    drop_last=False,
    optimizer="sgd",
    lr=0.0625,
    momentum=0.875,
    weight_decay=0.0,
    participation=1.0,
    proj_dim=8,
    seed=0,
)
NAMES = {
    "proj0.weight": "proj0.weight",
    "proj0.bias": "proj0.bias",
    "bn.weight": "proj0.bn.weight",
    "bn.bias": "proj0.bn.bias",
    "bn.running_mean": "proj0.bn.running_mean",
    "bn.running_var": "proj0.bn.running_var",
    "cls0.weight": "cls0.weight",
    "cls0.bias": "cls0.bias",
}


def tiny_clients(seed: int, counts=(20, 26, 34, 48)):
    """4 clients, D = 16, K = 4; no client's last batch of 8 holds a single row (BatchNorm needs two)."""
    from featcache.cache import ClientData

    g = torch.Generator().manual_seed(seed)
    N, centres = max(counts), torch.randn(4, 16, generator=torch.Generator().manual_seed(99)) * 2
    x, y = torch.zeros(len(counts), N, 16), torch.full((len(counts), N), -1)
    for c, n in enumerate(counts):
        y[c, :n] = torch.randint(0, 4, (n,), generator=g)
        x[c, :n] = centres[y[c, :n]] + torch.randn(n, 16, generator=g) * 1.5
    return ClientData(x, y, torch.tensor(counts), 4)


class Head(torch.nn.Module):
    """The featcache head as a torch module: Linear -> ReLU (-> BatchNorm1d) -> Linear."""

    def __init__(self, bn):
        super().__init__()
        self.proj0 = torch.nn.Linear(16, 8)
        self.bn = torch.nn.BatchNorm1d(8) if bn else None
        self.cls0 = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.proj0(x))
        if self.bn is not None:
            x = self.bn(x)
        return self.cls0(x)


class FlingClient:
    """BaseClient.train / test with the engine's batch order (fling/component/client/base_client.py)."""

    def __init__(self, args, client_id, train, test, init):
        self.args, self.client_id = args, client_id
        self.model = Head(args["bn"])
        sd = self.model.state_dict()
        sd.update({k: init[NAMES[k]].clone() for k in sd if k in NAMES})
        self.model.load_state_dict(sd)
        n = int(train.counts[client_id])
        self.x, self.y, self.sample_num = train.features[client_id, :n], train.labels[client_id, :n], n
        m = int(test.counts[client_id])
        self.test_x = test.features[client_id, :m]
        self.counts, self.n_max = train.counts, train.features.shape[1]

    def batches(self, rnd, epoch):
        from featcache.training.schedule import batch_order

        order = batch_order(torch.tensor([self.args["seed"]]), rnd, epoch, self.counts, self.n_max)[0, self.client_id]
        order = order[: self.sample_num]
        for s in range(0, self.sample_num, self.args["batch_size"]):
            rows = order[s : s + self.args["batch_size"]]
            yield {"x": self.x[rows], "y": self.y[rows]}

    def train_step(self, batch_data, criterion, optimizer):
        o = self.model(batch_data["x"])
        loss = criterion(o, batch_data["y"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def train(self, rnd):
        self.model.train()
        op = torch.optim.SGD(self.model.parameters(), lr=self.args["lr"], momentum=self.args["momentum"])
        criterion = torch.nn.CrossEntropyLoss()
        for epoch in range(self.args["local_epochs"]):
            for data in self.batches(rnd, epoch):
                self.train_step(batch_data=data, criterion=criterion, optimizer=op)

    def update_model(self, dic):
        dic = copy.deepcopy(dic)
        state_dict = self.model.state_dict()
        state_dict.update(dic)
        self.model.load_state_dict(state_dict)

    def test(self):
        self.model.eval()
        with torch.no_grad():
            return self.model(self.test_x)


class FedCACClient(FlingClient):
    """fling/component/client/fedcac_client.py."""

    def __init__(self, *a):
        super().__init__(*a)
        self.critical_parameter = None
        self.customized_model = copy.deepcopy(self.model)

    def train(self, rnd):
        initial_model = copy.deepcopy(self.model)
        super().train(rnd)
        self.critical_parameter, self.global_mask, self.local_mask = self.evaluate_critical_parameter(
            prevModel=initial_model, model=self.model, tau=self.args["tau"]
        )

    def evaluate_critical_parameter(self, prevModel, model, tau):
        global_mask, local_mask, critical_parameter = [], [], []
        for (name1, prevparam), (name2, param) in zip(prevModel.named_parameters(), model.named_parameters()):
            g = param.data - prevparam.data
            v = param.data
            c = torch.abs(g * v)
            metric = c.view(-1)
            num_params = metric.size(0)
            nz = int(tau * num_params)
            top_values, _ = torch.topk(metric, nz)
            thresh = top_values[-1] if len(top_values) > 0 else np.inf
            if thresh <= 1e-10:
                new_metric = metric[metric > 1e-20]
                if len(new_metric) > 0:
                    thresh = new_metric.sort()[0][0]
            mask = (c >= thresh).int()
            global_mask.append((c < thresh).int())
            local_mask.append(mask)
            critical_parameter.append(mask.view(-1))
        return torch.cat(critical_parameter), global_mask, local_mask


def fed_avg(clients, glob_keys):
    """fling/utils/compress_utils/fed_avg.py: sample_num-weighted mean of every key of glob_dict."""
    total_samples = sum([client.sample_num for client in clients])
    return {
        k: functools.reduce(
            lambda x, y: x + y, [client.sample_num / total_samples * client.model.state_dict()[k] for client in clients]
        )
        for k in glob_keys
    }


class FedCACGroup:
    """fling/component/group/fedcac_group.py. `global_stats` (the negative control) also loads the global BN
    statistics into every client on sync, which the released sync does not."""

    def __init__(self, args, clients, global_stats=False):
        self.args, self.clients, self.global_stats = args, clients, global_stats
        self.glob_dict = dict(clients[0].model.state_dict())  # include_non_param=True
        self.epoch = -1
        self.sync()

    def sync(self):
        if self.epoch == -1:
            for client in self.clients:
                client.update_model(self.glob_dict)
        else:
            tempGlobalModel = copy.deepcopy(self.clients[0].model)
            tempGlobalModel.load_state_dict(self.glob_dict)
            for client in self.clients:
                index = 0
                for (name1, param1), (name2, param2), (name3, param3) in zip(
                    client.model.named_parameters(),
                    tempGlobalModel.named_parameters(),
                    client.customized_model.named_parameters(),
                ):
                    param1.data = (
                        client.local_mask[index].float() * param3.data + client.global_mask[index].float() * param2.data
                    )
                    index += 1
                if self.global_stats:
                    client.update_model({k: v for k, v in self.glob_dict.items() if "running" in k})
        self.epoch += 1

    def get_customized_global_models(self):
        n = len(self.clients)
        overlap_buffer = [[] for i in range(n)]
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                overlap_rate = 1 - torch.sum(
                    torch.abs(self.clients[i].critical_parameter - self.clients[j].critical_parameter)
                ) / float(torch.sum(self.clients[i].critical_parameter).cpu() * 2)
                overlap_buffer[i].append(overlap_rate)
        overlap_buffer_tensor = torch.tensor(overlap_buffer)
        overlap_avg = overlap_buffer_tensor.sum() / ((n - 1) * n)
        overlap_max = overlap_buffer_tensor.max()
        threshold = overlap_avg + (self.epoch + 1) / self.args["beta"] * (overlap_max - overlap_avg)
        for i in range(n):
            w_customized_global = copy.deepcopy(self.clients[i].model.state_dict())
            collaboration_clients = [i]
            index = 0
            for j in range(n):
                if i == j:
                    continue
                if overlap_buffer[i][index] >= threshold:
                    collaboration_clients.append(j)
                index += 1
            for key in w_customized_global.keys():
                for client in collaboration_clients:
                    if client == i:
                        continue
                    w_customized_global[key] += self.clients[client].model.state_dict()[key]
                w_customized_global[key] = torch.div(w_customized_global[key], float(len(collaboration_clients)))
            self.clients[i].customized_model.load_state_dict(w_customized_global)

    def aggregate(self):
        self.glob_dict = fed_avg(self.clients, self.glob_dict.keys())
        self.get_customized_global_models()
        self.sync()


class PFedSDClient(FlingClient):
    """fling/component/client/pfedsd_client.py. `teacher_eval` (the negative control) puts the teacher in eval
    mode, which the released client does not."""

    def __init__(self, *a, teacher_eval=False):
        super().__init__(*a)
        self.local_model_pre, self.teacher_eval = None, teacher_eval

    def train(self, rnd):
        super().train(rnd)
        self.local_model_pre = copy.deepcopy(self.model)
        if self.teacher_eval:
            self.local_model_pre.eval()

    def train_step(self, batch_data, criterion, optimizer):
        batch_x, batch_y = batch_data["x"], batch_data["y"]
        o = self.model(batch_x)
        loss = criterion(o, batch_y)
        if self.local_model_pre is not None:
            with torch.no_grad():
                o_pre = self.local_model_pre(batch_x)
            lamda = self.args["lamda"]
            tau = self.args["tau"]
            q_v = F.softmax(o_pre / tau, dim=-1)
            q_w = F.log_softmax(o / tau, dim=-1)
            loss += lamda * tau**2 * F.kl_div(q_w, q_v, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def test(self):  # test_place=['before_aggregation']: the model as trained, i.e. local_model_pre
        model = copy.deepcopy(self.local_model_pre)
        model.eval()
        with torch.no_grad():
            return model(self.test_x)


class BaseGroup:
    """fling/component/group/base_group.py: fed_avg over every client (aggregate(i) passes no ids), then sync."""

    def __init__(self, clients):
        self.clients = clients
        self.glob_dict = dict(clients[0].model.state_dict())
        self.sync()

    def sync(self):
        for client in self.clients:
            client.update_model(self.glob_dict)

    def aggregate(self):
        self.glob_dict = fed_avg(self.clients, self.glob_dict.keys())
        self.sync()


def featcache_run(name, bn, **settings):
    """featcache's run: per client its parameters and buffers (Fling's names), test logits; the global model."""
    train, test = tiny_clients(0), tiny_clients(1, counts=(9, 10, 11, 12))
    algo = create(name)
    eng = Engine(algo, [configure(algo, bn=bn, **FLING_CFG, **settings)], train, test)
    init = {k: v[0, 0].clone() for k, v in (eng.state.params | eng.state.buffers).items()}
    eng.run()
    state, out = eng.state, []
    for c in range(4):
        params, buffers, ctx_c = client_model(eng, c)
        with torch.no_grad():
            logits = eng.algo.predict(params, buffers, test.features[c, : int(test.counts[c])], ctx_c)
        out.append({"model": params | buffers, "logits": logits})
    glob = eng.algo.global_model(state, eng.last_round)
    return train, test, init, out, {k: v[0] for k, v in (glob[0] | glob[1]).items()}


def fling_run(name, bn, train, test, init, control=None, **settings):
    """The transcription's run, 3 rounds of train (every client) -> aggregate -> test, as
    personalized_model_pipeline."""
    args = dict(FLING_CFG, bn=bn, **settings)
    if name == "fedcac":
        clients = [FedCACClient(args, c, train, test, init) for c in range(4)]
        group = FedCACGroup(args, clients, global_stats=control == "bn")
    else:
        clients = [PFedSDClient(args, c, train, test, init, teacher_eval=control == "bn") for c in range(4)]
        group = BaseGroup(clients)
    for rnd in range(args["rounds"]):
        for client in clients:
            client.train(rnd)
        group.aggregate()
    out = [
        {"model": {NAMES[k]: v for k, v in client.model.state_dict().items() if k in NAMES}, "logits": client.test()}
        for client in clients
    ]
    return out, {NAMES[k]: v for k, v in group.glob_dict.items() if k in NAMES}


def largest_difference(ours, ref) -> float:
    """Largest |featcache − transcription| over every client's model and test logits and the global model."""
    (out, glob), (ref_out, ref_glob) = ours, ref
    diffs = [(glob[k] - ref_glob[k]).abs().max() for k in glob]
    for a, b in zip(out, ref_out):
        assert set(a["model"]) == set(b["model"])
        diffs += [(a["model"][k] - b["model"][k]).abs().max() for k in a["model"]] + [
            (a["logits"] - b["logits"]).abs().max()
        ]
    return float(max(diffs))


FLING_CASES = {
    "fedcac": ({"tau": 0.5, "beta": 100}, {"tau": 0.5, "beta": 100.0}, {"tau": 0.4}),
    "pfedsd": ({"lamda": 0.5, "tau": 3}, {"lam": 0.5, "temperature": 3.0}, {"lamda": 1.0}),
}


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("bn", [False, True])
@pytest.mark.parametrize("name", ["fedcac", "pfedsd"])
def test_fedcac_and_pfedsd_equal_flings_released_code(name, bn, float64):
    """Equal within 1e-9 after 3 rounds: parameters, BN statistics, test logits and the global model; a changed
    hyperparameter (and with bn, the other BN rule: global statistics on sync / the teacher in eval mode) is not."""
    fling_args, ours_args, changed = FLING_CASES[name]
    train, test, init, out, glob = featcache_run(name, bn, **ours_args)
    assert largest_difference((out, glob), fling_run(name, bn, train, test, init, **fling_args)) < 1e-9
    assert largest_difference((out, glob), fling_run(name, bn, train, test, init, **(fling_args | changed))) > 1e-3
    if bn:
        assert (
            largest_difference((out, glob), fling_run(name, bn, train, test, init, control="bn", **fling_args)) > 1e-3
        )
