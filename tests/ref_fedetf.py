"""A transcription of FedETF as its authors release it (ZexiLee/ICCV-2023-FedETF @
092ace3471d0489c432fcde811ed7b7081042720: client_funct.py `receive_server_model`, `Client_update` (its 'fedetf'
branch), `client_fedetf`, `balanced_softmax_loss`, `Client_personalization`; server_funct.py `receive_client_models`,
`Server_update` (its 'fedavg' branch), `fedavg`; nodes.py `Node.__init__` (one optimizer per node, kept for the whole
run) and `generate_sample_per_class`; utils.py `init_optimizer`; models_dict/resnet.py `ResNet_cifar.forward`
(linear_proto, the ℓ2 normalisation, scaling_train); models_dict/proto_classifiers.py `Proto_Classifier.load_proto`;
main.py's round loop and its closing personalization), in plain torch, written from that code for
tests/test_algo_fedetf.py.

What it takes from outside, as the release takes it from its model zoo, data splits, select-list file and args: the
initial network (a dict of tensors: the body FC + ReLU "proj0.*" (featcache's projection), linear_proto "etfproj0.*",
the ETF `proto` "etf" [d, K] and scaling_train "beta"), each round's selected clients, the size weights, each
client's training labels (its sample_per_class), its minibatches (its shuffled DataLoader's: training ones per
(round, client, epoch), the personalization's per (client, epoch) counted from the personalization's start) and args
(lr, momentum, local_wd_rate, E). No learning-rate decay (main.py comments lr_scheduler out). The personalization's
two literals are module constants, so a test may run fewer alternations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALTERNATIONS, PHASE_EPOCHS = 20, 3  # Client_personalization's literals (`range(20)`, `range(3)`)
MODEL = ("proj0.weight", "proj0.bias", "etfproj0.weight", "etfproj0.bias", "beta")  # model.parameters()


def forward(model: dict, data: torch.Tensor) -> torch.Tensor:
    """ResNet_cifar.forward's `feature`: linear_proto of the body's output, divided by its norm."""
    out = torch.relu(data @ model["proj0.weight"].T + model["proj0.bias"])
    feature = out @ model["etfproj0.weight"].T + model["etfproj0.bias"]
    feature_norm = torch.norm(feature, p=2, dim=1, keepdim=True).clamp(min=1e-12)
    feature = torch.div(feature, feature_norm)
    return feature


def balanced_softmax_loss(logits, labels, sample_per_class, reduction="mean"):
    spc = sample_per_class.type_as(logits)
    spc = spc.unsqueeze(0).expand(logits.shape[0], -1)
    logits = logits + spc.log()
    loss = F.cross_entropy(input=logits, target=labels, reduction=reduction)
    return loss


class Node:
    """nodes.Node for a client: its model (leaf tensors, loaded in place), proto, sample_per_class and the optimizer
    init_optimizer made over model.parameters() (SGD with momentum and weight decay), kept for the whole run."""

    def __init__(self, network: dict, labels: torch.Tensor, num_classes: int, args: dict):
        self.model = {k: network[k].clone().requires_grad_(True) for k in MODEL}
        self.proto = network["etf"].clone()
        sample_per_class = torch.tensor([int((labels == i).sum()) for i in range(num_classes)])
        self.sample_per_class = torch.where(sample_per_class > 0, sample_per_class, 1)
        self.optimizer = torch.optim.SGD(
            list(self.model.values()), lr=args["lr"], momentum=args["momentum"], weight_decay=args["local_wd_rate"]
        )

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for k, v in self.model.items():
                v.copy_(state[k])


def receive_server_model(client_nodes, central):
    for node in client_nodes:
        node.load_state_dict({k: v.clone() for k, v in central.items()})
        node.proto = central["etf"].clone()  # load_proto(central_node.model.proto_classifier.proto)


def client_fedetf(node, batches, opt="balancedloss"):
    loss = 0.0
    for data, target in batches:
        node.optimizer.zero_grad()
        feature = forward(node.model, data)

        output_local = torch.matmul(feature, node.proto)
        output_local = node.model["beta"] * output_local

        if opt == "balancedloss":
            loss_local = balanced_softmax_loss(output_local, target, node.sample_per_class)
        elif opt == "celoss":
            loss_local = F.cross_entropy(output_local, target)

        loss_local.backward()
        loss = loss + loss_local.item()
        node.optimizer.step()
    return loss / max(len(batches), 1)


def client_update(client_nodes, central, select_list, E, batches):
    """Client_update, 'fedetf' branch: every client receives the server model, the selected train E epochs."""
    receive_server_model(client_nodes, central)
    for i in select_list:
        for epoch in range(E):
            client_fedetf(client_nodes[i], batches(i, epoch))


def server_update(central, client_nodes, select_list, size_weights):
    """Server_update, 'fedavg' branch (receive_client_models, fedavg): the new central network."""
    client_params = [{k: v.detach().clone() for k, v in client_nodes[idx].model.items()} for idx in select_list]
    agg_weights = [size_weights[idx] for idx in select_list]
    agg_weights = [w / sum(agg_weights) for w in agg_weights]
    new = dict(central)
    for name_param in client_params[0]:
        list_values_param = [p[name_param] * w for p, w in zip(client_params, agg_weights)]
        new[name_param] = sum(list_values_param) / sum(agg_weights)
    return new


def client_personalization(client_nodes, central, E, momentum, local_wd_rate, batches):
    """Client_personalization for every client: Client_update, then ALTERNATIONS (20) alternations of PHASE_EPOCHS
    (3) epochs on the proto (SGD 0.1) and as many on linear_proto (SGD 0.05 with args.momentum,
    args.local_wd_rate), with the cross-entropy. batches(i, e): client i's minibatches of the personalization's
    epoch e."""
    epoch = [0] * len(client_nodes)

    def next_batches(i):
        epoch[i] += 1
        return batches(i, epoch[i] - 1)

    receive_server_model(client_nodes, central)
    for i in range(len(client_nodes)):
        for _ in range(E):
            client_fedetf(client_nodes[i], next_batches(i))
    for _ in range(ALTERNATIONS):
        # finetune the proto
        for i in range(len(client_nodes)):
            for param in client_nodes[i].model.values():
                param.requires_grad = False
            client_nodes[i].proto.requires_grad = True
            client_nodes[i].optimizer = torch.optim.SGD([client_nodes[i].proto], lr=0.1)
            for _ in range(PHASE_EPOCHS):
                _ = client_fedetf(client_nodes[i], next_batches(i), opt="celoss")
        # finetune the projection layer
        for i in range(len(client_nodes)):
            for name, param in client_nodes[i].model.items():
                param.requires_grad = "etfproj0" in name  # 'linear_proto' in name
            client_nodes[i].proto.requires_grad = False
            trained = [p for p in client_nodes[i].model.values() if p.requires_grad]
            client_nodes[i].optimizer = torch.optim.SGD(trained, 0.05, momentum=momentum, weight_decay=local_wd_rate)
            for _ in range(PHASE_EPOCHS):
                _ = client_fedetf(client_nodes[i], next_batches(i), opt="celoss")


def scores(node, data):
    """The personalized scores of a client's rows: scaling_train · feature @ proto (validate takes their argmax)."""
    with torch.no_grad():
        return node.model["beta"] * (forward(node.model, data) @ node.proto)


def fedetf(network, selected_rounds, labels, num_classes, size_weights, batches, args):
    """main.py: the rounds (Client_update, Server_update), returning the central network after each, and the client
    nodes at the end. batches(round, client, epoch) -> [(x, y)]."""
    central = {k: v.clone() for k, v in network.items()}
    client_nodes = [Node(central, labels[i], num_classes, args) for i in range(len(labels))]
    out = []
    for rounds, select_list in enumerate(selected_rounds):
        client_update(client_nodes, central, select_list, args["E"], lambda i, e, r=rounds: batches(r, i, e))
        central = server_update(central, client_nodes, select_list, size_weights)
        out.append({k: v.clone() for k, v in central.items()})
    return out, client_nodes
