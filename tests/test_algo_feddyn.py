"""FedDyn (featcache/algorithms/feddyn.py): its regularizer and server against Alg. 1 of Acar et al. (ICLR 2021)
written out in float64, the engine against the plain per-client loop, and `feddyn-official` against a transcription
of PFLlib's released code (tests/ref_feddyn.py) over several rounds at partial participation, with a broken copy
that fails the same comparison."""

from __future__ import annotations

import pytest
import torch
from conftest import configure
from harness import release_batches

from featcache.algorithms import create
from featcache.testing import assert_matches_plain_loop, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_feddyn
from tests.synthetic import write_cache
from tests.test_algo_personal import assert_batched_equals_alone
from tests.test_resume import assert_resumes_exactly, ctrl_c_reaches_python  # noqa: F401  (autouse: SIGINT reaches Python)

C, B, ROUNDS = 6, 16, 5


def tiny(H: int, C: int, seed: int, dtype=torch.float64) -> dict:
    """Random head parameters name -> [H, C, ...]."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"proj0.weight": (3, 4), "proj0.bias": (3,), "cls0.weight": (2, 3), "cls0.bias": (2,)}
    return {k: torch.randn(H, C, *s, generator=g, dtype=dtype) for k, s in shapes.items()}


def test_penalty_is_the_dynamic_regularizer():
    """−⟨∇L_k(θ_k^{t−1}), θ⟩ + α/2 ||θ − θ^{t−1}||² per model, written as explicit sums, and its autograd gradient."""
    algo = create("feddyn")
    theta, anchor, lin = tiny(2, 3, 0), tiny(2, 1, 1), tiny(2, 3, 2)
    alpha = torch.tensor([[0.1] * 3, [0.7] * 3], dtype=torch.float64)  # [H, C]
    ctx = {"hp": {"alpha": alpha}, "global": {k: v.expand_as(theta[k]) for k, v in anchor.items()}, "grad": lin}
    value, grads = algo.penalty({k: v.clone() for k, v in theta.items()}, ctx)
    for h in range(2):
        for c in range(3):
            th = {k: v[h, c].clone().requires_grad_(True) for k, v in theta.items()}
            lin_term = sum(float((lin[k][h, c] * theta[k][h, c]).sum()) for k in th)
            quad = sum(((th[k] - anchor[k][h, 0]) ** 2).sum() for k in th)
            r = -sum((lin[k][h, c] * th[k]).sum() for k in th) + alpha[h, c] / 2 * quad
            want = -lin_term + alpha[h, c].item() / 2 * quad.detach().item()
            assert value[h, c].item() == pytest.approx(want, rel=1e-12)
            auto = torch.autograd.grad(r, list(th.values()))
            for k, g in zip(th, auto):
                torch.testing.assert_close(grads[k][h, c], g, rtol=1e-12, atol=1e-12)


def test_official_penalty_is_pflibs_unsquared_norm():
    algo = create("feddyn-official")
    theta, anchor, lin = tiny(1, 2, 3), tiny(1, 1, 4), tiny(1, 2, 5)
    alpha = torch.full((1, 2), 0.3, dtype=torch.float64)
    ctx = {"hp": {"alpha": alpha}, "global": {k: v.expand_as(theta[k]) for k, v in anchor.items()}, "grad": lin}
    value, grads = algo.penalty({k: v.clone() for k, v in theta.items()}, ctx)
    for c in range(2):
        th = {k: v[0, c].clone().requires_grad_(True) for k, v in theta.items()}
        v1 = torch.cat([p.view(-1) for p in th.values()])
        gmv = torch.cat([p[0, 0].view(-1) for p in anchor.values()])
        old = torch.cat([p[0, c].view(-1) for p in lin.values()])
        r = 0.3 / 2 * torch.norm(v1 - gmv, 2) - torch.dot(v1, old)
        assert value[0, c].item() == pytest.approx(r.item(), rel=1e-12)
        for k, g in zip(th, torch.autograd.grad(r, list(th.values()))):
            torch.testing.assert_close(grads[k][0, c], g, rtol=1e-12, atol=1e-12)
    same = {k: v.expand_as(theta[k]).clone() for k, v in anchor.items()}  # θ = θ^{t−1}: the norm's gradient is 0
    _, grads = algo.penalty(same, ctx | {"grad": {k: torch.zeros_like(v) for k, v in lin.items()}})
    assert all(bool((g == 0).all()) for g in grads.values())


def test_client_and_server_updates_are_alg1():
    """Line 6 for the participants only, lines 9–10 over the participants (uniform mean, α/m), h kept, two
    configurations with their own α, in float64."""
    train, test = synthetic_clients(C=4, n=(10, 20), D=4, K=2), synthetic_clients(C=4, n=(5, 8), D=4, K=2, seed=1)
    algo = create("feddyn")
    cfgs = [configure(algo, proj_dim=3, alpha=a, seed=s) for a, s in ((0.125, 0), (0.5, 1))]
    eng = Engine(algo, cfgs, train, test)
    state = eng.state
    state.params = {k: v.double() for k, v in state.params.items()}
    state.server["global"] = {k: v.double() for k, v in state.server["global"].items()}
    x0 = {k: v.clone() for k, v in state.server["global"].items()}  # θ^{t−1} [H, ...]
    h0 = {k: torch.randn(v.shape, dtype=torch.float64) for k, v in x0.items()}
    g0 = {k: torch.randn(v.shape, dtype=torch.float64) for k, v in state.params.items()}
    state.server["h"], state.client["grad"] = dict(h0), dict(g0)
    state.params = {k: torch.randn(v.shape, dtype=torch.float64) for k, v in state.params.items()}  # θ_k^t
    trained = {k: v.clone() for k, v in state.params.items()}
    part = [[True, False, True, False], [False, True, False, False]]  # 1/|P_t| exact in float32
    now = eng.round_context(0, part)
    algo = eng.algo
    algo.after_local(state, now)
    algo.download(state, algo.aggregate(algo.upload(state, now), eng.train.counts[None] * now.part, state, now), now)
    m = 4
    for h, alpha in enumerate((0.125, 0.5)):
        P = [c for c in range(m) if part[h][c]]
        for k in x0:
            for c in range(m):
                want = g0[k][h, c] - alpha * (trained[k][h, c] - x0[k][h]) if c in P else g0[k][h, c]
                torch.testing.assert_close(state.client["grad"][k][h, c], want, rtol=1e-12, atol=1e-12)
            h_t = h0[k][h] - alpha / m * sum(trained[k][h, c] - x0[k][h] for c in P)
            theta = sum(trained[k][h, c] for c in P) / len(P) - h_t / alpha
            torch.testing.assert_close(state.server["h"][k][h], h_t, rtol=1e-12, atol=1e-12)
            for c in range(m):  # every client downloads θ^t, which becomes the next θ^{t−1}
                torch.testing.assert_close(state.params[k][h, c], theta, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(state.server["global"][k][h], theta, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["feddyn", "feddyn-official"])
def test_engine_equals_the_plain_loop(name):
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults); Adam, and SGD with BN."""
    assert_matches_plain_loop(name)
    if name == "feddyn":
        assert_matches_plain_loop(name, optimizer="sgd", momentum=0.0, alpha=0.1, bn=True, rounds=2)


