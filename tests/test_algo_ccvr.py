"""CCVR: the pooled class statistics against the paper's formulas written out client by client (float64), the
sampling factor and the classifier's SGD against plain torch, the calibration never entering training, the
vectorized engine against the plain per-client loop, and `ccvr-official` against a transcription of FL-bench's
release (tests/ref_ccvr.py) over several rounds at partial participation, with `ccvr` (the paper's client
covariances) and a broken transcription failing the same comparison."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import configure
from harness import release_batches

from featcache.algorithms import create
from featcache.algorithms.ccvr import calibration_draws, pooled_statistics, retrain_classifier, symmetric_sqrt
from featcache.testing import assert_matches_plain_loop, assert_reduces_to, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_ccvr


def client_features(seed: int = 0):
    """Features z [1, C, N, d] (float64) of 3 clients, labels [C, N] (padding −1), K = 3: client 2 holds class 0 alone,
    class 1 has one row on each of clients 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([[0, 0, 1, 2, 2, 0, -1], [1, 0, 0, 2, 2, 2, 0], [0, 0, 0, 0, -1, -1, -1]])
    z = torch.randn(1, 3, 7, 4, generator=g, dtype=torch.float64) + labels.clamp(min=0)[None, ..., None]
    return z, labels, labels >= 0


def paper_statistics(z, labels, K: int, client_denominator: str):
    """The paper's §4 pooling, client by client: μ_{c,k}, Σ_{c,k} = S_{c,k}/(N_{c,k} − 1) (or / N_{c,k}: FL-bench),
    N_c = Σ_k N_{c,k}, μ_c = Σ_k N_{c,k}/N_c μ_{c,k},
    Σ_c = Σ_k (N_{c,k} − 1)/(N_c − 1) Σ_{c,k} + Σ_k N_{c,k}/(N_c − 1) μ_{c,k} μ_{c,k}^T − N_c/(N_c − 1) μ_c μ_c^T."""
    C, d = z.shape[1], z.shape[-1]
    n_c, mean, cov = torch.zeros(K), torch.zeros(K, d, dtype=z.dtype), torch.zeros(K, d, d, dtype=z.dtype)
    for c in range(K):
        parts = []  # (N_{c,k}, μ_{c,k}, Σ_{c,k}) of the clients holding class c
        for k in range(C):
            rows = [z[0, k, j] for j in range(labels.shape[1]) if labels[k, j] == c]
            if not rows:
                continue
            mu = sum(rows) / len(rows)
            scatter = sum(torch.outer(r - mu, r - mu) for r in rows)
            denom = len(rows) - 1 if client_denominator == "unbiased" else len(rows)
            parts.append((len(rows), mu, scatter / denom if denom > 0 else 0 * scatter))
        N = sum(n for n, _, _ in parts)
        n_c[c] = N
        mean[c] = sum(n / N * mu for n, mu, _ in parts)
        if N >= 2:
            cov[c] = (
                sum((n - 1) / (N - 1) * s for n, _, s in parts)
                + sum(n / (N - 1) * torch.outer(mu, mu) for n, mu, _ in parts)
                - N / (N - 1) * torch.outer(mean[c], mean[c])
            )
    return n_c, mean, cov


@pytest.mark.parametrize("biased", [False, True])
def test_pooled_statistics_are_the_papers_formulas(biased):
    z, labels, mask = client_features()
    n_c, mean, cov = pooled_statistics(z, labels, mask, 3, biased=biased)
    ref_n, ref_mean, ref_cov = paper_statistics(z, labels, 3, "biased" if biased else "unbiased")
    assert n_c.tolist() == ref_n.tolist() == [10, 2, 5]
    torch.testing.assert_close(mean[0], ref_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cov[0], ref_cov, rtol=1e-12, atol=1e-12)
    if not biased:  # the paper's pooling is the covariance of the class's rows over every client together
        for c in range(3):
            rows = torch.cat([z[0, k, labels[k] == c] for k in range(3)])  # [N_c, d]
            torch.testing.assert_close(cov[0, c], rows.T.cov(), rtol=1e-12, atol=1e-12)


