"""pFedGate as released, transcribed into plain torch for featcache's head on cached features.

Repository: https://github.com/yxdyc/pFedGate, commit b8cfa156acdb08207d33641a355959503ca1db78 ("minor fix",
2023-05-26). Files read: pFedGate/gated_learner.py, pFedGate/gated_client.py, pFedGate/gate_aggregator.py,
models/gating_layers.py, models/knapsack_solver.py, models/adapted_op.py, models/nn_nets.py,
models/switchable_norm.py, utils/args.py, utils/optim.py, utils/utils.py (get_learner, get_loader,
get_sparse_factor_scheduler), utils/torch_utils.py, aggregator.py, client.py, learners/learner.py, run_experiment.py,
scripts/README.md. Written from that code only (class and method names, control flow as released); the learnable model
is featcache's head (featcache/algorithms/base.py FedAvg.init with bn off: proj0 = Linear(D, proj_dim), ReLU,
cls0 = Linear(proj_dim, K)) in the released `Adapted*` model style. Not collected by pytest.

Behaviours of the released method that change numbers (file: function):
 1. Every parameter tensor of the model (weights AND biases, classifier included) is split into contiguous sub-blocks
    of its flattened (row-major) elements: split = 5 if numel >= 5 else numel; size = ceil(numel / split);
    blocks = ceil(numel / size), the last one shorter (so a tensor of 8 gives 4 blocks of 2, one of 4 gives 4 of 1).
    (models/gating_layers.py: GatingLayer.__init__)
 2. The gating layer is norm_input_layer -> Linear(input size, number of blocks) -> BatchNorm1d(number of blocks); it
    sees the client's raw input (here the cached feature). The release's input norm is a SwitchNorm2d over image
    channels (learned softmax mix of instance/layer/batch statistics, running statistics at eval); cached features
    have no channels, so this transcription uses the release's own 2-D class SwitchNorm1d(D) (layer + batch
    statistics, momentum 0.997, running_var starting at 0) -- an adaptation, `gate_input_norm="none"` drops it.
    The base model always sees the un-normalised input (person_input_norm = 0). (gating_layers.py: GatingLayer)
 3. Gates g = mean over the minibatch of sigmoid(gating logits): ONE gate vector, hence one sparse model, per
    minibatch, at training and at test time (so a test row's prediction depends on the other rows of its test batch).
    (gated_learner.py: get_top_gated_scores)
 4. Two gate vectors: t = batch-mean sigmoid (unclipped) scales the kept blocks; g = clip(t, min = 0.2) ranks them.
    With seperate_trans = 1 (the CIFAR-100 scripts) t comes from a second, identical-architecture network w_transform.
    min_sparse_factor = min(max(1 / 5, 0.1), sparse_factor) = 0.2. (get_top_gated_scores; __init__)
 5. Selection (block_wise_prune = 1): value_i = round(10 * g_i) (numpy, half to even, in float64); each tensor's first
    sub-block (name containing "sub0") is never a candidate and always kept; the other blocks are split into
    nn.Linear blocks and the rest, each group filled by a greedy knapsack: sort by value descending, take every block
    whose size still fits capacity = round(sum of the group's candidate sizes * (sparse_factor - 0.2)) -- it does not
    stop at the first block that does not fit. Not a top-k. (select_top_trans_weights, _select_top_sub_blocks;
    knapsack_solver.py: KnapsackSolver01.found_max_value_greedy)
    Ties: the release sorts with numpy's default argsort; its pinned numpy 1.19.5 sorts <= 17 items by insertion sort,
    i.e. stably (lower block index first). featcache's head has at most 16 candidates, so this file sorts stably; a
    numpy >= 1.25 SIMD argsort is not stable and would break ties differently.
 6. Straight-through mask: m = 1 - g.detach() + g (value 1, gradient 1 w.r.t. g, 0 below the 0.2 clip), times 0 for
    dropped blocks; the effective weight of sub-block i is W_i * t_i * m_i: kept blocks are SCALED by their mean gate
    t_i (not kept at 1), dropped ones are zero. With sparse_factor = 1 there is no selection and no m: W_i * t_i.
    (select_top_trans_weights; adapt_prune_model)
 7. The model's forward with the masked parameters applies a ReLU to the logits too (every Adapted* model's
    adapted_forward ends in F.relu), so the loss is CE on relu(logits) and predictions are argmax of relu(logits).
    (models/adapted_op.py: AdaptedLeNet.adapted_forward)
 8. Loss: mean CE over the minibatch (+ alpha / 2 * sum_k ||W_k - W_k_masked||_F with alpha = 0 in every script).
    (fit_batch)
 9. Two optimizers, created once per client and kept for the whole run (momentum buffers persist across rounds):
    SGD(model, lr_model, momentum 0.9, weight_decay 5e-4) and SGD(gating layer incl. input norm and w_transform,
    lr_gating, momentum 0.9, weight_decay 5e-4). Gradient norms are clipped at 10 separately for the gating layer and
    for the model. Dropped blocks get zero gradient but still decay and move with their momentum.
    (utils/optim.py: get_optimizer; fit_batch)
10. bi_level_opt = 0 (every released script): one backward per minibatch, then the gating step, then the model step.
    bi_level_opt = 1 (argparse default): per local epoch, one pass training only the gating layer (model in eval),
    then a second pass (reshuffled) training only the model with the gating layer in eval mode (BN running stats).
    (gated_client.py: pFedGateClient.step; fit_batch)
11. Minibatches: train loader shuffled, drop_last for CIFAR when the client has more than B rows; any minibatch of
    one row is skipped (training and test). Test loader: dataset order, B rows per batch, no drop_last.
    (utils/utils.py: get_loader; gated_learner.py: fit_epoch)
12. The learning rates follow a per-epoch schedule stepped with epoch = the learner's global_epoch, which is reset to
    the server's round counter each round (multi_step: x0.1 at 3 * (n_rounds // 4)); with online_aggregate = 1 the
    counter is already incremented when clients train. (fit_epoch; gate_aggregator.py: global_to_local_info)
13. Server: only the model is averaged; every gating layer (and its BN/input-norm statistics) stays personal and is
    never sent (trans_gating_layer = False). Weights: online_aggregate = 1 (the CIFAR scripts): the number of rows the
    client actually trained this round (after drop_last and skipped batches, times local epochs);
    online_aggregate = 0: n_k / n over all clients' dataset sizes. Every client starts the round from the average.
    (gate_aggregator.py: _mix_load_three_model, _mix_load_all_model; torch_utils.py)
14. Inference: each client evaluates with its own model AS TRAINED in the last round (before aggregation; the
    aggregate is loaded only into non-sampled clients) and its personal gating layer in eval mode, gating per test
    batch as in 3-6. (gate_aggregator.py: mix/write_logs; gated_client.py: write_logs)
15. Every client's model and gating layer start from the same initialisation (get_learner seeds each learner with the
    same seed). (utils/utils.py: get_learner)
Supported here: full participation (sampling_rate = 1), sparse_factor_scheduler "constant", optimizers sgd / adam,
lr schedulers constant / multi_step / sqrt / linear / cosine_annealing (reduce_on_plateau needs the global test
accuracy and is refused), bi_level_opt 0 / 1, block_wise_prune = 1 (the fractional path of block_wise_prune = 0 is
used by no script).
"""

