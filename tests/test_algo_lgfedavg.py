"""LG-FedAvg: its round against Alg. 1 of the paper written out in float64 (explicit sums, plain gradient descent,
the n_m-weighted mean of the global part), the vectorized engine against the plain per-client loop, and
`lg-fedavg` against a transcription of PFLlib's release (tests/ref_lgfedavg.py) at partial participation, with a
broken copy of the transcription that fails the same comparison."""

from __future__ import annotations

import pytest
import torch
from conftest import configure
from harness import release_batches

from featcache.algorithms import create
from featcache.testing import assert_matches_plain_loop
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_lgfedavg
from tests.synthetic import synthetic_clients
from tests.test_algo_baselines import classify, neg_log_softmax, project

LOCAL, GLOBAL = ("proj0.weight", "proj0.bias"), ("cls0.weight", "cls0.bias")  # θ^ℓ_m, θ^g


def task_loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(1/n) Σ_i −log softmax(g(ℓ_m(x_i)))_{y_i}, one sample at a time."""
    return sum(neg_log_softmax(classify(p, project(p, x[i])), int(y[i])) for i in range(len(y))) / len(y)


def test_a_round_is_alg1_local_representations_and_the_weighted_mean_of_the_global_model():
    """Two rounds, two of three clients each, two local epochs of full-batch gradient descent on θ^ℓ_m and θ^g
    jointly; the server takes θ^g ← Σ_{m∈S} n_m/n_S θ^g_m, every client takes it, θ^ℓ_m stays where it was trained."""
    train, test = synthetic_clients(C=3, n=(3, 6), D=3, K=3, seed=0), synthetic_clients(C=3, n=(2, 4), D=3, K=3)
    lr, epochs, rounds, rate = 0.5, 2, 2, 0.67
    algo = create("lg-fedavg")
    cfg = configure(
        algo, proj_dim=4, rounds=rounds, local_epochs=epochs, batch_size=8, drop_last=False, participation=rate
    ) | {"optimizer": "sgd", "lr": lr, "momentum": 0.0, "weight_decay": 0.0}
    eng = Engine(algo, [cfg], train, test)
    start = {k: v[0, 0].double().clone() for k, v in eng.state.params.items()}
    eng.run()
    models = [{k: v.clone() for k, v in start.items()} for _ in range(3)]  # every client from the initial model
    head = {k: start[k].clone() for k in GLOBAL}
    for r in range(rounds):
        S = [m for m in range(3) if participation(torch.tensor([0]), r, 3, rate)[0, m]]
        assert len(S) == 2
        for m in S:
            p = {k: models[m][k] for k in LOCAL} | {k: head[k].clone() for k in GLOBAL}
            n = int(train.counts[m])
            x, y = train.features[m, :n].double(), train.labels[m, :n]
            for _ in range(epochs):
                leaf = {k: v.clone().requires_grad_(True) for k, v in p.items()}
                g = torch.autograd.grad(task_loss(leaf, x, y), list(leaf.values()))
                p = {k: v - lr * gk for (k, v), gk in zip(p.items(), g)}  # θ ← θ − η ∇L, both parts
            models[m] = p
        n_S = sum(int(train.counts[m]) for m in S)
        head = {k: sum(int(train.counts[m]) / n_S * models[m][k] for m in S) for k in GLOBAL}
        for m in range(3):
            models[m] = {k: models[m][k] for k in LOCAL} | head
    for m in range(3):
        for k, v in eng.state.params.items():
            torch.testing.assert_close(v[0, m].double(), models[m][k], atol=1e-5, rtol=1e-5, msg=f"client {m} {k}")
        n = int(test.counts[m])
        scores = eng.algo.predict({k: v[0, m] for k, v in eng.state.params.items()}, {}, test.features[m, :n], {})
        for i in range(n):  # each client predicts with its own representation under the global classifier
            logits = classify(models[m], project(models[m], test.features[m, i].double()))
            torch.testing.assert_close(scores[i].double(), torch.stack(logits), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(eng.state.params["proj0.weight"][0, 0], eng.state.params["proj0.weight"][0, 1])


@pytest.mark.parametrize("bn", [False, True])
def test_only_the_global_classifier_is_sent_and_shared(bn):
    train, test = synthetic_clients(seed=0), synthetic_clients(seed=1)
    algo = create("lg-fedavg")
    eng = Engine(algo, [configure(algo, proj_dim=8, rounds=2, bn=bn, participation=0.5)], train, test)
    out = eng.run()
    sent = set(eng.algo.upload(eng.state, eng.last_round))
    assert sent == set(GLOBAL)
    assert out["upload_floats"][0] == sum(eng.state.params[k][0, 0].numel() for k in GLOBAL)
    for k, v in (eng.state.params | eng.state.buffers).items():  # BN (with the representation) stays local
        assert torch.equal(v, v[:, :1].expand_as(v)) == (k in GLOBAL), k
    assert out["global_acc"] is None


def test_engine_equals_the_plain_loop():
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults)."""
    assert_matches_plain_loop("lg-fedavg", rounds=2)


