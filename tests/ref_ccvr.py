"""A transcription of CCVR as FL-bench releases it (KarhouTam/FL-bench @ 06e658bca5af6ce732e25bb7c0f8be321e14a85e,
src/client/ccvr.py `CCVRClient.get_classwise_feature_means_and_covs`; src/server/ccvr.py
`CCVRServer.test_client_models`, `compute_classes_mean_cov`, `generate_virtual_representation`,
`calibrate_classifier`; and what it inherits: src/client/fedavg.py `FedAvgClient.fit`, `set_parameters`, `package`;
src/server/fedavg.py `FedAvgServer.train`, `aggregate_client_updates` with `return_diff = False`), in plain torch and
numpy, written from that code for tests/test_algo_ccvr.py.

What it takes from outside, as FL-bench takes it from its data indices, client sampler, config and RNGs: the global
network (a dict of tensors: `get_last_features` is FC + ReLU, `classifier` the last FC), each round's selected clients,
each client's training rows and its minibatches (its shuffled DataLoader's, drop_last False), the optimizer's settings
(`sgd`; `reset_optimizer_on_global_epoch: true`, so each round starts from the initial optimizer state), and the two
random draws of a calibration: `multivariate_normal(mean, cov, size)` (np.random.multivariate_normal in the release)
and `loader(data, targets, batch_size)`, the batches of `DataLoader(dataset, batch_size, shuffle=True)`. Test every
round (`test.client.interval = 1`); every client is a train client."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


def get_last_features(net: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"])


def classifier(net: dict, x: torch.Tensor) -> torch.Tensor:
    return x @ net["cls0.weight"].T + net["cls0.bias"]


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    return classifier(net, get_last_features(net, x))


def fit(model, batches, local_epoch, lr, momentum, weight_decay):
    """FedAvgClient.fit with a fresh SGD optimizer (the initial optimizer state) and CrossEntropyLoss."""
    params = [p.requires_grad_(True) for p in model.values()]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    criterion = torch.nn.CrossEntropyLoss()
    for epoch in range(local_epoch):
        for x, y in batches(epoch):
            if len(x) <= 1:  # FL-bench discards one-row batches
                continue
            logit = forward(model, x)
            loss = criterion(logit, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for p in params:
        p.requires_grad_(False)


def get_classwise_feature_means_and_covs(model, trainloader, num_classes):
    """CCVRClient.get_classwise_feature_means_and_covs after set_parameters(server_package), model.eval()."""
    features = []
    targets = []
    feature_length = None
    with torch.no_grad():
        for x, y in trainloader:
            features.append(get_last_features(model, x))
            targets.append(y)

    targets = torch.cat(targets)
    features = torch.cat(features)
    feature_length = features.shape[-1]
    indices = [torch.where(targets == i)[0] for i in range(num_classes)]
    classes_features = [features[idxs] for idxs in indices]
    classes_means, classes_covs = [], []
    for fea in classes_features:
        if fea.shape[0] > 0:
            classes_means.append(fea.mean(dim=0))
            classes_covs.append(fea.t().cov(correction=0))
        else:
            classes_means.append(torch.zeros(feature_length))
            classes_covs.append(torch.zeros(feature_length, feature_length))

    return dict(means=classes_means, covs=classes_covs, counts=[len(idxs) for idxs in indices])


def compute_classes_mean_cov(client_packages, train_clients, num_classes):
    """CCVRServer.compute_classes_mean_cov, the clients' packages given."""
    features_means, features_covs, features_count = [], [], []
    for client_id in train_clients:
        features_means.append(client_packages[client_id]["means"])
        features_covs.append(client_packages[client_id]["covs"])
        features_count.append(client_packages[client_id]["counts"])

    labels_count = [sum(cnts) for cnts in zip(*features_count)]
    classes_mean = [None for _ in range(num_classes)]
    classes_cov = [None for _ in range(num_classes)]
    for c, (means, counts) in enumerate(zip(zip(*features_means), zip(*features_count))):
        if sum(counts) > 0:
            weights = torch.tensor(counts) / labels_count[c]
            means_ = torch.stack(means, dim=-1)
            classes_mean[c] = torch.sum(means_ * weights, dim=-1)
    for c in range(num_classes):
        if classes_mean[c] is not None and labels_count[c] > 1:
            for k in train_clients:
                if classes_cov[c] is None:
                    classes_cov[c] = torch.zeros_like(features_covs[k][c])

                classes_cov[c] += ((features_count[k][c] - 1) / (labels_count[c] - 1)) * features_covs[k][c] + (
                    features_count[k][c] / (labels_count[c] - 1)
                ) * (features_means[k][c].unsqueeze(1) @ features_means[k][c].unsqueeze(0))

            classes_cov[c] -= (labels_count[c] / (labels_count[c] - 1)) * (
                classes_mean[c].unsqueeze(1) @ classes_mean[c].unsqueeze(0)
            )

    return classes_mean, classes_cov