from __future__ import annotations

import copy
import math
import warnings
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

RELEASED_REPO = "https://github.com/yxdyc/pFedGate"
RELEASED_COMMIT = "b8cfa156acdb08207d33641a355959503ca1db78"

# The released run for CIFAR-100, sparse factor 0.5 (scripts/README.md, "run pFedGate with sparse-factor=0.5 on
# CIFAR-100 dataset with full participation"); where that line is silent, utils/args.py's argparse default.
RELEASED_DEFAULTS = {
    "lr_model": 0.03,  # scripts/README.md CIFAR-100 s=0.5: --lr_model=0.03 (argparse --lr_model default 1e-3)
    "lr_gating": 1.5,  # scripts/README.md CIFAR-100 s=0.5: --lr_gating=1.5 (argparse --lr_gating default 1e-3)
    "optimizer": "sgd",  # scripts/README.md: --optimizer=sgd (argparse --optimizer default "sgd")
    "momentum": 0.9,  # utils/optim.py get_optimizer: optim.SGD(..., momentum=0.9, ...) hard-coded
    "weight_decay": 5e-4,  # utils/optim.py get_optimizer: weight_decay=5e-4 hard-coded (sgd and adam)
    "clip_norm": 10.0,  # gated_learner.py fit_batch: clip_grad_norm_(..., max_norm=10, norm_type=2) hard-coded
    "bz": 128,  # scripts/README.md: --bz=128 (argparse --bz default 1)
    "local_steps": 1,  # scripts/README.md: --local_steps=1 (argparse --local_steps default 1)
    "sparse_factor": 0.5,  # scripts/README.md CIFAR-100 s=0.5: --sparse_factor=0.5 (argparse default 1)
    "fine_grained_block_split": 5,  # scripts/README.md: --fine_grained_block_split=5 (argparse default 1)
    "block_wise_prune": 1,  # scripts/README.md: --block_wise_prune=1 (argparse default 0)
    "seperate_trans": 1,  # scripts/README.md CIFAR-100 lines: --seperate_trans=1 (CIFAR-10/EMNIST lines: argparse 0)
    "bi_level_opt": 0,  # scripts/README.md: --bi_level_opt 0 in every line (argparse --bi_level_opt default 1)
    "online_aggregate": 1,  # scripts/README.md CIFAR lines: --online_aggregate 1 (EMNIST: 0; argparse default 0)
    "aggregate_sampled_clients": 0,  # argparse --aggregate_sampled_clients default 0
    "sampling_rate": 1.0,  # argparse --sampling_rate default 1.0 (scripts: full participation)
    "lr_scheduler": "multi_step",  # scripts/README.md CIFAR-100: --lr_scheduler=multi_step (argparse "constant")
    "n_rounds": 400,  # scripts/README.md: --n_rounds=400; only sets the multi_step milestone 3 * (n_rounds // 4)
    "sparse_factor_scheduler": "constant",  # scripts/README.md: --sparse_factor_scheduler=constant
    "alpha": 0.0,  # argparse --alpha default 0 ("In the final version ... we always set alpha=0", fit_batch)
    "importance_prior_para_num": 0,  # argparse --importance_prior_para_num default 0
    "person_input_norm": 0,  # argparse --person_input_norm default 0
    "gated_scores_scale_factor": 10,  # gated_learner.py GatedLearner.__init__: self.gated_scores_scale_factor = 10
    "drop_last": True,  # utils/utils.py get_loader: drop_last for cifar10/cifar100 train loaders with len > bz
    "gate_input_norm": "switchnorm1d",  # adaptation of gating_layers.py norm_input_layer (SwitchNorm2d on images)
}


