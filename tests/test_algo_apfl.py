"""APFL (featcache/algorithms/apfl.py): its local step against Alg. 1 of Deng et al. (2020) and the adaptive α
written out in float64, the engine against the plain per-client loop, and `apfl-official` against a transcription
of PFLlib's released code (tests/ref_apfl.py) over several rounds at partial participation, with a broken copy and
the paper's `apfl` failing the same comparison."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import configure
from harness import release_batches

from featcache.algorithms import create
from featcache.algorithms.apfl import ALPHA, OFFICIAL, PERS
from featcache.testing import assert_matches_plain_loop, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_apfl
from tests.test_algo_personal import assert_batched_equals_alone

C, B, ROUNDS, RATE = 6, 8, 4, 0.5
pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: threads only contend on a loaded machine


def head(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"proj0.weight": (3, 4), "proj0.bias": (3,), "cls0.weight": (2, 3), "cls0.bias": (2,)}
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"]) @ net["cls0.weight"].T + net["cls0.bias"]


def gradient(net: dict, x, y) -> dict:
    """∇f(net; x, y) of the mean cross-entropy, net's own leaves."""
    leaves = {k: t.detach().clone().requires_grad_(True) for k, t in net.items()}
    return dict(zip(leaves, torch.autograd.grad(F.cross_entropy(forward(leaves, x), y), list(leaves.values()))))


def test_one_step_is_alg1_with_the_adaptive_alpha():
    """The loss f(w) + f(v̄), v̄ = α v + (1 − α) w, differentiated once gives Alg. 1's three steps: ∇f(w) for w,
    α ∇f(v̄) for v, ⟨v − w, ∇f(v̄)⟩ for α (padding rows ignored), in float64."""
    algo = create("apfl")
    algo = algo.bind(configure(algo))
    w, v, a = head(0), head(1), 0.3
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y, mask = torch.tensor([0, 1, 1, 0, 1]), torch.tensor([True, True, True, True, False])
    params = {k: t.clone().requires_grad_(True) for k, t in w.items()}
    params |= {PERS + k: t.clone().requires_grad_(True) for k, t in v.items()}
    params[ALPHA] = torch.tensor([a], dtype=torch.float64, requires_grad=True)
    loss, _ = algo.local_loss(params, {}, x, y, mask, {"hp": {}})
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    v_bar = {k: a * v[k] + (1 - a) * w[k] for k in w}
    xs, ys = x[:4], y[:4]
    want = F.cross_entropy(forward(w, xs), ys) + F.cross_entropy(forward(v_bar, xs), ys)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    g_w, g_bar = gradient(w, xs, ys), gradient(v_bar, xs, ys)
    for k in w:
        torch.testing.assert_close(grads[k], g_w[k], rtol=1e-12, atol=1e-12)  # w: its own loss only
        torch.testing.assert_close(grads[PERS + k], a * g_bar[k], rtol=1e-12, atol=1e-12)  # ∇_v f(v̄) = α ∇f(v̄)
    d_alpha = sum((v[k] - w[k]).flatten() @ g_bar[k].flatten() for k in w)  # ⟨v − w, ∇f(v̄)⟩
    assert grads[ALPHA].item() == pytest.approx(d_alpha.item(), rel=1e-10)
    scores = algo.predict(params, {}, x, {})
    torch.testing.assert_close(scores, forward(v_bar, x), rtol=1e-12, atol=1e-12)  # the client predicts with v̄


