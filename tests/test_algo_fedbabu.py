"""FedBABU: its rounds and its fine-tuning against the paper written out in float64 (explicit sums, gradient descent
on the body under the frozen initial head, the n_k-weighted mean of the bodies, τ_f epochs of SGD with momentum
before predicting), the vectorized engine against the plain per-client loop, and `fedbabu` against a transcription
of PFLlib's release (tests/ref_fedbabu.py) at partial participation, with a broken copy of the transcription that
fails the same comparison."""

from __future__ import annotations

import pytest
import torch
from conftest import client_model, configure

from featcache.algorithms import create
from featcache.algorithms.fedbabu import finetune_order
from featcache.testing import assert_matches_plain_loop
from featcache.training.engine import Engine
from featcache.training.schedule import batch_order, participation
from tests import ref_fedbabu
from tests.synthetic import synthetic_clients
from tests.test_algo_baselines import classify, neg_log_softmax, project

BODY, HEAD = ("proj0.weight", "proj0.bias"), ("cls0.weight", "cls0.bias")  # θ_b, θ_h


def task_loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(1/n) Σ_i −log softmax(h(f(x_i; θ_b); θ_h))_{y_i}, one sample at a time."""
    return sum(neg_log_softmax(classify(p, project(p, x[i])), int(y[i])) for i in range(len(y))) / len(y)


def gradient(p: dict, names, x, y) -> dict:
    leaf = {k: v.clone().requires_grad_(k in names) for k, v in p.items()}
    return dict(zip(names, torch.autograd.grad(task_loss(leaf, x, y), [leaf[k] for k in names])))


@pytest.mark.parametrize("finetune", ["full", "head"])
def test_rounds_and_fine_tuning_are_the_papers(finetune):
    """Two rounds, two of three clients each, two local epochs of full-batch gradient descent on θ_b with θ_h = θ_h^0;
    θ_b ← Σ_{k∈S} n_k/n_S θ_{b,k}; then each client's scores are those of (θ_b, θ_h^0) after τ_f full-batch steps of
    SGD with momentum (v ← β v + ∇, θ ← θ − η_f v) on its training rows, on the whole model or on the head alone."""
    train, test = synthetic_clients(C=3, n=(3, 6), D=3, K=3, seed=0), synthetic_clients(C=3, n=(2, 4), D=3, K=3)
    lr, epochs, rounds, rate, tau_f, lr_f, beta = 0.5, 2, 2, 0.67, 2, 0.3, 0.9
    algo = create("fedbabu")
    cfg = configure(
        algo,
        proj_dim=4,
        rounds=rounds,
        local_epochs=epochs,
        batch_size=8,
        drop_last=False,
        participation=rate,
        finetune_epochs=tau_f,
        finetune_lr=lr_f,
        finetune_momentum=beta,
        finetune=finetune,
    ) | {"optimizer": "sgd", "lr": lr, "momentum": 0.0, "weight_decay": 0.0}
    eng = Engine(algo, [cfg], train, test)
    start = {k: v[0, 0].double().clone() for k, v in eng.state.params.items()}
    out = eng.run()
    body = {k: start[k] for k in BODY}
    for r in range(rounds):
        S = [k for k in range(3) if participation(torch.tensor([0]), r, 3, rate)[0, k]]
        assert len(S) == 2
        trained = {}
        for k in S:
            p = body | {h: start[h] for h in HEAD}  # the head: θ_h^0, always
            n = int(train.counts[k])
            for _ in range(epochs):
                g = gradient(p, BODY, train.features[k, :n].double(), train.labels[k, :n])
                p = p | {b: p[b] - lr * g[b] for b in BODY}
            trained[k] = p
        n_S = sum(int(train.counts[k]) for k in S)
        body = {b: sum(int(train.counts[k]) / n_S * trained[k][b] for k in S) for b in BODY}
    tuned_names = BODY + HEAD if finetune == "full" else HEAD
    for k in range(3):
        for name, v in eng.state.params.items():  # every client holds the averaged body and the initial head
            torch.testing.assert_close(v[0, k].double(), (start | body)[name], atol=1e-5, rtol=1e-5)
        p, velocity = body | {h: start[h] for h in HEAD}, {}
        n = int(train.counts[k])
        for _ in range(tau_f):
            g = gradient(p, tuned_names, train.features[k, :n].double(), train.labels[k, :n])
            velocity = {t: beta * velocity.get(t, 0) + g[t] for t in tuned_names}
            p = p | {t: p[t] - lr_f * velocity[t] for t in tuned_names}
        params, buffers, ctx = client_model(eng, k)
        m = int(test.counts[k])
        scores = eng.algo.predict(params, buffers, test.features[k, :m], ctx)
        expected = torch.stack([torch.stack(classify(p, project(p, test.features[k, i].double()))) for i in range(m)])
        torch.testing.assert_close(scores.double(), expected, atol=1e-5, rtol=1e-5)
        hits = (expected.argmax(-1) == test.labels[k, :m]).double().mean()
        assert out["acc"][-1, 0, k].item() == pytest.approx(hits.item(), abs=1e-6)
    untuned = eng.algo.predict_global(*client_model(eng, 0)[:2], test.features[0, :2], {})
    plain = torch.stack(
        [torch.stack(classify(start | body, project(start | body, test.features[0, i].double()))) for i in range(2)]
    )
    torch.testing.assert_close(untuned.double(), plain, atol=1e-5, rtol=1e-5)  # the global model: not fine-tuned


def test_the_head_is_never_trained_nor_sent_and_the_global_model_is_not_fine_tuned():
    train, test = synthetic_clients(seed=0), synthetic_clients(seed=1)
    algo = create("fedbabu")
    eng = Engine(algo, [configure(algo, proj_dim=8, rounds=2, participation=0.5, lr=1e-2)], train, test)
    head0 = {k: eng.state.params[k][0, 0].clone() for k in HEAD}
    out = eng.run()
    assert set(eng.algo.upload(eng.state, eng.last_round)) == set(BODY)
    assert out["upload_floats"][0] == sum(eng.state.params[k][0, 0].numel() for k in BODY)
    for k, v in eng.state.params.items():
        assert torch.equal(v, v[:, :1].expand_as(v)), k  # every client holds the same model after the download
    for k in HEAD:
        assert torch.equal(eng.state.params[k][0, 0], head0[k])
    assert out["global_acc"] is not None
    untuned = Engine(
        algo, [configure(algo, proj_dim=8, rounds=2, participation=0.5, lr=1e-2, finetune_epochs=0)], train, test
    ).run()
    torch.testing.assert_close(out["global_acc"], untuned["global_acc"])  # the global metric: no fine-tuning
    torch.testing.assert_close(
        untuned["global_acc"][-1, 0], (untuned["acc"][-1, 0] * test.counts).sum() / test.counts.sum()
    )
    assert not torch.equal(out["acc"], untuned["acc"])


@pytest.mark.parametrize("over", [{}, {"bn": True, "finetune": "head"}])
def test_engine_equals_the_plain_loop(over):
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults); fine-tuning included."""
    assert_matches_plain_loop("fedbabu", rounds=2, finetune_epochs=2, **over)


