"""FedGH: two rounds against the paper's steps written out in float64 (explicit sums, plain gradient descent on the
clients, LARs as explicit class means, one server step on the LARs' cross-entropy), the vectorized engine against the
plain per-client loop, and `fedgh` against a transcription of the release (tests/ref_fedgh.py: HtFLlib's, which
PFLlib's equals but for its server header) at partial participation over several rounds and server passes, with
PFLlib's server header (client 0's own) as the control that fails the same comparison."""

from __future__ import annotations

import pytest
import torch
from conftest import configure
from harness import release_batches

from featcache.algorithms import create
from featcache.algorithms.protos import server_order
from featcache.cache import ClientData
from featcache.testing import assert_matches_plain_loop
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_fedgh
from tests.synthetic import synthetic_clients
from tests.test_algo_baselines import classify, neg_log_softmax, project

LOCAL, HEADER = ("proj0.weight", "proj0.bias"), ("cls0.weight", "cls0.bias")  # φ_k, θ


def without_a_class(data: ClientData) -> ClientData:
    """Client c holds no row of class c mod K (its rows of that class relabelled as the next one): LARs of
    different clients cover different classes."""
    K = data.num_classes
    drop = (torch.arange(len(data.counts)) % K)[:, None]  # [C, 1]
    labels = torch.where(data.labels == drop, (data.labels + 1) % K, data.labels)
    return ClientData(data.features, labels, data.counts, K, data.views)