# -- models/nn_nets.py, models/switchable_norm.py, models/adapted_op.py ----------------------------------------------
class Reshape(nn.Module):
    """models/gating_layers.py Reshape(reshape_type="flat_dim0")."""

    def forward(self, x):
        B = x.size()[0]
        return x.view(B, -1)


class SwitchNorm1d(nn.Module):
    """models/switchable_norm.py SwitchNorm1d, as released."""

    def __init__(self, num_features, eps=1e-5, momentum=0.997, using_moving_average=True):
        super().__init__()
        self.eps = eps
        self.momentum = momentum
        self.using_moving_average = using_moving_average
        self.weight = nn.Parameter(torch.ones(1, num_features))
        self.bias = nn.Parameter(torch.zeros(1, num_features))
        self.mean_weight = nn.Parameter(torch.ones(2))
        self.var_weight = nn.Parameter(torch.ones(2))
        self.register_buffer("running_mean", torch.zeros(1, num_features))
        self.register_buffer("running_var", torch.zeros(1, num_features))

    def forward(self, x):
        mean_ln = x.mean(1, keepdim=True)
        var_ln = x.var(1, keepdim=True)
        if self.training:
            mean_bn = x.mean(0, keepdim=True)
            var_bn = x.var(0, keepdim=True)
            if self.using_moving_average:
                self.running_mean.mul_(self.momentum)
                self.running_mean.add_((1 - self.momentum) * mean_bn.data)
                self.running_var.mul_(self.momentum)
                self.running_var.add_((1 - self.momentum) * var_bn.data)
            else:
                self.running_mean.add_(mean_bn.data)
                self.running_var.add_(mean_bn.data**2 + var_bn.data)
        else:
            mean_bn = self.running_mean
            var_bn = self.running_var
        softmax = nn.Softmax(0)
        mean_weight = softmax(self.mean_weight)
        var_weight = softmax(self.var_weight)
        mean = mean_weight[0] * mean_ln + mean_weight[1] * mean_bn
        var = var_weight[0] * var_ln + var_weight[1] * var_bn
        x = (x - mean) / (var + self.eps).sqrt()
        return x * self.weight + self.bias


class AdaptedHead(nn.Module):
    """featcache's head (proj0 -> ReLU -> cls0) in the style of models/adapted_op.py AdaptedLeNet: `forward` with
    its own parameters, `adapted_forward` with the gated parameters in adapted_model_para (ReLU on the output too)."""

    def __init__(self, d_in, proj_dim, num_classes):
        super().__init__()
        self.proj0 = nn.Linear(d_in, proj_dim)
        self.cls0 = nn.Linear(proj_dim, num_classes)
        self.adapted_model_para = {name: None for name, val in self.named_parameters()}

    def forward(self, x):
        x = F.relu(self.proj0(x))
        x = self.cls0(x)
        return x

    def adapted_forward(self, x):
        # adapted_op.py AdaptedLeNet.adapted_forward: F.relu after every F.linear, the output layer included
        x = F.relu(
            F.linear(x, weight=self.adapted_model_para["proj0.weight"], bias=self.adapted_model_para["proj0.bias"])
        )
        x = F.relu(
            F.linear(x, weight=self.adapted_model_para["cls0.weight"], bias=self.adapted_model_para["cls0.bias"])
        )
        return x

    def set_adapted_para(self, name, val):
        self.adapted_model_para[name] = val

    def del_adapted_para(self):
        for key, val in self.adapted_model_para.items():
            if self.adapted_model_para[key] is not None:
                self.adapted_model_para[key].grad = None
                self.adapted_model_para[key] = None


