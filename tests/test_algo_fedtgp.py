"""FedTGP: the client's loss, the adaptive margin and the server's adaptive-margin-enhanced contrastive loss (with its
gradient through the TGP) against the paper's equations written out with explicit sums (float64), the vectorized
engine against the plain per-client loop, and `fedtgp` against a transcription of the authors' release
(tests/ref_fedtgp.py) at partial participation over several rounds and server passes, with the release's loss
without its margin as the control that fails the same comparison."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import configure
from harness import release_batches

from featcache.algorithms import create
from featcache.algorithms.protos import server_order
from featcache.algorithms.fedtgp import acl_loss, adaptive_margin, tgp_init
from featcache.testing import assert_matches_plain_loop
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_fedtgp
from tests.synthetic import synthetic_clients
from tests.test_algo_baselines import classify, neg_log_softmax, project
from tests.test_algo_fedgh import without_a_class

D, P, K = 3, 4, 3  # the tiny hand-checked head: input features, projection width, classes


def tiny(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"proj0.weight": (P, D), "proj0.bias": (P,), "cls0.weight": (K, P), "cls0.bias": (K,)}
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def test_the_local_loss_is_ce_plus_lambda_times_the_distance_to_the_global_prototype():
    """L_i = (1/n) Σ_n [CE(h_i(f_i(x_n)), y_n) + λ (1/d) Σ_j (f_i(x_n)_j − Ĝ^{y_n}_j)²]; CE alone before any
    global prototype exists."""
    algo = create("fedtgp", configure("fedtgp", proj_dim=P))
    params = tiny(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 2, -1])  # the last row is padding
    mask = y >= 0
    G = torch.randn(K, P, generator=g, dtype=torch.float64)
    lam = 2.5
    for has in (torch.ones(K, dtype=torch.bool), torch.zeros(K, dtype=torch.bool)):
        ctx = {"hp": {"lam": torch.tensor(lam, dtype=torch.float64)}, "prototypes": G, "has": has}
        loss = lambda p: algo.local_loss(p, {}, x, y, mask, ctx)[0]
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        expected = 0.0
        for n in range(4):
            z = project(leaves, x[n])
            yn = int(y[n])
            expected = expected + neg_log_softmax(classify(leaves, z), yn)
            if has.all():
                expected = expected + lam * sum((z[j] - G[yn, j]) ** 2 for j in range(P)) / P
        expected = expected / 4
        expected.backward()
        assert abs(float(loss(params)) - float(expected.detach())) < 1e-12
        for k, v in torch.func.grad(loss)(params).items():
            torch.testing.assert_close(v, leaves[k].grad, rtol=1e-10, atol=1e-12)


def test_the_adaptive_margin_is_the_largest_nearest_class_distance_capped_at_tau():
    """δ = min(max_c min_{c'≠c} ||Q^c − Q^{c'}||, τ), Q^c the mean of the prototypes of the clients holding c, over
    the classes present; with one class present there is nothing to measure: δ = τ."""
    g = torch.Generator().manual_seed(0)
    H, C, K5, d = 2, 3, 5, 4
    protos = torch.randn(H, C, K5, d, generator=g, dtype=torch.float64)
    counts = torch.randint(0, 3, (H, C, K5), generator=g).double()
    counts[0, :, 4] = 0  # class 4 absent in model 0
    counts[1] = 0
    counts[1, 1, 2] = 5  # model 1: a single class present
    tau = torch.tensor([100.0, 7.0], dtype=torch.float64)
    got = adaptive_margin(protos, counts, tau)
    present = [k for k in range(K5) if counts[0, :, k].sum() > 0]
    Q = {
        k: sum(protos[0, c, k] for c in range(C) if counts[0, c, k] > 0)
        / sum(1 for c in range(C) if counts[0, c, k] > 0)
        for k in present
    }
    gaps = [min(math.dist(Q[k].tolist(), Q[j].tolist()) for j in present if j != k) for k in present]
    assert len(present) >= 3
    assert abs(float(got[0]) - min(max(gaps), 100.0)) < 1e-12
    assert float(got[1]) == 7.0
    assert float(adaptive_margin(protos, counts, torch.tensor([0.1, 7.0], dtype=torch.float64))[0]) == 0.1


def test_the_server_loss_and_its_gradient_are_the_adaptive_margin_contrastive_loss():
    """L^P = (1/b) Σ_n −log e^{−(ψ(P_n, Ĝ^{y_n}) + δ)} / (e^{−(ψ(P_n, Ĝ^{y_n}) + δ)} + Σ_{c≠y_n} e^{−ψ(P_n, Ĝ^c)}),
    ψ the L2 distance, Ĝ^c = W_2 ReLU(W_1 G^c + b_1) + b_2, per model; gradients reach G and W."""
    H, b, d = 2, 5, 3
    tgp = [tgp_init(K, d, torch.Generator().manual_seed(h)) for h in range(H)]
    params = {k: torch.stack([m[k] for m in tgp]).double() for k in tgp[0]}
    g = torch.Generator().manual_seed(5)
    x = torch.randn(H, b, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, K, (H, b), generator=g)
    mask = torch.tensor([[True] * b, [True, True, True, False, False]])
    margin = torch.tensor([0.8, 2.0], dtype=torch.float64)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    expected = []
    for h in range(H):
        W1, b1, W2, b2 = (leaves[k][h] for k in ("tgp.mid.weight", "tgp.mid.bias", "tgp.fc.weight", "tgp.fc.bias"))
        G = leaves["tgp.emb"][h]
        hidden = [[torch.relu(sum(W1[i, j] * G[c, j] for j in range(d)) + b1[i]) for i in range(d)] for c in range(K)]
        Ghat = [[sum(W2[o, i] * hidden[c][i] for i in range(d)) + b2[o] for o in range(d)] for c in range(K)]
        rows = [n for n in range(b) if mask[h, n]]
        total = 0.0
        for n in rows:
            psi = [torch.sqrt(sum((x[h, n, j] - Ghat[c][j]) ** 2 for j in range(d))) for c in range(K)]
            yn = int(y[h, n])
            pos = torch.exp(-(psi[yn] + margin[h]))
            total = total - torch.log(pos / (pos + sum(torch.exp(-psi[c]) for c in range(K) if c != yn)))
        expected.append(total / len(rows))
    sum(expected).backward()
    got = acl_loss(params, x, y, mask, margin)
    torch.testing.assert_close(got, torch.stack(expected).detach(), rtol=1e-10, atol=1e-12)
    grads = torch.func.grad(lambda p: acl_loss(p, x, y, mask, margin).sum())(params)
    for k, v in grads.items():
        torch.testing.assert_close(v, leaves[k].grad, rtol=1e-8, atol=1e-10)


def test_engine_equals_the_plain_loop():
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults)."""
    assert_matches_plain_loop("fedtgp", rounds=2, server_epochs=3)