def task_loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(1/n) Σ_i −log softmax(H(R_k(x_i); θ))_{y_i}, one sample at a time."""
    return sum(neg_log_softmax(classify(p, project(p, x[i])), int(y[i])) for i in range(len(y))) / len(y)


def test_two_rounds_are_the_papers_local_training_lars_and_server_step():
    """Three clients, two of them per round, two local epochs of full-batch gradient descent on (φ_k, θ_k) from the
    global header; LARs R̄_k^s = mean of R_k(x) over the client's class-s rows; the server takes one full-batch step
    θ ← θ − η_θ ∇ (1/M) Σ_{k,s} CE(H(R̄_k^s; θ), s) over the round's M LARs, and every client takes θ."""
    train = without_a_class(synthetic_clients(C=3, n=(4, 7), D=3, K=3, seed=0))
    test = synthetic_clients(C=3, n=(2, 4), D=3, K=3, seed=1)
    lr, server_lr, epochs, rounds, rate = 0.5, 0.7, 2, 2, 0.67
    algo = create("fedgh")
    cfg = configure(
        algo,
        proj_dim=4,
        rounds=rounds,
        local_epochs=epochs,
        batch_size=16,  # ≥ every client's rows and every round's LARs: full batches on both sides
        drop_last=False,
        participation=rate,
        server_lr=server_lr,
        server_epochs=1,
    ) | {"optimizer": "sgd", "lr": lr, "momentum": 0.0, "weight_decay": 0.0}
    eng = Engine(algo, [cfg], train, test)
    start = {k: v[0, 0].double().clone() for k, v in eng.state.params.items()}
    eng.run(logs=False)
    models = [{k: v.clone() for k, v in start.items()} for _ in range(3)]  # every client from the initial model
    theta = {k: start[k].clone() for k in HEADER}  # the server's header starts as the initial one
    for r in range(rounds):
        S = [k for k in range(3) if participation(torch.tensor([0]), r, 3, rate)[0, k]]
        assert len(S) == 2
        lars = []  # (R̄_k^s, s)
        for k in S:
            p = {n: models[k][n] for n in LOCAL} | {n: theta[n].clone() for n in HEADER}  # θ_k ← θ^{t−1}
            n = int(train.counts[k])
            x, y = train.features[k, :n].double(), train.labels[k, :n]
            for _ in range(epochs):
                leaf = {n: v.clone().requires_grad_(True) for n, v in p.items()}
                g = torch.autograd.grad(task_loss(leaf, x, y), list(leaf.values()))
                p = {n: v - lr * gn for (n, v), gn in zip(p.items(), g)}  # both extractor and header
            models[k] = p
            for s in range(3):
                rows = [i for i in range(n) if int(y[i]) == s]
                if rows:
                    reps = [project(p, x[i]) for i in rows]
                    lars.append(([sum(rep[j] for rep in reps) / len(rows) for j in range(4)], s))
        assert len(lars) < 6  # a client without class k mod 3 sends no LAR for it
        leaf = {n: v.clone().requires_grad_(True) for n, v in theta.items()}
        server_loss = sum(neg_log_softmax(classify(leaf, rep), s) for rep, s in lars) / len(lars)
        g = torch.autograd.grad(server_loss, list(leaf.values()))
        theta = {n: v - server_lr * gn for (n, v), gn in zip(theta.items(), g)}
        for k in range(3):
            models[k] = {n: models[k][n] for n in LOCAL} | theta
    for k in range(3):
        for n, v in eng.state.params.items():
            torch.testing.assert_close(v[0, k].double(), models[k][n], atol=1e-5, rtol=1e-5, msg=f"client {k} {n}")
    for n in HEADER:
        torch.testing.assert_close(eng.state.server[n][0].double(), theta[n], atol=1e-5, rtol=1e-5)
    for k in range(3):  # each client predicts with its own extractor under the global header
        n = int(test.counts[k])
        params = {name: v[0, k] for name, v in eng.state.params.items()}
        scores = eng.algo.predict(params, {}, test.features[k, :n], {})
        for i in range(n):
            logits = classify(models[k], project(models[k], test.features[k, i].double()))
            torch.testing.assert_close(scores[i].double(), torch.stack(logits), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(eng.state.params["proj0.weight"][0, 0], eng.state.params["proj0.weight"][0, 1])


def test_only_prototypes_travel_and_the_header_is_every_clients():
    train, test = synthetic_clients(seed=0), synthetic_clients(seed=1)
    algo = create("fedgh")
    eng = Engine(algo, [configure(algo, proj_dim=8, rounds=2, bn=True, participation=0.5)], train, test)
    out = eng.run(logs=False)
    assert set(eng.algo.upload(eng.state, eng.last_round)) == {"protos", "counts"}
    assert out["upload_floats"][0] == train.num_classes * (8 + 1)
    for k, v in (eng.state.params | eng.state.buffers).items():  # BN (with the extractor) stays local
        assert torch.equal(v, v[:, :1].expand_as(v)) == (k in HEADER), k
    assert eng.algo.global_model(eng.state, eng.last_round) is None


def test_engine_equals_the_plain_loop():
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults); several server steps
    and passes."""
    assert_matches_plain_loop("fedgh", rounds=2, server_lr=0.5, server_epochs=2, batch_size=8)


# -- the release ----------------------------------------------------------------------------------------------------
C, B, ROUNDS, EPOCHS, LR, SERVER_LR, SERVER_EPOCHS, RATE = 6, 8, 4, 2, 0.05, 0.3, 2, 0.5


def release_runs():
    """(per-round state of fedgh, its result, the data, the selected clients of ROUNDS + 1 iterations, x0)."""
    train = without_a_class(synthetic_clients(C=C, n=(20, 40), D=8, K=4, seed=0))
    test = synthetic_clients(C=C, n=(8, 16), D=8, K=4)
    algo = create("fedgh")
    cfg = configure(
        algo,
        proj_dim=8,
        rounds=ROUNDS,
        batch_size=B,
        participation=RATE,
        local_epochs=EPOCHS,
        server_lr=SERVER_LR,
        server_epochs=SERVER_EPOCHS,
    ) | {"optimizer": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0, "drop_last": True}
    eng = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in eng.state.params.items()}
    per_round = []
    record = lambda *_: per_round.append({k: v[0].clone() for k, v in eng.state.params.items()})
    out = eng.run(progress=record, logs=False)
    seeds = torch.tensor([0])
    selected = [[c for c in range(C) if participation(seeds, i, C, RATE)[0, c]] for i in range(ROUNDS + 1)]
    return per_round, out, (train, test), selected, x0


def run_release(x0, selected, data, pflib_head: bool = False):
    train, test = data
    seeds, K = torch.tensor([0]), train.num_classes

    batches = release_batches(train, B, drop_last=True)

    def proto_rows(i: int, c: int):  # featcache's LARs: every training row (see fedgh.py)
        n = int(train.counts[c])
        return [(train.features[c, :n], train.labels[c, :n])]

    def shuffle(i: int, epoch: int, keys: list) -> list[int]:
        """featcache's order of the server's pass (server_order), as a permutation of the release's upload list."""
        valid = torch.zeros(1, C * K, dtype=torch.bool)
        valid[0, [c * K + k for c, k in keys]] = True
        order = server_order(seeds, i, epoch, valid)[0, : len(keys)].tolist()
        return [keys.index((m // K, m % K)) for m in order]

    rows = lambda c: (test.features[c, : int(test.counts[c])], test.labels[c, : int(test.counts[c])])
    return ref_fedgh.fedgh(
        x0, C, selected, batches, proto_rows, rows, shuffle, EPOCHS, LR, B, SERVER_LR, SERVER_EPOCHS, pflib_head
    )


def largest_difference(per_round, out, ref) -> float:
    """The largest difference from the release over every round: the server's header, and each client's test
    accuracy (evaluated in the release after the next iteration's send_parameters)."""
    heads, _, evaluations = ref
    worst = 0.0
    for r, params in enumerate(per_round):
        worst = max(worst, *(float((params[k][0] - heads[r][k]).abs().max()) for k in HEADER))
        acc = torch.tensor([correct / rows for correct, rows in evaluations[r + 1]])
        worst = max(worst, float((out["acc"][r, 0] - acc).abs().max()))
    return worst


@pytest.fixture(scope="module")
def release():
    return release_runs()


def test_fedgh_is_the_release_at_partial_participation(release):
    per_round, out, data, selected, x0 = release
    assert any(c not in selected[0] for c in selected[1])  # a client trains for the first time after iteration 0
    heads, models, _ = ref = run_release(x0, selected, data)
    assert largest_difference(per_round, out, ref) < 2e-6
    assert float((heads[-1]["cls0.weight"] - x0["cls0.weight"]).abs().max()) > 1e-2  # the server's passes moved θ
    for c in range(C):  # the extractors after the last round (the release's iteration ROUNDS − 1)
        for k in LOCAL:
            torch.testing.assert_close(per_round[-1][k][c], models[ROUNDS - 1][c][k], atol=2e-6, rtol=0)


def test_pflibs_server_header_fails_the_same_comparison(release):
    """The control: PFLlib's server header, client 0's own (its local training moves it whenever it takes part)."""
    per_round, out, data, selected, x0 = release
    assert any(0 in s for s in selected[:ROUNDS])
    assert largest_difference(per_round, out, run_release(x0, selected, data, pflib_head=True)) > 1e-3