# -- models/gating_layers.py -----------------------------------------------------------------------------------------
class GatingLayer(nn.Module):
    """GatingLayer, with input_feat_size = D (the cached feature) instead of an image's C*H*W."""

    def __init__(
        self,
        model_to_mask,
        input_feat_size,
        fine_grained_block_split=1,
        seperate_trans=0,
        gate_input_norm="switchnorm1d",
    ):
        super().__init__()
        ori_block_names = [p[0] for p in model_to_mask.named_parameters()]
        ori_block_size_lookup_table = torch.tensor([p.numel() for p in model_to_mask.parameters()])
        # linear_layer_idx: blocks of nn.Linear modules are ranked separately from the rest
        linear_layer_block_idx = []
        for i, p in enumerate(model_to_mask.named_parameters()):
            module = model_to_mask.get_submodule(".".join(p[0].split(".")[:-1]))
            if isinstance(module, torch.nn.Linear):
                linear_layer_block_idx.append(i)

        self.fine_grained_block_split = fine_grained_block_split
        # "para_name" -> (para_sub_block_begin_idx, para_sub_block_end_idx, size_each_sub)
        self.para_name_to_block_split_info = {}
        assert self.fine_grained_block_split >= 1
        if self.fine_grained_block_split == 1:
            self.block_names = ori_block_names
            self.block_size_lookup_table = ori_block_size_lookup_table
            self.linear_layer_block_idx = linear_layer_block_idx
        else:
            self.block_names = []
            self.block_size_lookup_table = []
            self.linear_layer_block_idx = []
            cur_block_idx = 0
            for i, name in enumerate(ori_block_names):
                size = int(ori_block_size_lookup_table[i])
                split_num = self.fine_grained_block_split if size >= self.fine_grained_block_split else size
                size_each_sub = math.ceil(size / split_num)
                split_num = math.ceil(size / size_each_sub)
                self.para_name_to_block_split_info[name] = (cur_block_idx, cur_block_idx + split_num, size_each_sub)
                for j in range(split_num - 1):
                    self.block_names.append(f"{name}.sub{j}")
                    self.block_size_lookup_table.append(size_each_sub)
                    if i in linear_layer_block_idx:
                        self.linear_layer_block_idx.append(cur_block_idx)
                    cur_block_idx += 1
                self.block_names.append(f"{name}.sub{split_num - 1}")
                size_last_sub = size - (split_num - 1) * size_each_sub
                self.block_size_lookup_table.append(size_last_sub)
                if i in linear_layer_block_idx:
                    self.linear_layer_block_idx.append(cur_block_idx)
                cur_block_idx += 1
            self.block_size_lookup_table = torch.tensor(self.block_size_lookup_table)
        self.non_linear_layer_block_idx = [
            i for i in range(len(self.block_size_lookup_table)) if i not in self.linear_layer_block_idx
        ]
        # the first sub-block of every tensor is never a knapsack candidate (always kept)
        self.linear_layer_block_idx_filter_first = [
            idx for idx in self.linear_layer_block_idx if "sub0" not in self.block_names[idx]
        ]
        self.non_linear_layer_block_idx_filter_first = [
            idx for idx in self.non_linear_layer_block_idx if "sub0" not in self.block_names[idx]
        ]

        # ---------------------------- Build gating layer ----------------------------
        self.norm_input_layer = SwitchNorm1d(input_feat_size) if gate_input_norm == "switchnorm1d" else nn.Identity()
        self.gating = nn.Sequential(
            Reshape(),
            nn.Linear(in_features=input_feat_size, out_features=len(self.block_names)),
            torch.nn.BatchNorm1d(num_features=len(self.block_names)),
        )
        self.seperate_trans = seperate_trans
        if self.seperate_trans == 1:
            self.w_transform = copy.deepcopy(self.gating)
        self.norm_input_each_forward = True

    def forward(self, x):
        if self.norm_input_each_forward:
            x = self.norm_input_layer(x)
        gating_score = self.gating(x)  # [B, num_blocks]
        if self.seperate_trans == 1:
            trans_weight = self.w_transform(x)  # [B, num_blocks]
        else:
            trans_weight = gating_score
        return gating_score, trans_weight


# -- models/knapsack_solver.py ---------------------------------------------------------------------------------------
def found_max_value_greedy(weight_list, value_list, capacity):
    """KnapsackSolver01.found_max_value_greedy: every item, by value descending, that still fits."""
    sorted_idx = np.argsort(-value_list, kind="stable")  # numpy 1.19.5's default argsort for <= 17 items
    selected_idx = []
    droped_idx = []
    total_weight = 0
    total_value = 0
    for idx in sorted_idx:
        weight_after_select = total_weight + weight_list[idx]
        if weight_after_select <= capacity:
            total_weight = weight_after_select
            total_value += value_list[idx]
            selected_idx.append(idx)
        else:
            droped_idx.append(idx)
    return total_value, total_weight, selected_idx, droped_idx


# -- pFedGate/gated_learner.py ---------------------------------------------------------------------------------------
def get_optimizer(optimizer_name, model, lr_initial, args):
    """utils/optim.py get_optimizer (momentum 0.9 and weight decay 5e-4 are hard-coded there)."""
    params = [param for param in model.parameters() if param.requires_grad]
    if optimizer_name == "adam":
        return torch.optim.Adam(params, lr=lr_initial, weight_decay=args["weight_decay"])
    if optimizer_name == "sgd":
        return torch.optim.SGD(params, lr=lr_initial, momentum=args["momentum"], weight_decay=args["weight_decay"])
    raise NotImplementedError(f"optimizer {optimizer_name}")