def test_one_round_of_sgd_is_alg1_and_the_uniform_mean():
    """Plain SGD, one full-batch step per client: w_k, v_k and α_k from the values before the step (α projected onto
    [0, 1]), the server's w the participants' uniform mean; absent clients keep v_k and α_0; every client predicts
    with α_k v_k + (1 − α_k) w, the global model is w."""
    train, test = synthetic_clients(C=3, n=(8, 12), D=4, K=2), synthetic_clients(C=3, n=(4, 6), D=4, K=2, seed=1)
    algo = create("apfl")
    lr, a0 = 0.5, 0.4
    cfg = configure(
        algo, proj_dim=3, rounds=1, batch_size=12, drop_last=False, optimizer="sgd", momentum=0.0,
        weight_decay=0.0, lr=lr, alpha=a0, participation=0.67,
    )  # fmt: skip
    eng = Engine(algo, [cfg], train, test)
    w0 = {k: eng.state.params[k][0, 0].double() for k in ("proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias")}
    out = eng.run()
    part = participation(eng.seeds, 0, 3, 0.67)[0].tolist()
    assert 0 < sum(part) < 3
    trained = []
    for c in range(3):
        n = int(train.counts[c])
        x, y = train.features[c, :n].double(), train.labels[c, :n]
        alpha = eng.state.params[ALPHA][0, c].item()
        v = {k: eng.state.params[PERS + k][0, c].double() for k in w0}
        if not part[c]:
            assert alpha == pytest.approx(a0) and all(torch.allclose(v[k], w0[k].float().double()) for k in w0)
            continue
        v_bar = {k: a0 * w0[k] + (1 - a0) * w0[k] for k in w0}  # v^0 = w^0
        g_w, g_bar = gradient(w0, x, y), gradient(v_bar, x, y)
        trained.append({k: w0[k] - lr * g_w[k] for k in w0})
        for k in w0:
            torch.testing.assert_close(v[k], w0[k] - lr * a0 * g_bar[k], rtol=1e-5, atol=1e-6)
        step = a0 - lr * sum((w0[k] - w0[k]).flatten() @ g_bar[k].flatten() for k in w0)  # v − w = 0 in round 1
        assert alpha == pytest.approx(min(max(float(step), 0.0), 1.0), abs=1e-6)
    mean = {k: sum(t[k] for t in trained) / len(trained) for k in w0}  # 1/|U_t| Σ w_k
    for k, t in mean.items():
        for c in range(3):
            torch.testing.assert_close(eng.state.params[k][0, c].double(), t, rtol=1e-5, atol=1e-6)
    model = eng.algo.global_model(eng.state, eng.last_round)
    assert model is not None and set(model[0]) == set(w0)
    for c in range(3):
        a = eng.state.params[ALPHA][0, c].double()
        v_bar = {k: a * eng.state.params[PERS + k][0, c].double() + (1 - a) * mean[k] for k in w0}
        n = int(test.counts[c])
        hits = (forward(v_bar, test.features[c, :n].double()).argmax(-1) == test.labels[c, :n]).double().mean()
        assert out["acc"][-1, 0, c].item() == pytest.approx(hits.item(), abs=1e-6)


def test_alpha_stays_in_its_range_and_a_fixed_alpha_does_not_move():
    train, test = synthetic_clients(C=3, seed=0), synthetic_clients(C=3, seed=1)
    for adaptive, lr in ((True, 5.0), (False, 0.1)):
        algo = create("apfl")
        cfg = configure(algo, rounds=2, optimizer="sgd", momentum=0.0, lr=lr, alpha=0.5, adaptive=adaptive, proj_dim=4)
        eng = Engine(algo, [cfg], train, test)
        eng.run()
        alpha = eng.state.params[ALPHA]
        assert ((alpha >= 0) & (alpha <= 1)).all()
        assert (alpha == 0.5).all() != adaptive


