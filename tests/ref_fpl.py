"""A transcription of FPL as its authors release it (WenkeHuang/RethinkFL @ 74201b3762746e6328fdf5b8fc6cb8ecca768aef,
models/fpl.py: `agg_func`, `FPL.ini`, `proto_aggregation`, `hierarchical_info_loss`, `calculate_infonce`,
`loc_update`, `_train_net`; models/utils/federated_model.py: `aggregate_nets` with averaing='weight';
utils/finch.py: `clust_rank`, `get_clust`, `cool_mean`, `get_merge`, `FINCH`; utils/training.py: `global_evaluate`),
written from that code for tests/test_algo_fpl.py: FINCH in numpy, scipy and scikit-learn as the release runs it, the
rest in plain torch.

What it takes from outside, as the release takes it from its data loaders and `random_state.choice`: the initial
model (one dict of tensors; `features` = FC + ReLU, the head's z, `classifier` = the last FC; `ini` hands it to every
client), the online clients of each round, each client's training-set size (aggregate_nets' `sampler.indices.size`),
its minibatches (drop_last=True) and its test rows. Left out: FINCH's PyNNDescent path (above 70,000 points),
`req_clust` and the verbose prints, none of which FPL reaches.

One reading: `hierarchical_info_loss` selects the row's class from the Python lists all_f and mean_f through
`np.array(...)[keys == label]`. On current numpy, np.array over a list of equal-shape tensors (mean_f always)
builds one float ndarray, which has no `.to`; the transcription takes the entries it selects (the class's cluster
prototypes and their mean; the other classes' clusters as negatives) from the lists directly."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn
from scipy.sparse import csgraph
from sklearn import metrics


# -- utils/finch.py -------------------------------------------------------------------------------------------------
def clust_rank(mat, initial_rank=None, distance="cosine"):
    s = mat.shape[0]
    if initial_rank is not None:
        orig_dist = []
    else:
        orig_dist = metrics.pairwise.pairwise_distances(mat, mat, metric=distance)
        np.fill_diagonal(orig_dist, 1e12)
        initial_rank = np.argmin(orig_dist, axis=1)
    # The Clustering Equation
    A = sp.csr_matrix((np.ones_like(initial_rank, dtype=np.float32), (np.arange(0, s), initial_rank)), shape=(s, s))
    A = A + sp.eye(s, dtype=np.float32, format="csr")
    A = A @ A.T
    A = A.tolil()
    A.setdiag(0)
    return A, orig_dist


def get_clust(a, orig_dist, min_sim=None):
    if min_sim is not None:
        a[np.where((orig_dist * a.toarray()) > min_sim)] = 0
    num_clust, u = csgraph.connected_components(csgraph=a, directed=True, connection="weak", return_labels=True)
    return u, num_clust


def cool_mean(M, u):
    s = M.shape[0]
    un, nf = np.unique(u, return_counts=True)
    umat = sp.csr_matrix((np.ones(s, dtype="float32"), (np.arange(0, s), u)), shape=(s, len(un)))
    return (umat.T @ M) / nf[..., np.newaxis]


def get_merge(c, u, data):
    if len(c) != 0:
        _, ig = np.unique(c, return_inverse=True)
        c = u[ig]
    else:
        c = u
    mat = cool_mean(data, c)
    return c, mat


def FINCH(data, initial_rank=None, distance="cosine", ensure_early_exit=True):
    """FINCH as released, returning (c, num_clust): c [N, P] the cluster of every point in every partition."""
    data = data.astype(np.float32)
    min_sim = None
    adj, orig_dist = clust_rank(data, initial_rank, distance)
    initial_rank = None
    group, num_clust = get_clust(adj, [], min_sim)
    c, mat = get_merge([], group, data)
    if ensure_early_exit:
        if orig_dist.shape[-1] > 2:
            min_sim = np.max(orig_dist * adj.toarray())
    exit_clust = 2
    c_ = c
    k = 1
    num_clust = [num_clust]
    while exit_clust > 1:
        adj, orig_dist = clust_rank(mat, initial_rank, distance)
        u, num_clust_curr = get_clust(adj, orig_dist, min_sim)
        c_, mat = get_merge(c_, u, data)
        num_clust.append(num_clust_curr)
        c = np.column_stack((c, c_))
        exit_clust = num_clust[-2] - num_clust_curr
        if num_clust_curr == 1 or exit_clust < 1:
            num_clust = num_clust[:-1]
            c = c[:, :-1]
            break
        k += 1
    return c, num_clust


# -- models/fpl.py ----------------------------------------------------------------------------------------------------
def features(net: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])


def classifier(net: dict, f: torch.Tensor) -> torch.Tensor:
    return f @ net["cls0.weight"].T + net["cls0.bias"]


def agg_func(protos):
    """Returns the average of the weights."""
    for [label, proto_list] in protos.items():
        if len(proto_list) > 1:
            proto = 0 * proto_list[0].data
            for i in proto_list:
                proto += i.data
            protos[label] = proto / len(proto_list)
        else:
            protos[label] = proto_list[0]
    return protos


def cluster(proto_list):
    """proto_aggregation's clustering of one class's local prototypes [m, d]: FINCH's last partition's means."""
    c, num_clust = FINCH(proto_list, initial_rank=None, distance="cosine", ensure_early_exit=False)
    m, n = c.shape
    class_cluster_list = []
    for index in range(m):
        class_cluster_list.append(c[index, -1])
    class_cluster_array = np.array(class_cluster_list)
    uniqure_cluster = np.unique(class_cluster_array).tolist()
    agg_selected_proto = []
    for _, cluster_index in enumerate(uniqure_cluster):
        selected_array = np.where(class_cluster_array == cluster_index)
        selected_proto_list = proto_list[selected_array]
        proto = np.mean(selected_proto_list, axis=0, keepdims=True)
        agg_selected_proto.append(torch.tensor(proto))
    return agg_selected_proto


class FPL:
    def __init__(self, x0: dict, parti_num: int, infoNCET: float, local_lr: float, local_epoch: int):
        self.nets_list = [{k: v.clone() for k, v in x0.items()} for _ in range(parti_num)]
        self.global_protos: dict | list = []
        self.local_protos: dict = {}
        self.infoNCET = infoNCET
        self.local_lr, self.local_epoch = local_lr, local_epoch
        self.ini()

    def ini(self):
        self.global_net = {k: v.clone() for k, v in self.nets_list[0].items()}
        for net in self.nets_list:
            for k in net:
                net[k] = self.global_net[k].clone()

    def proto_aggregation(self, local_protos_list):
        agg_protos_label = dict()
        for idx in self.online_clients:
            local_protos = local_protos_list[idx]
            for label in local_protos.keys():
                if label in agg_protos_label:
                    agg_protos_label[label].append(local_protos[label])
                else:
                    agg_protos_label[label] = [local_protos[label]]
        for [label, proto_list] in agg_protos_label.items():
            if len(proto_list) > 1:
                proto_list = [item.squeeze(0).detach().cpu().numpy().reshape(-1) for item in proto_list]
                proto_list = np.array(proto_list)
                agg_protos_label[label] = cluster(proto_list)
            else:
                agg_protos_label[label] = [proto_list[0].data]
        return agg_protos_label

    def hierarchical_info_loss(self, f_now, label, all_f, mean_f, all_global_protos_keys):
        pick = [j for j, key in enumerate(all_global_protos_keys) if key == label.item()]  # (see the docstring)
        f_pos = all_f[pick[0]]
        f_neg = torch.cat([f for j, f in enumerate(all_f) if all_global_protos_keys[j] != label.item()])
        xi_info_loss = self.calculate_infonce(f_now, f_pos, f_neg)
        mean_f_pos = mean_f[pick[0]]
        mean_f_pos = mean_f_pos.view(1, -1)
        loss_mse = nn.MSELoss()
        cu_info_loss = loss_mse(f_now, mean_f_pos)
        hierar_info_loss = xi_info_loss + cu_info_loss
        return hierar_info_loss

    def calculate_infonce(self, f_now, f_pos, f_neg):
        f_proto = torch.cat((f_pos, f_neg), dim=0)
        l = torch.cosine_similarity(f_now, f_proto, dim=1)  # noqa: E741 (the release's name)
        l = l / self.infoNCET  # noqa: E741
        exp_l = torch.exp(l)
        exp_l = exp_l.view(1, -1)
        pos_mask = [1 for _ in range(f_pos.shape[0])] + [0 for _ in range(f_neg.shape[0])]
        pos_mask = torch.tensor(pos_mask, dtype=torch.float)
        pos_mask = pos_mask.view(1, -1)
        pos_l = exp_l * pos_mask
        sum_pos_l = pos_l.sum(1)
        sum_exp_l = exp_l.sum(1)
        infonce_loss = -torch.log(sum_pos_l / sum_exp_l)
        return infonce_loss

    def loc_update(self, priloader_list, online_clients, sizes):
        """priloader_list[i](epoch) -> client i's minibatches; online_clients this round's (the release draws them
        with random_state.choice)."""
        self.online_clients = online_clients
        for i in online_clients:
            self._train_net(i, self.nets_list[i], priloader_list[i])
        self.global_protos = self.proto_aggregation(self.local_protos)
        self.aggregate_nets(sizes)

    def _train_net(self, index, net, train_loader):
        params = [p.requires_grad_(True) for p in net.values()]
        optimizer = torch.optim.SGD(params, lr=self.local_lr, momentum=0.9, weight_decay=1e-5)
        criterion = nn.CrossEntropyLoss()
        if len(self.global_protos) != 0:
            all_global_protos_keys = np.array(list(self.global_protos.keys()))
            all_f = []
            mean_f = []
            for protos_key in all_global_protos_keys:
                temp_f = self.global_protos[protos_key]
                temp_f = torch.cat(temp_f, dim=0)
                all_f.append(temp_f.cpu())
                mean_f.append(torch.mean(temp_f, dim=0).cpu())
            all_f = [item.detach() for item in all_f]
            mean_f = [item.detach() for item in mean_f]
        for iter in range(self.local_epoch):
            agg_protos_label = {}
            for batch_idx, (images, labels) in enumerate(train_loader(iter)):
                optimizer.zero_grad()
                f = features(net, images)
                outputs = classifier(net, f)
                lossCE = criterion(outputs, labels)
                if len(self.global_protos) == 0:
                    loss_InfoNCE = 0 * lossCE
                else:
                    i = 0
                    loss_InfoNCE = None
                    for label in labels:
                        if label.item() in self.global_protos.keys():
                            f_now = f[i].unsqueeze(0)
                            loss_instance = self.hierarchical_info_loss(
                                f_now, label, all_f, mean_f, all_global_protos_keys
                            )
                            if loss_InfoNCE is None:
                                loss_InfoNCE = loss_instance
                            else:
                                loss_InfoNCE += loss_instance
                        i += 1
                    loss_InfoNCE = loss_InfoNCE / i
                loss = lossCE + loss_InfoNCE
                loss.backward()
                optimizer.step()
                if iter == self.local_epoch - 1:
                    for i in range(len(labels)):
                        if labels[i].item() in agg_protos_label:
                            agg_protos_label[labels[i].item()].append(f[i, :])
                        else:
                            agg_protos_label[labels[i].item()] = [f[i, :]]
        for p in params:
            p.requires_grad_(False)
        agg_protos = agg_func(agg_protos_label)
        self.local_protos[index] = agg_protos

    def aggregate_nets(self, sizes):
        """federated_model.aggregate_nets with averaing='weight' (freq: the online clients' training-set sizes)."""
        online_clients = self.online_clients
        online_clients_len = np.array([sizes[c] for c in online_clients])
        freq = online_clients_len / np.sum(online_clients_len)
        global_w = {}
        first = True
        for index, net_id in enumerate(online_clients):
            net_para = self.nets_list[net_id]
            if first:
                first = False
                for key in net_para:
                    global_w[key] = net_para[key] * freq[index]
            else:
                for key in net_para:
                    global_w[key] += net_para[key] * freq[index]
        self.global_net = {k: v.detach().clone() for k, v in global_w.items()}
        for net in self.nets_list:
            for k in net:
                net[k] = self.global_net[k].clone()


def global_evaluate(model: FPL, test) -> list[tuple[int, int]]:
    """utils/training.global_evaluate's top-1 hits of the global net on each client's test rows: (correct, rows)."""
    out = []
    for x, y in test:
        with torch.no_grad():
            outputs = classifier(model.global_net, features(model.global_net, x))
        out.append((int((outputs.argmax(-1) == y).sum()), len(y)))
    return out