# -- the release ----------------------------------------------------------------------------------------------------
C, B, ROUNDS, EPOCHS, LR, LAM, SERVER_EPOCHS, RATE = 6, 8, 4, 1, 0.05, 10.0, 3, 0.5
TGP_NAMES = {  # featcache's TGP parameters -> Trainable_Global_Prototypes' state_dict
    "tgp.emb": "embedings.weight",
    "tgp.mid.weight": "middle.0.weight",
    "tgp.mid.bias": "middle.0.bias",
    "tgp.fc.weight": "fc.weight",
    "tgp.fc.bias": "fc.bias",
}


def release_runs():
    """(per-round state of fedtgp, its result, the data, the selected clients of ROUNDS + 1 iterations, x0, tgp0)."""
    train = without_a_class(synthetic_clients(C=C, n=(20, 40), D=8, K=4, seed=0))
    test = synthetic_clients(C=C, n=(8, 16), D=8, K=4)
    algo = create("fedtgp")
    cfg = configure(
        algo,
        proj_dim=8,
        rounds=ROUNDS,
        batch_size=B,
        participation=RATE,
        local_epochs=EPOCHS,
        lam=LAM,
        server_lr=LR,  # the release's server steps at the clients' learning rate
        server_epochs=SERVER_EPOCHS,
    ) | {"optimizer": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0, "drop_last": True}
    eng = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in eng.state.params.items()}
    tgp0 = {TGP_NAMES[k]: eng.state.server[k][0].clone() for k in TGP_NAMES}
    per_round = []
    record = lambda *_: per_round.append(
        ({k: v[0].clone() for k, v in eng.state.params.items()}, {k: v[0].clone() for k, v in eng.state.server.items()})
    )
    out = eng.run(progress=record, logs=False)
    seeds = torch.tensor([0])
    selected = [[c for c in range(C) if participation(seeds, i, C, RATE)[0, c]] for i in range(ROUNDS + 1)]
    return per_round, out, (train, test), selected, x0, tgp0


