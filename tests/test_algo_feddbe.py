"""FedDBE: the local loss (PRBM added to z, MR on the running mean) against the equations written out with explicit
sums in float64, the initialization period (round 1) on the engine, the vectorized engine against the plain
per-client loop, and `feddbe` against a transcription of PFLlib's release (tests/ref_feddbe.py) over several rounds at
partial participation, with broken transcriptions that fail the same comparison."""

from __future__ import annotations

import pytest
import torch
from conftest import configure
from harness import release_batches
from torch.func import grad

from featcache.algorithms import create
from featcache.algorithms.feddbe import MEAN, PRBM
from featcache.testing import assert_matches_plain_loop, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_feddbe
from tests.test_algo_baselines import classify, neg_log_softmax, project

D, P, K = 3, 4, 4  # the tiny hand-checked head: input features, projection width, classes


def tiny(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"proj0.weight": (P, D), "proj0.bias": (P,), "cls0.weight": (K, P), "cls0.bias": (K,), PRBM: (P,)}
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def written_out(p: dict, prev: list, g: list, x, y, mask, kappa: float, mu: float, dbe: bool):
    """(loss, new running mean): (1/|B|) Σ_n −log softmax(V (z_n + z̄ᵖ) + c)_{y_n} + κ (1/d) Σ_j ½ (r_j − z̄ᵍ_j)²,
    r_j = (1 − μ) prev_j + μ (1/|B|) Σ_n z_nj; without DBE (the initialization period) the CE of V z_n + c alone."""
    rows = [n for n in range(len(y)) if mask[n]]
    zs = {n: project(p, x[n]) for n in rows}
    r = [(1 - mu) * prev[j] + mu * sum(zs[n][j] for n in rows) / len(rows) for j in range(P)]
    ce = 0.0
    for n in rows:
        z = [zs[n][j] + (p[PRBM][j] if dbe else 0.0) for j in range(P)]
        ce = ce + neg_log_softmax(classify(p, z), int(y[n]))
    loss = ce / len(rows)
    if dbe:
        loss = loss + kappa * sum(0.5 * (r[j] - g[j]) ** 2 for j in range(P)) / P
    return loss, torch.stack([torch.as_tensor(v) for v in r])


def test_feddbe_loss_gradient_and_running_mean_are_the_equations():
    algo = create("feddbe", configure("feddbe", proj_dim=P))
    params = tiny(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, D, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 3, 1, 2, 3, -1])  # the last row is padding
    mask = y >= 0
    prev, g = torch.randn(P, generator=gen, dtype=torch.float64), torch.randn(P, generator=gen, dtype=torch.float64)
    for kappa, mu, dbe in ((50.0, 1.0, True), (2.5, 0.3, True), (2.5, 0.3, False)):
        f64 = lambda v: torch.tensor(v, dtype=torch.float64)
        ctx = {"hp": {"kappa": f64(kappa), "mu": f64(mu)}, "global_mean": g, "dbe": f64(float(dbe))}
        loss = lambda p: algo.local_loss(p, {MEAN: prev}, x, y, mask, ctx)[0]
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        expected, running = written_out(leaves, prev.tolist(), g.tolist(), x, y, mask, kappa, mu, dbe)
        expected.backward()
        value, buffers = algo.local_loss(params, {MEAN: prev}, x, y, mask, ctx)
        assert abs(float(value) - float(expected.detach())) < 1e-12
        torch.testing.assert_close(buffers[MEAN], running.detach(), rtol=0, atol=1e-12)
        assert not buffers[MEAN].requires_grad
        for k, v in grad(loss)(params).items():  # (PRBM takes no part in the initialization period: no gradient)
            expected_grad = torch.zeros_like(v) if leaves[k].grad is None else leaves[k].grad
            torch.testing.assert_close(v, expected_grad, rtol=1e-10, atol=1e-12)
    scores = algo.predict(params, {}, x[:2], {})  # each client predicts with head(z + z̄ᵖ)
    for n in range(2):
        z = [v + params[PRBM][j] for j, v in enumerate(project(params, x[n]))]
        torch.testing.assert_close(scores[n], torch.stack(classify(params, z)), rtol=0, atol=1e-12)


def test_round_one_is_the_initialization_period():
    """Round 1 trains without DBE and ends with every client back at the initial model, the PRBMs still 0, the
    running means reset and z̄ᵍ the n_k-weighted mean of the participants' running means (nonzero); round 2 trains
    with DBE and moves the PRBM of its participants only."""
    train, test = synthetic_clients(C=4, seed=0), synthetic_clients(C=4, seed=1)
    algo = create("feddbe")
    eng = Engine(algo, [configure(algo, proj_dim=8, rounds=2, participation=0.5, lr=0.05)], train, test)
    start = {k: v[:, 0].clone() for k, v in eng.state.params.items()}
    eng.run(until=1)
    for k, v in eng.state.params.items():
        assert torch.equal(v, start[k][:, None].expand_as(v)), k
    assert float(eng.state.server["dbe"][0]) == 1.0 and float(eng.state.server["global_mean"].abs().sum()) > 0
    assert float(eng.state.buffers[MEAN].abs().sum()) == 0.0
    assert eng.loop.upload_floats[0] == 8  # the running mean alone
    eng.run()
    moved = eng.state.params[PRBM][0].abs().sum(-1) > 0  # [C]
    assert moved.tolist() == participation(eng.seeds, 1, 4, 0.5)[0].tolist()


