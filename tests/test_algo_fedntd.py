"""FedNTD: the local loss against the paper's eq. 5–6 written out with explicit sums (float64), the vectorized engine
against the plain per-client loop, and `fedntd-official` against a transcription of PFLlib's release
(tests/ref_fedntd.py) over several rounds at partial participation, with a broken transcription that fails."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import configure
from harness import release_batches
from torch.func import grad

from featcache.algorithms import create
from featcache.testing import assert_matches_plain_loop, assert_reduces_to, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_fedntd

D, P, K = 3, 4, 4  # the tiny hand-checked head: input features, projection width, classes


def tiny(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"proj0.weight": (P, D), "proj0.bias": (P,), "cls0.weight": (K, P), "cls0.bias": (K,)}
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def logits_of(p: dict, xn: torch.Tensor) -> list:
    """l_k = Σ_j V_kj ReLU(Σ_i W_ji x_i + b_j) + c_k, one sample."""
    W, b, V, c = p["proj0.weight"], p["proj0.bias"], p["cls0.weight"], p["cls0.bias"]
    z = [torch.relu(sum(W[j, i] * xn[i] for i in range(D)) + b[j]) for j in range(P)]
    return [sum(V[k, j] * z[j] for j in range(P)) + c[k] for k in range(K)]


def paper_loss(params: dict, glob: dict, x, y, mask, beta: float, tau: float) -> torch.Tensor:
    """Eq. 6, ℓ_CE(q, y) + β ℓ_NTD, with eq. 5's not-true softmaxes q̃_τ(c) = e^{z_c/τ} / Σ_{c'≠y} e^{z_c'/τ} and
    ℓ_NTD = Σ_{c≠y} q̃^g_τ(c) log(q̃^g_τ(c) / q̃_τ(c)), τ²-scaled (the released criterion), averaged over rows."""
    rows = [n for n in range(len(y)) if mask[n]]
    ce, ntd = 0.0, 0.0
    for n in rows:
        yn = int(y[n])
        z, zg = logits_of(params, x[n]), logits_of(glob, x[n])
        ce = ce - torch.log(torch.exp(z[yn]) / sum(torch.exp(z[c]) for c in range(K)))
        others = [c for c in range(K) if c != yn]
        den = sum(torch.exp(z[c] / tau) for c in others)
        den_g = sum(torch.exp(zg[c].detach() / tau) for c in others)
        for c in others:
            q, qg = torch.exp(z[c] / tau) / den, torch.exp(zg[c].detach() / tau) / den_g
            ntd = ntd + tau**2 * qg * torch.log(qg / q)
    return (ce + beta * ntd) / len(rows)


def test_fedntd_loss_and_gradient_are_eq5_eq6():
    algo = create("fedntd", configure("fedntd", proj_dim=P))
    params, glob = tiny(0), tiny(1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, D, generator=g, dtype=torch.float64)  # [N, D]
    y = torch.tensor([0, 3, 1, 2, 3, -1])  # the last row is padding
    mask = y >= 0
    for beta, tau in ((1.0, 1.0), (0.7, 2.5)):
        hp = {"beta": torch.tensor(beta, dtype=torch.float64), "tau": torch.tensor(tau, dtype=torch.float64)}
        ctx = {"hp": hp, "global": glob, "global_buffers": {}}
        loss = lambda p: algo.local_loss(p, {}, x, y, mask, ctx)[0]
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        expected = paper_loss(leaves, glob, x, y, mask, beta, tau)
        expected.backward()
        assert abs(float(loss(params)) - float(expected.detach())) < 1e-12
        for k, v in grad(loss)(params).items():  # the global model's logits are constants of the loss
            torch.testing.assert_close(v, leaves[k].grad, rtol=1e-10, atol=1e-12)
    ctx = {"hp": {"beta": torch.tensor(1.0), "tau": torch.tensor(1.0)}, "global": params, "global_buffers": {}}
    ce = algo.local_loss(params, {}, x, y, mask, ctx)[0]  # w = w^t: ℓ_NTD = 0
    assert abs(float(ce) - float(paper_loss(params, params, x, y, mask, 0.0, 1.0))) < 1e-12


@pytest.mark.parametrize("name", ["fedntd", "fedntd-official"])
def test_fedntd_equals_the_plain_loop(name):
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults), τ ≠ 1."""
    assert_matches_plain_loop(name, rounds=2, tau=2.0)


def test_fedntd_without_distillation_is_fedavg():
    assert_reduces_to("fedntd", "fedavg", rounds=2, beta=0.0)


C, B, ROUNDS, RATE = 6, 8, 4, 0.5

TRAINED: dict = {}  # algorithm -> its global model after the release comparison's rounds


def release_runs(name: str, broken: bool = False):
    """(featcache's global model after each round, the transcription's) on uneven clients at participation 0.5,
    SGD as PFLlib's clients run it, τ = 2 and β = 1.5."""
    train, test = synthetic_clients(C=C, n=(16, 44), D=8, K=4, seed=0), synthetic_clients(C=C, n=(8, 12), D=8, K=4)
    algo = create(name)
    cfg = configure(
        algo,
        proj_dim=8,
        rounds=ROUNDS,
        batch_size=B,
        participation=RATE,
        optimizer="sgd",
        momentum=0.0,
        weight_decay=0.0,
        lr=0.1,
        beta=1.5,
        tau=2.0,
    )
    engine = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in engine.state.params.items()}
    seeds = torch.tensor([0])
    selected = [[c for c in range(C) if participation(seeds, r, C, RATE)[0, c]] for r in range(ROUNDS)]

    batches = release_batches(train, B, drop_last=True)

    if name not in TRAINED:  # one engine run per algorithm for the file's comparisons
        engine.run(logs=False)
        TRAINED[name] = {k: v[0, 0] for k, v in engine.state.params.items()}
    ours = TRAINED[name]
    saved = ref_fedntd.ntd_loss
    if broken:  # the KL over every class, the true one included: a plain KD loss, not FedNTD's
        ref_fedntd.ntd_loss = lambda lg, dg, t, k, tau: (
            tau**2
            * torch.nn.functional.kl_div(
                torch.log_softmax(lg / tau, 1), torch.softmax(dg.detach() / tau, 1), reduction="batchmean"
            )
        )
    try:
        ref = ref_fedntd.fedntd(x0, selected, batches, 1, cfg["lr"], cfg["beta"], cfg["tau"], train.num_classes)
    finally:
        ref_fedntd.ntd_loss = saved
    return ours, ref, selected


def largest_difference(ours: dict, ref: dict) -> float:
    return max(float((v - ref[k]).abs().max()) for k, v in ours.items())


def test_fedntd_official_is_pflibs_release_at_partial_participation():
    ours, ref, selected = release_runs("fedntd-official")
    assert all(len(s) < C for s in selected) and len({tuple(s) for s in selected}) > 1
    assert largest_difference(ours, ref[-1]) < 2e-6
    assert largest_difference(ref[0], ref[-1]) > 1e-2  # the rounds moved the model


def test_a_broken_transcription_and_size_weighting_fail_the_comparison():
    ours, ref, _ = release_runs("fedntd-official", broken=True)
    assert largest_difference(ours, ref[-1]) > 1e-4
    ours, ref, _ = release_runs("fedntd")  # the paper's n_k-weighted server mean: PFLlib's is uniform
    assert largest_difference(ours, ref[-1]) > 1e-4
    assert not math.isnan(largest_difference(ours, ref[-1]))