# -- the release ----------------------------------------------------------------------------------------------------
C, B, ROUNDS, EPOCHS, LR, RATE = 6, 16, 4, 2, 0.05, 0.5


def release_runs():
    """(per-round parameters of lg-fedavg, its result, the data, the selected clients of ROUNDS + 1 iterations)."""
    train, test = synthetic_clients(C=C, n=(32, 56), D=8, K=3, seed=0), synthetic_clients(C=C, n=(8, 16), D=8, K=3)
    algo = create("lg-fedavg")
    cfg = configure(algo, proj_dim=8, rounds=ROUNDS, batch_size=B, participation=RATE, local_epochs=EPOCHS)
    cfg |= {"optimizer": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0, "drop_last": True}
    eng = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in eng.state.params.items()}
    per_round = []
    out = eng.run(progress=lambda *_: per_round.append({k: v[0].clone() for k, v in eng.state.params.items()}))
    seeds = torch.tensor([0])
    selected = [[c for c in range(C) if participation(seeds, i, C, RATE)[0, c]] for i in range(ROUNDS + 1)]
    return per_round, out, (train, test), selected, x0


def run_release(x0, selected, data):
    train, test = data

    batches = release_batches(train, B, drop_last=True)

    sizes = [int(n) for n in train.counts]
    rows = lambda c: (test.features[c, : int(test.counts[c])], test.labels[c, : int(test.counts[c])])
    return ref_lgfedavg.lg_fedavg(x0, selected, sizes, batches, rows, EPOCHS, LR)


def largest_difference(per_round, out, ref) -> float:
    """The largest difference from the release over every round: the server's classifier, each client's
    representation after the last round, and each client's test accuracy (evaluated in the release after the next
    iteration's send_models)."""
    heads, _, evaluations = ref
    worst = 0.0
    for r, params in enumerate(per_round):
        worst = max(worst, *(float((params[k][0] - heads[r][k]).abs().max()) for k in GLOBAL))
        acc = torch.tensor([correct / rows for correct, rows in evaluations[r + 1]])
        worst = max(worst, float((out["acc"][r, 0] - acc).abs().max()))
    return worst


@pytest.fixture(scope="module")
def release():
    return release_runs()


def test_lg_fedavg_is_the_release_at_partial_participation(release):
    per_round, out, data, selected, x0 = release
    assert any(c not in selected[0] for c in selected[1])  # a client trains for the first time after iteration 0
    ref = run_release(x0, selected, data)
    assert largest_difference(per_round, out, ref) < 2e-6
    heads, clients, _ = run_release(x0, selected[:ROUNDS], data)  # ROUNDS iterations: the final representations
    for c in range(C):
        for k in LOCAL:
            torch.testing.assert_close(per_round[-1][k][c], clients[c][k], atol=2e-6, rtol=0)


def test_a_broken_transcription_fails_the_same_comparison(release, monkeypatch):
    """The control: the release with the participants' classifiers averaged uniformly (not by train_samples)."""
    per_round, out, data, selected, x0 = release
    monkeypatch.setattr(ref_lgfedavg, "upload_weights", lambda sizes, active: [1 / len(active)] * len(active))
    assert largest_difference(per_round, out, run_release(x0, selected, data)) > 1e-3