def generate_virtual_representation(classes_mean, classes_cov, sample_per_class, multivariate_normal):
    data, targets = [], []
    for c, (mean, cov) in enumerate(zip(classes_mean, classes_cov)):
        if mean is not None and cov is not None:
            samples = multivariate_normal(mean.cpu().numpy(), cov.cpu().numpy(), sample_per_class)
            data.append(torch.tensor(samples, dtype=torch.float))
            targets.append(torch.ones(sample_per_class, dtype=torch.long) * c)

    data = torch.cat(data)
    targets = torch.cat(targets)
    return data, targets


class RepresentationDataset(Dataset):
    def __init__(self, data, targets):
        self.data = data
        self.targets = targets

    def __getitem__(self, idx):
        return self.data[idx], self.targets[idx]

    def __len__(self):
        return len(self.targets)


def shuffled_loader(data, targets, batch_size):
    return DataLoader(RepresentationDataset(data, targets), batch_size=batch_size, shuffle=True)


def calibrate_classifier(public, client_packages, train_clients, num_classes, sample_per_class, batch_size, lr, draws):
    """CCVRServer.calibrate_classifier: the public network with its classifier retrained (a new dict).
    draws = (multivariate_normal, loader)."""
    multivariate_normal, loader = draws
    classes_mean, classes_cov = compute_classes_mean_cov(client_packages, train_clients, num_classes)
    data, targets = generate_virtual_representation(classes_mean, classes_cov, sample_per_class, multivariate_normal)

    model = {k: v.clone() for k, v in public.items()}  # self.model.load_state_dict(self.public_model_params)
    dataloader = loader(data, targets, batch_size)
    criterion = torch.nn.CrossEntropyLoss()
    head = [model["cls0.weight"].requires_grad_(True), model["cls0.bias"].requires_grad_(True)]
    optimizer = torch.optim.SGD(head, lr=lr)

    for x, y in dataloader:
        logits = classifier(model, x)
        loss = criterion(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return {k: v.detach().clone() for k, v in model.items()}


def ccvr(global_w, selected_rounds, trainsets, num_classes, batches, local_epoch, lr, momentum, weight_decay,
         sample_per_class, batch_size, draws):  # fmt: skip
    """FedAvgServer.train with CCVR's test_client_models after every round. trainsets[c] = (x, y) of client c's
    training rows; batches(round, client, epoch) -> [(x, y)]; draws(round) -> (multivariate_normal, loader).
    Returns, per round, (the public network, the public network as calibrated for testing)."""
    public = {k: v.clone() for k, v in global_w.items()}
    train_clients = list(range(len(trainsets)))
    out = []
    for E, selected in enumerate(selected_rounds):
        packages = {}  # train_one_round: trainer.train(), aggregate_client_updates
        for client_id in selected:
            model = {k: v.clone() for k, v in public.items()}  # set_parameters
            fit(model, lambda e, r=E, c=client_id: batches(r, c, e), local_epoch, lr, momentum, weight_decay)
            packages[client_id] = {"weight": len(trainsets[client_id][1]), "regular_model_params": model}
        client_weights = [package["weight"] for package in packages.values()]
        weights = torch.tensor(client_weights) / sum(client_weights)
        for name in public:
            client_params = torch.stack(
                [package["regular_model_params"][name] for package in packages.values()], dim=-1
            )
            public[name] = torch.sum(client_params * weights, dim=-1)
        # test_client_models: calibrate a copy, test with it, restore the public network
        client_packages = {
            c: get_classwise_feature_means_and_covs(public, [trainsets[c]], num_classes) for c in train_clients
        }
        calibrated = calibrate_classifier(
            public, client_packages, train_clients, num_classes, sample_per_class, batch_size, lr, draws(E)
        )
        out.append(({k: v.clone() for k, v in public.items()}, calibrated))
    return out


def numpy_draws(seed: int):
    """The release's own draws (np.random.multivariate_normal, a shuffled DataLoader), for a run without featcache."""
    np.random.seed(seed)
    torch.manual_seed(seed)
    return lambda E: (np.random.multivariate_normal, shuffled_loader)