def test_fine_tuning_rates_batched_in_one_run_equal_each_run_alone():
    """A grid over the fine-tuning's batched settings: each configuration fine-tunes with its own."""
    train, test = synthetic_clients(C=3, n=(10, 20), seed=0), synthetic_clients(C=3, n=(10, 20), seed=1)
    base = configure("fedbabu", proj_dim=4, rounds=2, batch_size=8, lr=1e-2, participation=0.67, finetune_epochs=2)
    cfgs = [base, base | {"finetune_lr": 0.05, "finetune_momentum": 0.5, "seed": 1}]
    acc = Engine(create("fedbabu"), cfgs, train, test).run(logs=False)["acc"]  # [R, H, C]
    for h, cfg in enumerate(cfgs):
        torch.testing.assert_close(
            acc[:, h], Engine(create("fedbabu"), [cfg], train, test).run(logs=False)["acc"][:, 0]
        )


# -- the release ----------------------------------------------------------------------------------------------------
C, B, ROUNDS, EPOCHS, TAU_F, LR, RATE = 6, 16, 3, 1, 2, 0.05, 0.5


def release_runs():
    """(per-round bodies of fedbabu, its engine and result, the data, the selected clients of ROUNDS + 1
    iterations, the initial model)."""
    train, test = synthetic_clients(C=C, n=(32, 56), D=8, K=3, seed=0), synthetic_clients(C=C, n=(8, 16), D=8, K=3)
    algo = create("fedbabu")
    cfg = configure(
        algo,
        proj_dim=8,
        rounds=ROUNDS,
        batch_size=B,
        participation=RATE,
        local_epochs=EPOCHS,
        finetune_epochs=TAU_F,
        finetune_lr=LR,
        finetune_momentum=0.0,
    )
    cfg |= {"optimizer": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0, "drop_last": True}
    eng = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in eng.state.params.items()}
    per_round = []
    out = eng.run(progress=lambda *_: per_round.append({k: eng.state.params[k][0, 0].clone() for k in BODY}))
    seeds = torch.tensor([0])
    selected = [[c for c in range(C) if participation(seeds, i, C, RATE)[0, c]] for i in range(ROUNDS + 1)]
    return per_round, eng, out, (train, test), selected, x0