def get_lr_scheduler(optimizer, scheduler_name, n_rounds):
    """utils/optim.py get_lr_scheduler with gated_learner=True."""
    if scheduler_name == "sqrt":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda x: 1 / np.sqrt(x) if x > 0 else 1)
    if scheduler_name == "linear":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda x: 1 / x if x > 0 else 1)
    if scheduler_name == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda x: 1)
    if scheduler_name == "cosine_annealing":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200, eta_min=0)
    if scheduler_name == "multi_step":
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[3 * (n_rounds // 4)], gamma=0.1)
    raise NotImplementedError(f"lr_scheduler {scheduler_name} (reduce_on_plateau needs the global test accuracy)")


def scheduler_step(scheduler, epoch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the released code steps with an explicit epoch (deprecated in torch)
        scheduler.step(epoch=epoch)


def get_model_diff_norm(model_a_param, model_b_param):
    """utils/torch_utils.py get_model_diff_norm (dict branch, norm_type="fro")."""
    res = 0
    for key, val in model_a_param.items():
        tmp_res = torch.norm(val - model_b_param[key], p="fro")
        if torch.isnan(tmp_res) or torch.isinf(tmp_res):
            continue
        res += tmp_res
    return res


class GatedLearner:
    def __init__(self, base_model, gating_layer, args):
        self.args = args
        self.model = base_model
        self.gating_layer = gating_layer
        self.device = "cpu"
        self.criterion = nn.CrossEntropyLoss(reduction="none")
        self.optimizer = get_optimizer(args["optimizer"], self.model, args["lr_model"], args)
        self.lr_scheduler = get_lr_scheduler(self.optimizer, args["lr_scheduler"], args["n_rounds"])
        self.opt_for_gating = get_optimizer(args["optimizer"], self.gating_layer, args["lr_gating"], args)
        self.lr_scheduler_for_gating = get_lr_scheduler(self.opt_for_gating, args["lr_scheduler"], args["n_rounds"])
        self.importance_prior_para_num = args["importance_prior_para_num"]
        self.alpha = args["alpha"]
        self.person_input_norm = args["person_input_norm"]
        if self.person_input_norm == 1:
            self.gating_layer.norm_input_each_forward = False
        self.sparse_factor = args["sparse_factor"]  # sparse_factor_scheduler "constant" -> None
        self.min_sparse_factor = min(max(1 / gating_layer.fine_grained_block_split, 0.1), self.sparse_factor)
        self.block_wise_prune = args["block_wise_prune"] == 1
        assert self.block_wise_prune, "only block_wise_prune = 1 (every released script) is transcribed"
        self.global_epoch = 0
        self.total_model_size = torch.sum(self.gating_layer.block_size_lookup_table)
        self.gated_scores_scale_factor = args["gated_scores_scale_factor"]
        self.schedule_lr_freq = "epoch"

    def del_adapted_model_para(self):
        self.model.del_adapted_para()

    def get_top_gated_scores(self, x):
        """Gating weights from the learned gating layer, averaged over the batch."""
        gating_logits, trans_weights = self.gating_layer(x)  # [B, num_blocks] each
        gated_scores = torch.sigmoid(gating_logits)
        gated_scores = torch.mean(gated_scores, dim=0)  # [num_blocks]
        if id(gated_scores) != id(trans_weights):  # always true: trans_weights is the logits tensor
            trans_weights = torch.sigmoid(trans_weights)
            trans_weights = torch.mean(trans_weights, dim=0)  # [num_blocks]
        # avoid cutting info flow (some internal sub-blocks are all zeros)
        gated_scores = torch.clip(gated_scores, min=self.min_sparse_factor)  # [num_blocks]
        top_trans_weights, sparse_ratio_selected = self.select_top_trans_weights(gated_scores, trans_weights)
        return gated_scores, top_trans_weights, sparse_ratio_selected

    def adapt_prune_model(self, top_trans_weights):
        if self.gating_layer.fine_grained_block_split == 1:
            for para_idx, para in enumerate(self.model.parameters()):
                mask = torch.ones_like(para).reshape(-1) * top_trans_weights[para_idx]
                self.model.set_adapted_para(self.gating_layer.block_names[para_idx], mask.view(para.shape) * para)
        else:
            for para_name, para in self.model.named_parameters():
                mask = torch.ones_like(para).reshape(-1)
                sub_block_begin, sub_block_end, size_each_sub = self.gating_layer.para_name_to_block_split_info[
                    para_name
                ]
                for i in range(sub_block_begin, sub_block_end):
                    block_element_begin = (i - sub_block_begin) * size_each_sub
                    block_element_end = (i + 1 - sub_block_begin) * size_each_sub
                    mask[block_element_begin:block_element_end] *= top_trans_weights[i]
                mask = mask.view(para.shape)
                self.model.set_adapted_para(para_name, mask * para)
        return top_trans_weights.detach()

    def select_top_trans_weights(self, gated_scores, trans_weight):
        """Keep sparse_factor of the model's size via the greedy 0-1 knapsack (in_place=True, block_wise_prune)."""
        if self.sparse_factor == 1:
            return trans_weight, torch.tensor(1.0)
        retained_trans_weights = trans_weight
        mask = torch.ones_like(gated_scores)
        if id(trans_weight) != id(gated_scores):
            mask = mask - gated_scores.detach() + gated_scores  # straight-through
        if self.importance_prior_para_num == 1:
            importance_value_list = np.array(((gated_scores + self.block_size_lookup_table_normalized()) / 2).tolist())
        else:
            importance_value_list = np.array(gated_scores.tolist())
        importance_value_list = np.around(importance_value_list * self.gated_scores_scale_factor).astype(np.int64)
        selected_size = self._select_top_sub_blocks(
            importance_value_list, self.gating_layer.linear_layer_block_idx_filter_first, mask
        )
        selected_size += self._select_top_sub_blocks(
            importance_value_list, self.gating_layer.non_linear_layer_block_idx_filter_first, mask
        )
        retained_trans_weights *= mask
        return retained_trans_weights, selected_size / self.total_model_size

    def block_size_lookup_table_normalized(self):
        """GatingLayer.block_size_lookup_table_normalized: sizes / group sum, per linear / non-linear group."""
        table = self.gating_layer.block_size_lookup_table.double()
        out = table.clone()
        for idx in (self.gating_layer.linear_layer_block_idx, self.gating_layer.non_linear_layer_block_idx):
            if idx:
                out[idx] = table[idx] / table[idx].sum()
        return out

    def _select_top_sub_blocks(self, importance_value_list, block_idx, mask):
        weight_list = self.gating_layer.block_size_lookup_table[block_idx]
        importance_value_list = importance_value_list[block_idx]
        capacity = torch.round(torch.sum(weight_list) * (self.sparse_factor - self.min_sparse_factor)).int()
        _, total_weight, _, droped_item_idx = found_max_value_greedy(
            weight_list=weight_list.tolist(), value_list=importance_value_list, capacity=capacity
        )
        droped_item_idx = np.array(block_idx, dtype=np.int64)[droped_item_idx]
        mask[droped_item_idx] *= 0
        return total_weight

    def fit_batch(self, batch, train_gating_layer=False, train_base_model=True):
        """One step on one batch; returns (loss, top_trans_weights, relu'd logits)."""
        if train_gating_layer:
            self.gating_layer.train()
            self.opt_for_gating.zero_grad()
        else:
            self.gating_layer.eval()
        if train_base_model:
            self.model.train()
            self.optimizer.zero_grad()
        else:
            self.model.eval()
        x, y = batch
        x = x.type(self.model.proj0.weight.dtype)  # the release casts to float32, its parameters' dtype
        if self.person_input_norm:
            x = self.gating_layer.norm_input_layer(x)
        gated_scores, top_trans_weights, sparse_ratio_selected = self.get_top_gated_scores(x)
        top_trans_weights = self.adapt_prune_model(top_trans_weights)
        y_pred = self.model.adapted_forward(x)  # [B, K]
        loss_vec = self.criterion(y_pred, y)
        loss_meta_model = loss_vec.mean()
        loss_diversity = get_model_diff_norm(dict(list(self.model.named_parameters())), self.model.adapted_model_para)
        loss_gating_layer = loss_meta_model + self.alpha / 2 * loss_diversity
        if train_gating_layer:
            loss_gating_layer.backward()
            torch.nn.utils.clip_grad_norm_(self.gating_layer.parameters(), max_norm=self.args["clip_norm"], norm_type=2)
            self.opt_for_gating.step()
        if train_base_model:
            if not train_gating_layer:
                loss_meta_model.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=self.args["clip_norm"], norm_type=2)
            self.optimizer.step()
        self.del_adapted_model_para()
        return loss_meta_model.detach(), top_trans_weights, y_pred.detach()

    def fit_epoch(self, iterator, train_gating_layer=False, train_base_model=True):
        total_loss_meta_model = 0
        n_samples = 0
        preds = []
        for x, y in iterator:
            batch_samples = y.size(0)
            if batch_samples == 1:
                preds.append(torch.full((1, self.model.cls0.out_features), float("nan")))
                continue  # for batch_norm: a single row is skipped, training and test alike
            n_samples += batch_samples
            loss_meta_model, _, y_pred = self.fit_batch((x, y), train_gating_layer, train_base_model)
            total_loss_meta_model += loss_meta_model * batch_samples
            preds.append(y_pred)
        self.global_epoch += 1
        if train_gating_layer and self.lr_scheduler_for_gating and self.schedule_lr_freq == "epoch":
            scheduler_step(self.lr_scheduler_for_gating, self.global_epoch)
        if train_base_model and self.lr_scheduler and self.schedule_lr_freq == "epoch":
            scheduler_step(self.lr_scheduler, self.global_epoch)
        total_loss_meta_model /= max(n_samples, 1)
        return float(total_loss_meta_model), n_samples, preds


# -- pFedGate/gated_client.py ----------------------------------------------------------------------------------------
class pFedGateClient:
    def __init__(self, learner, node_id, x, y, test_x, test_y, order, args):
        self.learner, self.node_id, self.args = learner, node_id, args
        self.x, self.y, self.test_x, self.test_y = x, y, test_x, test_y
        self.order = order
        self.n_train_samples = x.shape[0]  # client.py: len(self.train_iterator.dataset)
        self.local_steps = args["local_steps"]
        self.bi_level_opt = args["bi_level_opt"]
        self.c_round = 0
        self.pass_idx = 0

    def train_iterator(self):
        """The shuffled train DataLoader, in the given order, with get_loader's drop_last rule."""
        batches = list(self.order(self.node_id, self.c_round, self.pass_idx))
        self.pass_idx += 1
        n, bz = self.n_train_samples, self.args["bz"]
        if self.args["drop_last"] and n > bz and len(batches[-1]) < bz:
            batches = batches[:-1]
        return [(self.x[rows], self.y[rows]) for rows in batches]

    def test_iterator(self):
        """get_loader(train=False): dataset order, bz rows per batch, no drop_last."""
        bz = self.args["bz"]
        return [(self.test_x[s : s + bz], self.test_y[s : s + bz]) for s in range(0, self.test_x.shape[0], bz)]

    def step(self):
        learner = self.learner
        self.pass_idx = 0
        total_loss, trained_sample_n = 0.0, 0
        for i in range(self.local_steps):
            if self.bi_level_opt == 1:
                learner.fit_epoch(self.train_iterator(), train_gating_layer=True, train_base_model=False)
                loss, n_samples, _ = learner.fit_epoch(
                    self.train_iterator(), train_gating_layer=False, train_base_model=True
                )
            elif self.bi_level_opt == 0:
                loss, n_samples, _ = learner.fit_epoch(
                    self.train_iterator(), train_gating_layer=True, train_base_model=True
                )
            else:
                raise NotImplementedError("bi_level_opt 2 is not transcribed")
            trained_sample_n += n_samples
            total_loss += loss
        learner.optimizer.zero_grad(set_to_none=True)  # learners_ensemble.free_gradients
        return total_loss / self.local_steps, trained_sample_n

    def write_logs(self):
        """The test pass: gating layer and model in eval mode, gates per test batch; returns the test logits."""
        _, _, preds = self.learner.fit_epoch(self.test_iterator(), train_gating_layer=False, train_base_model=False)
        return torch.cat(preds) if preds else torch.zeros(0, self.learner.model.cls0.out_features)


# -- pFedGate/gate_aggregator.py -------------------------------------------------------------------------------------
class pFedGateAggregator:
    def __init__(self, clients, global_model, args):
        self.clients, self.global_model, self.args = clients, global_model, args
        self.online_aggregate = args["online_aggregate"]
        self.c_round = 0
        w = torch.tensor([client.n_train_samples for client in clients], dtype=torch.float32)
        self.clients_weights = w / w.sum()  # aggregator.py Aggregator.__init__
        self.losses = [[] for _ in clients]

    def global_to_local_info(self, client):
        client.learner.model.load_state_dict(self.global_model.state_dict())  # copy_model; the gating layer stays
        client.learner.global_epoch = self.c_round
        client.c_round = self.rnd

    def mix(self, rnd):
        self.rnd = rnd
        if self.online_aggregate == 1:
            self._mix_load_three_model()
        else:
            self._mix_load_all_model()

    def _mix_load_all_model(self):
        for client in self.clients:  # sampling_rate = 1: every client
            self.global_to_local_info(client)
            loss, _ = client.step()
            self.losses[client.node_id].append(loss)
        target_state_dict = self.global_model.state_dict(keep_vars=True)
        for key in target_state_dict:  # average_model_of_learners, weights n_k / n (its float32 branch: every
            # head tensor is floating; the release tests dtype == float32, its default dtype)
            target_state_dict[key].data.fill_(0.0)
            for learner_id, client in enumerate(self.clients):
                state_dict = client.learner.model.state_dict(keep_vars=True)
                target_state_dict[key].data += self.clients_weights[learner_id] * state_dict[key].data.clone()
        self.c_round += 1

    def _mix_load_three_model(self):
        sampled_client_trained_n = []
        online_aggregated_model = copy.deepcopy(self.global_model).state_dict(keep_vars=True)
        for key in online_aggregated_model:
            online_aggregated_model[key].data = torch.zeros_like(online_aggregated_model[key])
        self.c_round += 1  # incremented before the clients train in this mode
        for client in self.clients:
            self.global_to_local_info(client)
            loss, trained_sample_n = client.step()
            self.losses[client.node_id].append(loss)
            sampled_client_trained_n.append(trained_sample_n)
            ori_state_dict = client.learner.model.state_dict(keep_vars=True)
            for key in online_aggregated_model:  # average_torch_state_dict_online
                online_aggregated_model[key].data += trained_sample_n * ori_state_dict[key].data.clone()
        total_weights = sum(sampled_client_trained_n)  # aggregate over all clients: every one was sampled
        for key in online_aggregated_model:  # mean_torch_state_dict
            online_aggregated_model[key].data = online_aggregated_model[key].data.clone() / total_weights
        self.global_model.load_state_dict(online_aggregated_model)


# -- entry points ----------------------------------------------------------------------------------------------------
HEAD_NAMES = ("proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias")


def gate_names(args: dict) -> list[str]:
    """The gating layer's state_dict names (GatingLayer's released attribute names)."""
    head = AdaptedHead(2, 2, 2)
    return list(
        GatingLayer(
            head, 2, args["fine_grained_block_split"], args["seperate_trans"], args["gate_input_norm"]
        ).state_dict()
    )


def released_init(D: int, K: int, proj_dim: int, args: dict, seed: int = 1234) -> dict:
    """Initial tensors by name as get_learner builds them (torch.manual_seed(seed), then the model, then the gate)."""
    args = RELEASED_DEFAULTS | args
    torch.manual_seed(seed)
    head = AdaptedHead(D, proj_dim, K)
    gate = GatingLayer(head, D, args["fine_grained_block_split"], args["seperate_trans"], args["gate_input_norm"])
    return {k: v.clone() for k, v in (head.state_dict() | gate.state_dict()).items()}


def randperm_order(train, bz: int, seed: int = 0):
    """A shuffled DataLoader's batches (the last one shorter): order(client, round, pass) -> [index tensors]."""

    def order(client, rnd, epoch):
        g = torch.Generator().manual_seed(seed * 1_000_003 + client * 10_007 + rnd * 101 + epoch)
        return list(torch.randperm(int(train.counts[client]), generator=g).split(bz))

    return order


def featcache_order(train, bz: int, seed: int):
    """featcache's minibatch order (training/schedule.py batch_order), split into batches of bz rows."""
    from featcache.training.schedule import batch_order

    def order(client, rnd, epoch):
        n = int(train.counts[client])
        rows = batch_order(torch.tensor([seed]), rnd, epoch, train.counts, train.features.shape[1])[0, client][:n]
        return list(rows.split(bz))

    return order


def run_released(args: dict, train, test, init: dict, rounds: int, order):
    """`rounds` rounds of pFedGate as released, every client every round.

    args: overrides of RELEASED_DEFAULTS (n_rounds only places the multi_step milestone); train / test: .features [C, N,
    D], .labels [C, N], .counts [C]; init: head names HEAD_NAMES and the gating layer's names (`gate_names(args)`), the
    same for every client; order(client, round, pass) -> list of index tensors into the client's rows, the batches
    of a shuffled DataLoader before drop_last (pass = local epoch, or 2 * epoch + {0, 1} with bi_level_opt = 1).
    Returns (clients_out, global_model): clients_out[c] = {"model": head and gating-layer tensors by name as the
    client evaluates with them, "logits": relu'd test logits [n_test_c, K] (NaN rows for a skipped 1-row test batch),
    "train_loss": mean training loss per round}; global_model: the averaged head after the last round.
    """
    args = RELEASED_DEFAULTS | args
    if args["sampling_rate"] != 1 or args["sparse_factor_scheduler"] != "constant":
        raise NotImplementedError("only full participation and a constant sparse factor are transcribed")
    D, K, proj_dim = init["proj0.weight"].shape[1], init["cls0.weight"].shape[0], init["proj0.weight"].shape[0]

    def build():
        head = AdaptedHead(D, proj_dim, K)
        gate = GatingLayer(head, D, args["fine_grained_block_split"], args["seperate_trans"], args["gate_input_norm"])
        head.load_state_dict({k: init[k].clone() for k in head.state_dict()})
        state = gate.state_dict()
        state.update({k: init[k].clone() for k in state if k in init})
        missing = [
            k for k in state if k not in init and not k.startswith(("norm_input_layer.", "gating.2.", "w_transform.2."))
        ]
        if missing:
            raise KeyError(f"init lacks {missing}")
        gate.load_state_dict(state)
        return head, gate

    clients = []
    for c in range(len(train.counts)):
        head, gate = build()
        n, m = int(train.counts[c]), int(test.counts[c])
        clients.append(
            pFedGateClient(
                GatedLearner(head, gate, args),
                c,
                train.features[c, :n],
                train.labels[c, :n],
                test.features[c, :m],
                test.labels[c, :m],
                order,
                args,
            )
        )
    global_model, _ = build()
    aggregator = pFedGateAggregator(clients, global_model, args)
    for rnd in range(rounds):
        aggregator.mix(rnd)
    out = []
    for client in clients:
        logits = client.write_logs()
        model = {
            k: v.detach().clone()
            for k, v in (client.learner.model.state_dict() | client.learner.gating_layer.state_dict()).items()
        }
        out.append({"model": model, "logits": logits, "train_loss": aggregator.losses[client.node_id]})
    return out, {k: v.detach().clone() for k, v in global_model.state_dict().items()}


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    C, D, K, counts, test_counts = 4, 16, 4, (40, 52, 68, 96), (17, 18, 19, 20)

    def clients(counts):
        N, centres = max(counts), torch.randn(K, D, generator=torch.Generator().manual_seed(99)) * 2
        x, y = torch.zeros(C, N, D), torch.full((C, N), -1)
        for c, n in enumerate(counts):
            y[c, :n] = torch.randint(0, K, (n,), generator=g)
            x[c, :n] = centres[y[c, :n]] + torch.randn(n, D, generator=g) * 1.5
        return SimpleNamespace(features=x, labels=y, counts=torch.tensor(counts))

    train, test = clients(counts), clients(test_counts)
    args = {"bz": 8}
    init = released_init(D, K, 8, args)
    out, glob = run_released(args, train, test, init, rounds=3, order=randperm_order(train, 8))
    print("init names:", sorted(init))
    losses = torch.tensor([o["train_loss"] for o in out])  # [C, rounds]
    print("mean training loss per round:", [round(v, 4) for v in losses.mean(0).tolist()])
    acc = [
        float((o["logits"].argmax(-1) == test.labels[c, : test_counts[c]]).float().mean()) for c, o in enumerate(out)
    ]
    print("test accuracy per client:", [round(a, 3) for a in acc])
    assert losses.mean(0)[-1] < losses.mean(0)[0], "the training loss should decrease"