def release_runs(name: str, rate: float, ref=ref_feddyn.feddyn):
    """(featcache's global model after each round, the transcription's) on the same data, parties and minibatches."""
    train, test = synthetic_clients(C=C, n=(32, 56), D=8, K=3, seed=0), synthetic_clients(C=C, n=(8, 16), D=8, K=3)
    algo = create(name)
    cfg = configure(
        algo, proj_dim=8, rounds=ROUNDS, batch_size=B, participation=rate, optimizer="sgd", momentum=0.0,
        weight_decay=0.0, lr=0.05, alpha=0.1,
    )  # fmt: skip
    engine = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in engine.state.params.items()}
    ours = []
    for r in range(ROUNDS):
        engine.run(until=r + 1)
        ours.append({k: v[0, 0].clone() for k, v in engine.state.params.items()})
    seeds = torch.tensor([0])
    parties = [[c for c in range(C) if participation(seeds, r, C, rate)[0, c]] for r in range(ROUNDS)]
    assert len(set(map(tuple, parties))) > 1 and all(len(p) < C for p in parties)

    batches = release_batches(train, B, drop_last=True)

    theirs, _ = ref(x0, parties, batches, 1, cfg["lr"], cfg["alpha"])
    return ours, theirs


def largest_difference(ours, theirs) -> float:
    return max(float((a[k] - b[k]).abs().max()) for a, b in zip(ours, theirs) for k in a)


def test_feddyn_official_is_pflibs_release_at_partial_participation():
    ours, theirs = release_runs("feddyn-official", 0.5)
    assert largest_difference(ours, theirs) < 2e-6


def broken_feddyn(model, selected_rounds, batches, local_epochs, lr, alpha):
    """The transcription with a linear term that forgets half of itself after each round's training."""
    saved = ref_feddyn.ClientDyn.train

    def train(self, batches, local_epochs):
        saved(self, batches, local_epochs)
        self.old_grad = self.old_grad * 0.5

    ref_feddyn.ClientDyn.train = train
    try:
        return ref_feddyn.feddyn(model, selected_rounds, batches, local_epochs, lr, alpha)
    finally:
        ref_feddyn.ClientDyn.train = saved


def test_a_broken_transcription_and_the_papers_square_fail_the_comparison():
    ours, theirs = release_runs("feddyn-official", 0.5, ref=broken_feddyn)
    assert largest_difference(ours, theirs) > 1e-4
    ours, theirs = release_runs("feddyn", 0.5)  # the paper's α/2 ||θ − θ^{t−1}||²
    assert largest_difference(ours, theirs) > 1e-4


def test_batched_alpha_equals_single_runs():
    """α reaches the loss and the server per configuration (a grid batches it)."""
    assert_batched_equals_alone("feddyn", {"alpha": 0.1}, rounds=2)


def test_resumes_byte_for_byte(tmp_path):
    """A run killed after round 2 and resumed ends as the uninterrupted one (the linear terms and h are in the
    checkpoint)."""
    cache = write_cache(tmp_path / "c.h5", C=4, D=16, K=3, n=(16, 40), spread=4.0)
    opts = {"participation": 0.5, "batch_size": 8, "proj_dim": 8}
    assert_resumes_exactly(
        cache, "feddyn", [(2, "kill")], 1, rounds=3, seeds=[0, 1], set=[f"{k}={v}" for k, v in opts.items()]
    )