def test_feddbe_equals_the_plain_loop():
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults), μ < 1."""
    assert_matches_plain_loop("feddbe", rounds=3, mu=0.5, kappa=5.0)


# -- the release ----------------------------------------------------------------------------------------------------
C, B, ROUNDS, EPOCHS, LR, RATE, KAPPA, MU = 6, 8, 4, 2, 0.1, 0.5, 5.0, 0.5


@pytest.fixture(scope="module")
def release():
    """featcache's global model after each round, its result, its clients' PRBMs, and what the transcription takes."""
    train, test = synthetic_clients(C=C, n=(16, 44), D=8, K=4, seed=0), synthetic_clients(C=C, n=(8, 12), D=8, K=4)
    algo = create("feddbe")
    cfg = configure(algo, proj_dim=8, rounds=ROUNDS, batch_size=B, participation=RATE, local_epochs=EPOCHS)
    cfg |= {"optimizer": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0, "kappa": KAPPA, "mu": MU}
    eng = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in eng.state.params.items() if k != PRBM}
    per_round = []
    out = eng.run(progress=lambda *_: per_round.append({k: v[0].clone() for k, v in eng.state.params.items()}))
    seeds = torch.tensor([0])
    stages = [[c for c in range(C) if participation(seeds, r, C, RATE)[0, c]] for r in range(ROUNDS + 1)]
    return per_round, out, (train, test), stages, x0


def run_release(x0, stages, data):
    """The release with its initialization period on featcache's round-1 participants and iteration i on round i + 2's
    (ROUNDS iterations: the evaluation of the last one scores what featcache's last round ends with)."""
    train, test = data

    batches = release_batches(train, B, drop_last=True)

    sizes = [int(n) for n in train.counts]
    rows = lambda c: (test.features[c, : int(test.counts[c])], test.labels[c, : int(test.counts[c])])
    return ref_feddbe.feddbe(x0, stages[0], stages[1:], sizes, batches, rows, EPOCHS, LR, KAPPA, MU)


def largest_difference(per_round, out, ref) -> float:
    """Over every round: the global model (featcache's round r + 1 is the release's iteration r), each client's test
    accuracy (featcache's evaluation after round r is the release's at the start of iteration r)."""
    models, _, evaluations, _ = ref
    worst = 0.0
    for r in range(ROUNDS):
        acc = torch.tensor([correct / n for correct, n in evaluations[r]])
        worst = max(worst, float((out["acc"][r, 0] - acc).abs().max()))
        if r >= 1:
            worst = max(worst, *(float((per_round[r][k][0] - v).abs().max()) for k, v in models[r - 1].items()))
    return worst


def prbm_difference(per_round, x0, stages, data) -> float:
    _, clients, _, _ = run_release(x0, stages[:ROUNDS], data)  # ROUNDS - 1 iterations: featcache's last PRBMs
    return float((per_round[-1][PRBM] - torch.stack([c.client_mean.detach() for c in clients])).abs().max())


def test_feddbe_is_pflibs_release_at_partial_participation(release):
    per_round, out, data, stages, x0 = release
    assert any(c not in stages[0] for c in stages[1])  # a client trains for the first time after the initialization
    ref = run_release(x0, stages, data)
    assert largest_difference(per_round, out, ref) < 2e-6
    assert prbm_difference(per_round, x0, stages, data) < 2e-6
    assert float(per_round[-1][PRBM].abs().max()) > 1e-3  # the PRBMs moved
    assert float((ref[0][-1]["cls0.weight"] - x0["cls0.weight"]).abs().max()) > 1e-2  # so did the model


def test_broken_transcriptions_fail_the_same_comparison(release, monkeypatch):
    """Controls: MR without the ½; the running mean carried over from the last round (no reset_running_stats)."""
    per_round, out, data, stages, x0 = release
    monkeypatch.setattr(ref_feddbe, "reg_loss_of", lambda r, g: torch.mean((r - g) ** 2))
    assert largest_difference(per_round, out, run_release(x0, stages, data)) > 1e-4
    monkeypatch.undo()
    monkeypatch.setattr(ref_feddbe.ClientDBE, "reset_running_stats", lambda self: None)
    assert largest_difference(per_round, out, run_release(x0, stages, data)) > 1e-4