@pytest.mark.parametrize(
    "name, settings",
    [("apfl", {"bn": True}), ("apfl", {"optimizer": "sgd", "adaptive": False}), ("apfl-official", {"bn": True})],
)
def test_engine_equals_the_plain_loop(name, settings):
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults), BN statistics per
    model; α, the pending α step and the end-of-round mixture per client."""
    assert_matches_plain_loop(name, rounds=2, **settings)


def test_batched_alpha_equals_single_runs():
    """α_0 reaches each configuration's clients (a grid batches it, as the paper's 0.25 / 0.5 / 0.75)."""
    assert_batched_equals_alone("apfl", {"alpha": 0.75}, rounds=2)


# -- against PFLlib's release ------------------------------------------------------------------------------------
def release_runs(name: str, ref=ref_apfl.apfl, epochs: int = 1):
    """Per round (featcache's global w, every client's personal model and α, the test hits of the clients' models)
    and the transcription's, on the same data, parties and minibatches."""
    train, test = synthetic_clients(C=C, n=(24, 48), D=8, K=3, seed=0), synthetic_clients(C=C, n=(8, 16), D=8, K=3)
    algo = create(name)
    cfg = configure(
        algo, proj_dim=8, rounds=ROUNDS, batch_size=B, participation=RATE, optimizer="sgd", momentum=0.0,
        weight_decay=0.0, lr=0.05, alpha=1.0, local_epochs=epochs,
    )  # fmt: skip
    engine = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in engine.state.params.items() if not k.startswith(PERS) and k != ALPHA}
    ours = []
    for r in range(ROUNDS):
        acc = engine.run(until=r + 1)["acc"][-1, 0]  # [C]
        p, b = engine.state.params, engine.state.buffers
        w = {k: p[k][0, 0].clone() for k in x0}
        alphas = p[ALPHA][0] if ALPHA in p else b[f"{OFFICIAL}alpha"][0]  # [C, 1]
        if name == "apfl":  # the paper's personal model: α v + (1 − α) w
            pers = [{k: alphas[c] * p[PERS + k][0, c] + (1 - alphas[c]) * w[k] for k in w} for c in range(C)]
        else:
            pers = [{k: p[PERS + k][0, c].clone() for k in w} for c in range(C)]
        hits = [round(float(acc[c]) * int(test.counts[c])) for c in range(C)]
        ours.append((w, [(pers[c], float(alphas[c])) for c in range(C)], hits))
    seeds = torch.tensor([0])
    parties = [[c for c in range(C) if participation(seeds, r, C, RATE)[0, c]] for r in range(ROUNDS)]
    assert any(c not in parties[0] for c in parties[1]) and all(len(p) < C for p in parties)

    batches = release_batches(train, B, drop_last=True)

    sizes = [int(n) for n in train.counts]
    tests = [(test.features[c, : int(test.counts[c])], test.labels[c, : int(test.counts[c])]) for c in range(C)]
    theirs = ref(x0, parties, sizes, batches, epochs, cfg["lr"], cfg["alpha"], tests)
    return ours, theirs


def largest_difference(ours, theirs, hits: bool = True) -> float:
    """The largest difference of w, the personal models and α over the rounds (and, with `hits`, the assertion that
    every round's evaluation scores the same test rows right)."""
    out = 0.0
    for (w, pers, ours_hits), (w_ref, pers_ref, ref_hits) in zip(ours, theirs):
        assert ours_hits == ref_hits or not hits
        out = max(out, max(float((w[k] - w_ref[k]).abs().max()) for k in w))
        for (v, a), (v_ref, a_ref) in zip(pers, pers_ref):
            out = max(out, abs(a - a_ref), max(float((v[k] - v_ref[k]).abs().max()) for k in v))
    return out


@pytest.mark.parametrize("epochs", [1, 2])
def test_apfl_official_is_pflibs_release_at_partial_participation(epochs):
    """(With 2 local epochs the α step of an epoch's last local step is taken at the next epoch's first.)"""
    ours, theirs = release_runs("apfl-official", epochs=epochs)
    assert largest_difference(ours, theirs) < 2e-6
    alphas = [a for _, a in theirs[-1][1]]
    assert min(alphas) < 0.99 and len(set(alphas)) > 2  # α moved, per client (the absent ones kept theirs)


def broken_alpha_update(self):
    """alpha_update from the gradients alone, without the parameters after the step: ⟨v − w, ...⟩ from before it."""
    grad_alpha = 0
    for l_params, p_params in zip(self.model.values(), self.model_per.values()):
        before = lambda t: t.data + self.learning_rate * t.grad  # the parameter before the SGD step
        dif = before(p_params) - before(l_params)
        grad = self.alpha * p_params.grad.data + (1 - self.alpha) * l_params.grad.data
        grad_alpha += dif.view(-1).dot(grad.view(-1))
    grad_alpha += 0.02 * self.alpha
    self.alpha = float((self.alpha - self.learning_rate * grad_alpha).clamp(0.0, 1.0))


def test_a_broken_transcription_and_the_paper_fail_the_comparison(monkeypatch):
    monkeypatch.setattr(ref_apfl.ClientAPFL, "alpha_update", broken_alpha_update)
    ours, theirs = release_runs("apfl-official")
    assert largest_difference(ours, theirs, hits=False) > 1e-4
    monkeypatch.undo()
    assert largest_difference(*release_runs("apfl"), hits=False) > 1e-4  # the paper's v step, α step and mean