def run_release(x0, tgp0, selected, data, margin_threthold: float = 100.0):
    train, test = data
    seeds, K4 = torch.tensor([0]), train.num_classes

    batches = release_batches(train, B, drop_last=True)

    def proto_rows(i: int, c: int):  # featcache's prototypes: every training row (see fedtgp.py)
        n = int(train.counts[c])
        return [(train.features[c, :n], train.labels[c, :n])]

    def shuffle(i: int, epoch: int, keys: list) -> list[int]:
        """featcache's order of the server's pass (server_order), as a permutation of the release's upload list."""
        valid = torch.zeros(1, C * K4, dtype=torch.bool)
        valid[0, [c * K4 + k for c, k in keys]] = True
        order = server_order(seeds, i, epoch, valid)[0, : len(keys)].tolist()
        return [keys.index((m // K4, m % K4)) for m in order]

    rows = lambda c: (test.features[c, : int(test.counts[c])], test.labels[c, : int(test.counts[c])])
    return ref_fedtgp.fedtgp(
        x0,
        tgp0,
        C,
        K4,
        selected,
        batches,
        proto_rows,
        rows,
        shuffle,
        EPOCHS,
        LR,
        LAM,
        B,
        SERVER_EPOCHS,
        margin_threthold,
    )


def largest_difference(per_round, out, ref) -> float:
    """The largest difference from the release over every round: the TGP's parameters, the global prototypes and
    each client's test accuracy (evaluated in the release at the start of the next iteration)."""
    rounds, _, evaluations = ref
    worst = 0.0
    for r, (_, server) in enumerate(per_round):
        tgp, protos = rounds[r]
        worst = max(worst, *(float((server[k] - tgp[v]).abs().max()) for k, v in TGP_NAMES.items()))
        worst = max(worst, float((server["prototypes"] - protos).abs().max()))
        acc = torch.tensor([correct / n for correct, n in evaluations[r + 1]])
        worst = max(worst, float((out["acc"][r, 0] - acc).abs().max()))
    return worst


@pytest.fixture(scope="module")
def release():
    return release_runs()


def test_fedtgp_is_the_release_at_partial_participation(release):
    per_round, out, data, selected, x0, tgp0 = release
    assert any(c not in selected[0] for c in selected[1])  # a client trains for the first time after iteration 0
    rounds, models, _ = ref = run_release(x0, tgp0, selected, data)
    assert largest_difference(per_round, out, ref) < 2e-6
    assert float((rounds[-1][0]["embedings.weight"] - tgp0["embedings.weight"]).abs().max()) > 1e-2  # it trained
    for c in range(C):  # the client models after the last round (the release's iteration ROUNDS − 1)
        for k, v in per_round[-1][0].items():
            torch.testing.assert_close(v[c], models[ROUNDS - 1][c][k], atol=2e-6, rtol=0)


def test_the_loss_without_its_margin_fails_the_same_comparison(release):
    """The control: the release's server loss without the adaptive margin (margin_threthold 0)."""
    per_round, out, data, selected, x0, tgp0 = release
    assert largest_difference(per_round, out, run_release(x0, tgp0, selected, data, margin_threthold=0.0)) > 1e-3