def test_the_sampling_factor_is_the_symmetric_square_root():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    cov = a @ a.mT  # [2, 5, 5] of rank 3: singular, as Σ_c is when N_c ≤ d
    root = symmetric_sqrt(cov)
    torch.testing.assert_close(root, root.mT)
    torch.testing.assert_close(root @ root, cov, rtol=1e-10, atol=1e-10)
    eps, orders = calibration_draws(7, 3, classes=2, M=4, d=5, epochs=2)
    again = calibration_draws(7, 3, classes=2, M=4, d=5, epochs=2)
    assert torch.equal(eps, again[0]) and torch.equal(orders, again[1])  # (seed, round) decide the draws
    assert sorted(orders[1].tolist()) == list(range(8)) and not torch.equal(eps, calibration_draws(7, 4, 2, 4, 5, 2)[0])


def test_the_classifier_sgd_is_torchs():
    """Plain SGD on the cross-entropy of FC(d, K) over shuffled minibatches, the last one short, two epochs."""
    g = torch.Generator().manual_seed(1)
    H, K, d, V, B = 2, 3, 4, 11, 4
    W, b = torch.randn(H, K, d, generator=g), torch.randn(H, K, generator=g)
    x, y = torch.randn(H, V, d, generator=g), torch.randint(0, K, (V,), generator=g)
    orders = torch.stack([torch.stack([torch.randperm(V, generator=g) for _ in range(2)]) for _ in range(H)])
    lr = torch.tensor([0.5, 0.1])
    W2, b2 = retrain_classifier(W, b, x, y, orders, lr, B)
    for h in range(H):
        lin = torch.nn.Linear(d, K)
        with torch.no_grad():
            lin.weight.copy_(W[h]), lin.bias.copy_(b[h])
        opt = torch.optim.SGD(lin.parameters(), lr=float(lr[h]))
        for e in range(2):
            for s in range(0, V, B):
                rows = orders[h, e, s : s + B]
                loss = torch.nn.functional.cross_entropy(lin(x[h, rows]), y[rows])
                opt.zero_grad(), loss.backward(), opt.step()
        torch.testing.assert_close(W2[h], lin.weight.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b2[h], lin.bias.detach(), rtol=1e-6, atol=1e-6)


def test_the_calibration_never_enters_training_and_changes_the_scores():
    train, test = synthetic_clients(seed=0), synthetic_clients(seed=1)
    runs = {}
    for name in ("fedavg", "ccvr"):
        eng = Engine(create(name), [configure(name, rounds=3, proj_dim=8, participation=0.5, lr=1e-2)], train, test)
        runs[name] = eng, eng.run()
    (avg, avg_out), (ccvr, ccvr_out) = runs["fedavg"], runs["ccvr"]
    for k, v in avg.state.params.items():
        assert torch.equal(ccvr.state.params[k], v), k  # w^t is FedAvg's, bit for bit
    calibrated = ccvr.state.server["calibrated"]
    assert not torch.equal(calibrated["cls0.weight"], ccvr.state.params["cls0.weight"][:, 0])
    assert not torch.equal(ccvr_out["acc"], avg_out["acc"])
    torch.testing.assert_close(  # the global metric: the clients' pooled hits of the calibrated model
        ccvr_out["global_acc"][-1, 0], (ccvr_out["acc"][-1, 0] * test.counts).sum() / test.counts.sum()
    )


