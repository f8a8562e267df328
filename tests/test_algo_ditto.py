"""Ditto (featcache/algorithms/ditto.py): its local objective against eq. 2 and Alg. 1 of Li et al. (ICML 2021)
written out in float64, the engine against the plain per-client loop, and featcache against a transcription of
PFLlib's released code (tests/ref_ditto.py) over several rounds at partial participation, with a broken copy that
fails the same comparison."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import configure
from harness import release_batches

from featcache.algorithms import create
from featcache.algorithms.ditto import PERS
from featcache.testing import assert_matches_plain_loop, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_ditto
from tests.synthetic import write_cache
from tests.test_algo_personal import assert_batched_equals_alone
from tests.test_resume import assert_resumes_exactly, ctrl_c_reaches_python  # noqa: F401  (autouse: SIGINT reaches Python)

C, B, ROUNDS = 6, 16, 4


def head(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"proj0.weight": (3, 4), "proj0.bias": (3,), "cls0.weight": (2, 3), "cls0.bias": (2,)}
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"]) @ net["cls0.weight"].T + net["cls0.bias"]


def test_loss_and_gradient_are_eq2_beside_fedavgs():
    """F_k(w) + F_k(v) + λ/2 ||v − w^t||² on one minibatch (padding rows ignored), its gradient in w and in v
    (Alg. 1's v ← v − η (∇F_k(v) + λ (v − w^t))), both per model in float64."""
    algo = create("ditto")
    algo = algo.bind(configure(algo))
    w, v, anchor = head(0), head(1), head(2)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y, mask = torch.tensor([0, 1, 1, 0, 1]), torch.tensor([True, True, True, True, False])
    lam = 0.75
    params = {k: t.clone().requires_grad_(True) for k, t in w.items()} | {
        PERS + k: t.clone().requires_grad_(True) for k, t in v.items()
    }
    one = torch.ones((), dtype=torch.float64)
    ctx = {"hp": {"lam": torch.tensor(lam, dtype=torch.float64)}, "train_w": one, "train_v": one}
    loss, _ = algo.local_loss(params, {}, x, y, mask, ctx)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    stack = lambda d: {k: t[None, None] for k, t in d.items()}  # the penalty's [H, C] stacks
    term = algo.penalty(stack({k: t.detach() for k, t in params.items()}), {
        "hp": {"lam": torch.full((1, 1), lam, dtype=torch.float64)},
        "train_v": torch.ones(1, 1, dtype=torch.float64),
        "global": stack(anchor | {PERS + k: t for k, t in anchor.items()}),
    })  # fmt: skip
    value, extra = term
    F_w = F.cross_entropy(forward(w, x[:4]), y[:4])
    F_v = F.cross_entropy(forward(v, x[:4]), y[:4])
    prox = lam / 2 * sum(((v[k] - anchor[k]) ** 2).sum() for k in v)
    assert loss.item() + value.item() == pytest.approx((F_w + F_v + prox).item(), rel=1e-12)
    wl = {k: t.clone().requires_grad_(True) for k, t in w.items()}
    for k, g in zip(wl, torch.autograd.grad(F.cross_entropy(forward(wl, x[:4]), y[:4]), list(wl.values()))):
        torch.testing.assert_close(grads[k], g, rtol=1e-12, atol=1e-12)
        assert k not in extra  # no proximal term on w: FedAvg's local objective
    vl = {k: t.clone().requires_grad_(True) for k, t in v.items()}
    for k, g in zip(vl, torch.autograd.grad(F.cross_entropy(forward(vl, x[:4]), y[:4]), list(vl.values()))):
        torch.testing.assert_close(grads[PERS + k] + extra[PERS + k][0, 0], g + lam * (v[k] - anchor[k]))


def test_one_round_of_sgd_is_alg1():
    """With plain SGD and one full-batch step per client: w_k = w^t − η ∇F_k(w^t), v_k = v_k − η (∇F_k(v_k) +
    λ (v_k − w^t)) with v_k^0 = w^0, the server's w^{t+1} the n_k-weighted mean of the participants' w_k; absent
    clients keep v_k; clients predict with v_k, the global model is w."""
    train, test = synthetic_clients(C=3, n=(8, 12), D=4, K=2), synthetic_clients(C=3, n=(4, 6), D=4, K=2, seed=1)
    algo = create("ditto")
    cfg = configure(
        algo, proj_dim=3, rounds=1, batch_size=12, drop_last=False, optimizer="sgd", momentum=0.0,
        weight_decay=0.0, lr=0.5, lam=0.5, participation=0.67,
    )  # fmt: skip
    eng = Engine(algo, [cfg], train, test)
    w0 = {k: v[0, 0].double() for k, v in eng.state.params.items() if not k.startswith(PERS)}
    eng.run()
    part = participation(eng.seeds, 0, 3, 0.67)[0].tolist()
    assert 0 < sum(part) < 3
    step = lambda m, c, extra=None: {
        k: m[k] - 0.5 * (g + (0 if extra is None else extra[k]))
        for k, g in zip(m, torch.autograd.grad(loss_of(m, c), list(m.values())))
    }

    def loss_of(m, c):
        n = int(train.counts[c])
        return F.cross_entropy(forward(m, train.features[c, :n].double()), train.labels[c, :n])

    leaf = lambda m: {k: t.clone().requires_grad_(True) for k, t in m.items()}
    w_k, n = {}, {}
    for c in range(3):
        v = {k: t[0, c].double() for k, t in eng.state.params.items() if k.startswith(PERS)}
        if not part[c]:
            for k, t in v.items():
                torch.testing.assert_close(t, w0[k[len(PERS) :]].float().double())
            continue
        w_k[c], n[c] = step(leaf(w0), c), int(train.counts[c])
        want = step(leaf(w0), c, {k: 0.5 * (w0[k] - w0[k]) for k in w0})  # v_k^0 = w^0 = w^t in round 1
        for k, t in want.items():
            torch.testing.assert_close(v[PERS + k], t.detach(), rtol=1e-5, atol=1e-6)
    mean = {k: sum(n[c] * w_k[c][k] for c in w_k) / sum(n.values()) for k in w0}
    for k, t in mean.items():
        torch.testing.assert_close(eng.state.params[k][0, 0].double(), t.detach(), rtol=1e-5, atol=1e-6)
    model = eng.algo.global_model(eng.state, eng.last_round)
    assert model is not None and set(model[0]) == set(w0)


def test_the_personal_step_pulls_toward_the_rounds_global_model():
    """Round 2's proximal anchor is w^1 (what every client downloaded), not w^0 or the client's trained w_k."""
    algo = create("ditto")
    train, test = synthetic_clients(C=3, seed=0), synthetic_clients(C=3, seed=1)
    eng = Engine(algo, [configure(algo, rounds=1, proj_dim=4)], train, test)
    eng.run()
    ctx = eng.algo.context(eng.state, eng.round_context(1))
    for k, v in eng.state.params.items():
        if not k.startswith(PERS):
            assert torch.equal(ctx["global"][k], v)


@pytest.mark.parametrize("settings", [{"local_epochs": 2, "bn": True}, {"pers_epochs": 2, "optimizer": "sgd"}])
def test_engine_equals_the_plain_loop(settings):
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults), epochs on w and v_k
    that differ, BN statistics per model (the default settings: tests/test_engine.py, for every algorithm)."""
    assert_matches_plain_loop("ditto", rounds=2, **settings)


def release_runs(rate: float, ref=ref_ditto.ditto, plocal: int = 1):
    """Per round (featcache's global w, every client's v_k) and the transcription's, on the same data, parties and
    minibatches."""
    train, test = synthetic_clients(C=C, n=(32, 56), D=8, K=3, seed=0), synthetic_clients(C=C, n=(8, 16), D=8, K=3)
    algo = create("ditto")
    cfg = configure(
        algo, proj_dim=8, rounds=ROUNDS, batch_size=B, participation=rate, optimizer="sgd", momentum=0.0,
        weight_decay=0.0, lr=0.05, lam=0.5, pers_epochs=plocal,
    )  # fmt: skip
    engine = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in engine.state.params.items() if not k.startswith(PERS)}
    ours = []
    for r in range(ROUNDS):
        engine.run(until=r + 1)
        p = engine.state.params
        w = {k: v[0, 0].clone() for k, v in p.items() if not k.startswith(PERS)}
        ours.append((w, [{k: p[PERS + k][0, c].clone() for k in w} for c in range(C)]))
    seeds = torch.tensor([0])
    parties = [[c for c in range(C) if participation(seeds, r, C, rate)[0, c]] for r in range(ROUNDS)]
    assert any(c not in parties[0] for c in parties[1]) and all(len(p) < C for p in parties)

    batches = release_batches(train, B, drop_last=True)

    sizes = [int(n) for n in train.counts]
    theirs = ref(x0, parties, sizes, batches, 1, plocal, cfg["lr"], cfg["lam"])
    return ours, theirs


def largest_difference(ours, theirs) -> float:
    out = 0.0
    for (w, vs), (w_ref, vs_ref) in zip(ours, theirs):
        for a, b in [(w, w_ref), *zip(vs, vs_ref)]:
            out = max(out, max(float((a[k] - b[k]).abs().max()) for k in a))
    return out


@pytest.mark.parametrize("plocal", [1, 2])
def test_ditto_is_pflibs_release_at_partial_participation(plocal):
    ours, theirs = release_runs(0.5, plocal=plocal)
    assert largest_difference(ours, theirs) < 2e-6


def broken_ditto(model, selected_rounds, train_samples, batches, local_epochs, plocal_epochs, lr, mu):
    """The transcription with train() before ptrain(): the personal model pulled toward the client's trained w_k."""
    cls = ref_ditto.ClientDitto
    saved = cls.ptrain, cls.train
    cls.ptrain = lambda self, loader: (saved[1](self, loader), saved[0](self, loader))  # w_k first
    cls.train = lambda self, loader: None  # (already trained)
    try:
        return ref_ditto.ditto(model, selected_rounds, train_samples, batches, local_epochs, plocal_epochs, lr, mu)
    finally:
        cls.ptrain, cls.train = saved


def test_a_broken_transcription_fails_the_comparison():
    ours, theirs = release_runs(0.5, ref=broken_ditto)
    assert largest_difference(ours, theirs) > 1e-4


def test_batched_lambda_equals_single_runs():
    """λ reaches the personal step per configuration (a grid batches it)."""
    assert_batched_equals_alone("ditto", {"lam": 0.2}, rounds=2)


def test_resumes_byte_for_byte(tmp_path):
    """A run killed after round 2 and resumed ends as the uninterrupted one (every v_k is in the checkpoint)."""
    cache = write_cache(tmp_path / "c.h5", C=4, D=16, K=3, n=(16, 40), spread=4.0)
    opts = {"participation": 0.5, "batch_size": 8, "proj_dim": 8}
    assert_resumes_exactly(
        cache, "ditto", [(2, "kill")], 1, rounds=3, seeds=[0, 1], set=[f"{k}={v}" for k, v in opts.items()]
    )