def run_release(x0, selected, data):
    train, test = data
    seeds, N = torch.tensor([0]), train.features.shape[1]

    def minibatches(order, c):
        n = int(train.counts[c]) // B * B  # the DataLoader's drop_last=True
        return [(train.features[c, order[s : s + B]], train.labels[c, order[s : s + B]]) for s in range(0, n, B)]

    batches = lambda i, c, epoch: minibatches(batch_order(seeds, i, epoch, train.counts, N)[0, c], c)
    # featcache's fine-tuning order of its last evaluation: round ROUNDS - 1, epochs after the local ones
    tuning = lambda c, epoch: minibatches(
        finetune_order(seeds, ROUNDS - 1, EPOCHS, TAU_F, train.counts, N)[0, c, epoch], c
    )
    sizes = [int(n) for n in train.counts]
    rows = lambda c: (test.features[c, : int(test.counts[c])], test.labels[c, : int(test.counts[c])])
    return ref_fedbabu.fedbabu(x0, selected, sizes, batches, tuning, rows, EPOCHS, TAU_F, LR)


def largest_difference(per_round, out, ref) -> float:
    """The largest difference from the release over every round: the server's body, and the accuracy of the model
    the clients receive (the release's evaluation after the next iteration's send_models, pooled over all test rows:
    featcache's global metric, the model before fine-tuning)."""
    bases, evaluations, *_ = ref
    worst = 0.0
    for r, body in enumerate(per_round):
        worst = max(worst, *(float((body[k] - bases[r][k]).abs().max()) for k in BODY))
        pooled = sum(c for c, _ in evaluations[r + 1]) / sum(n for _, n in evaluations[r + 1])
        worst = max(worst, abs(out["global_acc"][r, 0].item() - pooled))
    return worst


@pytest.fixture(scope="module")
def release():
    return release_runs()


def test_fedbabu_is_the_release_at_partial_participation(release):
    """Training and the evaluated global model round by round; then the release's closing fine-tuning of every client
    (fine_tune on base and head with the training SGD) against featcache's last evaluation: the same for a client that
    sat the release's last iteration out (it fine-tunes the final average, as featcache does), other for one that
    trained in it (it fine-tunes its own trained body: the docstring's deviation)."""
    per_round, eng, out, data, selected, x0 = release
    _, test = data
    assert any(c not in selected[0] for c in selected[1])  # a client trains for the first time after iteration 0
    ref = run_release(x0, selected, data)
    assert largest_difference(per_round, out, ref) < 2e-6
    _, _, before, tuned, final = ref
    ctx = eng.algo.context(eng.state, eng.last_round)
    for c in range(C):
        params, buffers, ctx_c = client_model(eng, c)
        ours, _ = eng.algo.fine_tune(params, buffers, ctx_c)
        if c in selected[ROUNDS]:
            assert any(not torch.allclose(before[c][k], params[k]) for k in BODY)
            continue
        for k in BODY + HEAD:
            torch.testing.assert_close(before[c][k], params[k], atol=2e-6, rtol=0)
            torch.testing.assert_close(ours[k], tuned[c][k], atol=2e-6, rtol=0)
        assert out["acc"][-1, 0, c].item() == pytest.approx(final[c][0] / final[c][1], abs=1e-6)
    assert ctx["finetune_order"].shape[2] == TAU_F
    assert any(c not in selected[ROUNDS] for c in range(C)) and selected[ROUNDS]


def test_a_broken_transcription_fails_the_same_comparison(release, monkeypatch):
    """The control: the release with the head trained along with the base in local training."""
    per_round, _, out, data, selected, x0 = release
    monkeypatch.setattr(ref_fedbabu, "requires_grad", lambda training: ref_fedbabu.BASE + ref_fedbabu.HEAD)
    assert largest_difference(per_round, out, run_release(x0, selected, data)) > 1e-3