@pytest.mark.parametrize("name", ["ccvr", "ccvr-official"])
def test_engine_equals_the_plain_loop(name):
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults)."""
    assert_matches_plain_loop(name, rounds=2, samples_per_class=20, calib_epochs=2)


def test_no_calibration_is_fedavg():
    assert_reduces_to("ccvr", "fedavg", rounds=2, calib_epochs=0)


# -- the release ----------------------------------------------------------------------------------------------------
C, B, ROUNDS, RATE, M, LR = 6, 8, 3, 0.5, 24, 0.05


RUNS: dict = {}  # featcache's runs and the transcription's, each made once for the file's comparisons


def release_data():
    train = synthetic_clients(C=C, n=(18, 43), D=8, K=4, seed=1)
    test = synthetic_clients(C=C, n=(8, 16), D=8, K=4, seed=1)
    assert all(int(n) % B != 1 for n in train.counts)  # FL-bench discards one-row batches: none here
    return train, test


def release_config(algo) -> dict:
    return configure(
        algo, proj_dim=8, rounds=ROUNDS, batch_size=B, drop_last=False, participation=RATE, samples_per_class=M,
        optimizer="sgd", lr=LR, momentum=0.5, weight_decay=1e-4, calib_lr=LR,
    )  # fmt: skip


def featcache_run(name: str) -> list:
    """featcache's (w^t, w^t with the calibrated classifier) after each round, on the release's data."""
    if name not in RUNS:
        train, test = release_data()
        algo = create(name)
        eng = Engine(algo, [release_config(algo)], train, test)
        RUNS["x0"] = {k: v[0, 0].clone() for k, v in eng.state.params.items()}  # the network FL-bench starts from
        RUNS[name] = []
        for r in range(ROUNDS):
            eng.run(until=r + 1)
            public = {k: v[0, 0].clone() for k, v in eng.state.params.items()}  # every client holds the download
            RUNS[name].append((public, public | {k: v[0].clone() for k, v in eng.state.server["calibrated"].items()}))
    return RUNS[name]


def selected_clients() -> list:
    seeds = torch.tensor([0])
    return [[c for c in range(C) if participation(seeds, r, C, RATE)[0, c]] for r in range(ROUNDS)]


def release_run(broken: bool = False) -> list:
    """The transcription's (public network, calibrated network) after each round, from featcache's initial network,
    on the same clients, minibatches and calibration draws (SGD with momentum and weight decay)."""
    key = "broken" if broken else "release"
    if key in RUNS:
        return RUNS[key]
    train, _ = release_data()
    featcache_run("ccvr-official")  # the initial network
    batches = release_batches(train, B, drop_last=False)

    def draws(r):
        """featcache's standard normals and order for round r, through the release's two calls."""
        counts = torch.bincount(train.labels[train.mask], minlength=4)
        eps, orders = calibration_draws(0, r, int((counts >= 2).sum()), M, 8, 1)
        taken = iter(eps.double().numpy())  # one class after the other, as generate_virtual_representation asks

        def multivariate_normal(mean, cov, size):
            lam, q = np.linalg.eigh(cov.astype(np.float64))
            root = (q * np.sqrt(np.clip(lam, 0, None))) @ q.T  # the symmetric square root of the release's Σ_c
            return mean.astype(np.float64) + next(taken)[:size] @ root

        def loader(data, targets, batch_size):
            o = orders[0]
            return [(data[o[s : s + batch_size]], targets[o[s : s + batch_size]]) for s in range(0, len(o), batch_size)]

        return multivariate_normal, loader

    trainsets = [(train.features[c, : int(train.counts[c])], train.labels[c, : int(train.counts[c])]) for c in range(C)]
    saved = ref_ccvr.compute_classes_mean_cov
    if broken:  # the covariance without the clients' means: Σ_k (N_{c,k} − 1)/(N_c − 1) Σ_{c,k} alone

        def within_only(packages, clients, K):
            means, covs = saved(packages, clients, K)
            for c in range(K):
                if covs[c] is not None:
                    n_c = sum(packages[j]["counts"][c] for j in clients)
                    covs[c] = sum((packages[k]["counts"][c] - 1) / (n_c - 1) * packages[k]["covs"][c] for k in clients)
            return means, covs

        ref_ccvr.compute_classes_mean_cov = within_only
    try:
        RUNS[key] = ref_ccvr.ccvr(RUNS["x0"], selected_clients(), trainsets, 4, batches, 1, LR, 0.5, 1e-4, M, B, draws)
    finally:
        ref_ccvr.compute_classes_mean_cov = saved
    return RUNS[key]


def largest_difference(ours, ref) -> float:
    return max(float((a[i][k] - b[i][k]).abs().max()) for a, b in zip(ours, ref) for i in (0, 1) for k in a[i])


def test_ccvr_official_is_flbenchs_release_at_partial_participation():
    selected = selected_clients()
    assert all(0 < len(s) < C for s in selected) and len({tuple(s) for s in selected}) > 1
    ours, ref = featcache_run("ccvr-official"), release_run()
    assert largest_difference(ours, ref) < 2e-6, largest_difference(ours, ref)  # measured 7.5e-8
    moved = max(float((ref[-1][1][k] - ref[-1][0][k]).abs().max()) for k in ("cls0.weight", "cls0.bias"))
    assert moved > 1e-2  # the calibration moved the classifier


def test_the_papers_covariances_and_a_broken_transcription_fail_the_comparison():
    ours = featcache_run("ccvr")  # client covariances with 1/(N_{c,k} − 1): the paper's, not FL-bench's (2e-3)
    assert largest_difference(ours, release_run()) > 1e-4
    ours = featcache_run("ccvr-official")  # the transcription without the between-client term (8e-3)
    assert largest_difference(ours, release_run(broken=True)) > 1e-3
