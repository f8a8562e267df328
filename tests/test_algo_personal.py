"""pFedMe, Per-FedAvg and FedAMP against direct transcriptions of their papers' equations on tiny tensors.

The transcriptions use their own forward pass (explicit per-row cross-entropy of FC + ReLU + FC), autograd on leaf
tensors and plain loops over clients, never the algorithms' helpers.
"""

from __future__ import annotations

import math
from types import MappingProxyType

import pytest
import torch
from conftest import configure

from featcache.algorithms import create
from featcache.training.engine import Engine, Round, State
from featcache.errors import UserError
from tests.synthetic import synthetic_clients

D_IN, HID, K = 3, 4, 3
KEYS = ("proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias")


def setup(name: str, **over):
    """Algorithm `name` bound to its defaults plus `over`; `.full` holds the whole configuration."""
    full = configure(name, **{"proj_dim": HID} | over)
    algo = create(name, full)
    algo.full = full
    return algo


def round_of(part, **hp) -> Round:
    """A Round for server hooks called directly: participation part [H, C] (nonzero = takes part), hp name -> [H]."""
    part = torch.as_tensor(part) != 0
    H, C = part.shape
    return Round(
        round=0,
        rounds=1,
        epoch=0,
        step=0,
        steps_per_epoch=1,
        client_steps=torch.ones(C, dtype=torch.long),
        part=part,
        H=H,
        C=C,
        seeds=torch.zeros(H, dtype=torch.long),
        hp={k: torch.as_tensor(v, dtype=torch.float32) for k, v in hp.items()},
        cfg=MappingProxyType({}),
        data=None,
        device=torch.device("cpu"),
    )


def tiny_model(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"proj0.weight": (HID, D_IN), "proj0.bias": (HID,), "cls0.weight": (K, HID), "cls0.bias": (K,)}
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


def batch(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_IN, generator=g), torch.randint(0, K, (n,), generator=g)  # [n, D], [n]


def logits_of(p: dict, x: torch.Tensor) -> torch.Tensor:
    z = torch.relu(x @ p["proj0.weight"].T + p["proj0.bias"])  # [n, HID]
    return z @ p["cls0.weight"].T + p["cls0.bias"]  # [n, K]


def ce(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """f(θ; D) = 1/|D| Σ_n −log softmax(s_n)[y_n], row by row."""
    total = 0.0
    for n in range(len(x)):
        s = logits_of(p, x[n : n + 1])[0]  # [K]
        total = total - (s[y[n]] - torch.log(torch.exp(s).sum()))
    return total / len(x)


def grad_of(fn, p: dict) -> dict:
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in p.items()}
    return dict(zip(leaves, torch.autograd.grad(fn(leaves), list(leaves.values()))))


def loss_and_grad(algo, params: dict, x, y, mask, ctx, buffers=None):
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss, new = algo.local_loss(leaves, buffers or {}, x, y, mask, ctx)
    return loss, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())))), new


def hp(**values) -> dict:
    return {"hp": {k: torch.tensor(v) for k, v in values.items()}}


def assert_dicts_close(a: dict, b: dict, **tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol)


# -- pFedMe ----------------------------------------------------------------------------------------------------
def pfedme_reference(w: dict, x, y, lam: float, plr: float, steps: int) -> dict:
    """θ̃: `steps` gradient steps on h(θ) = f(θ; D) + λ/2 ||θ − w||² from θ = w."""
    theta = {k: v.clone() for k, v in w.items()}
    for _ in range(steps):
        g = grad_of(lambda t: ce(t, x, y), theta)
        theta = {k: theta[k] - plr * (g[k] + lam * (theta[k] - w[k])) for k in theta}
    return theta


def test_pfedme_local_step_is_alg1():
    algo, w = setup("pfedme", inner_steps=3), tiny_model(0)
    x, y = batch(1)
    lam, plr, eta = 15.0, 0.05, 0.01
    loss, g, new = loss_and_grad(algo, w, x, y, torch.ones(6, dtype=torch.bool), hp(lam=lam, personal_lr=plr))
    theta = pfedme_reference(w, x, y, lam, plr, steps=3)
    assert_dicts_close({k: new["personal." + k] for k in KEYS}, theta, atol=1e-6, rtol=1e-5)
    w_next = {k: w[k] - eta * lam * (w[k] - theta[k]) for k in w}  # w ← w − ηλ(w − θ̃)
    assert_dicts_close({k: w[k] - eta * g[k] for k in w}, w_next, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss, lam / 2 * sum(((w[k] - theta[k]) ** 2).sum() for k in w))


def test_pfedme_ignores_padding_rows():
    algo, w = setup("pfedme"), tiny_model(2)
    x, y = batch(3, n=8)
    mask = torch.arange(8) < 5
    ctx = hp(lam=15.0, personal_lr=0.09)
    padded = loss_and_grad(algo, w, x, y.masked_fill(~mask, -1), mask, ctx)
    alone = loss_and_grad(algo, w, x[:5], y[:5], torch.ones(5, dtype=torch.bool), ctx)
    torch.testing.assert_close(padded[0], alone[0])
    assert_dicts_close(padded[2], alone[2])


def test_pfedme_predicts_with_the_personalized_model():
    algo, w, theta = setup("pfedme"), tiny_model(0), tiny_model(1)
    x, _ = batch(4)
    buffers = {"personal." + k: v for k, v in theta.items()}
    torch.testing.assert_close(algo.predict(w, buffers, x, hp()), logits_of(theta, x))


def test_pfedme_server_mixes_with_beta():
    algo = setup("pfedme")
    g = torch.Generator().manual_seed(5)
    old = {"proj0.bias": torch.randn(2, HID, generator=g)}  # w^t [H, d]
    uploads = {"proj0.bias": torch.randn(2, 3, HID, generator=g)}  # w_i [H, C, d]
    weights = torch.tensor([[10.0, 0.0, 30.0], [5.0, 7.0, 9.0]])  # client 1 of config 0 sat out
    state = State(params={}, buffers={}, server={"global": old})
    out = algo.aggregate(uploads, weights, state, round_of(weights, beta=[0.5, 2.0]))["proj0.bias"]
    for h, beta in enumerate([0.5, 2.0]):
        S = [c for c in range(3) if weights[h, c] > 0]
        mean = sum(uploads["proj0.bias"][h, c] for c in S) / len(S)  # Σ_{i∈S} w_i / S
        torch.testing.assert_close(out[h], (1 - beta) * old["proj0.bias"][h] + beta * mean)


def test_pfedme_engine_sgd_step_equals_paper():
    """One round, one minibatch per client, SGD without momentum: the engine's update is exactly Alg. 1's."""
    train = synthetic_clients(C=3, n=(8, 8), D=D_IN, K=K, seed=0)
    algo = create("pfedme")
    cfg = configure(
        algo, proj_dim=HID, rounds=1, batch_size=8, optimizer="sgd", momentum=0.0, weight_decay=0.0, lr=0.005
    )
    eng = Engine(algo, [cfg], train, train)
    w = {k: v[0, 0].clone() for k, v in eng.init_state().params.items()}
    eng.run()
    local = []
    for c in range(3):
        theta = pfedme_reference(w, train.features[c], train.labels[c], 15.0, cfg["personal_lr"], steps=5)
        local.append({k: w[k] - 0.005 * 15.0 * (w[k] - theta[k]) for k in w})
        assert_dicts_close({k: eng.state.buffers["personal." + k][0, c] for k in w}, theta, atol=1e-5, rtol=1e-4)
    for k in w:  # β = 1: the plain average of the local models
        torch.testing.assert_close(eng.state.params[k][0, 1], sum(m[k] for m in local) / 3, atol=1e-6, rtol=1e-5)


def test_pfedme_needs_an_inner_step():
    with pytest.raises(UserError, match="inner_steps"):
        create("pfedme").init(setup("pfedme").full | {"inner_steps": 0}, D_IN, K, torch.Generator())


# -- Per-FedAvg ------------------------------------------------------------------------------------------------
def flat(p: dict) -> torch.Tensor:
    return torch.cat([p[k].reshape(-1) for k in KEYS])


def unflat(v: torch.Tensor) -> dict:
    out, i = {}, 0
    for k, s in zip(KEYS, [(HID, D_IN), (HID,), (K, HID), (K,)]):
        out[k] = v[i : i + math.prod(s)].reshape(s)
        i += math.prod(s)
    return out


@pytest.mark.parametrize("order", ["first", "second"])
def test_perfedavg_meta_gradient(order):
    algo, w = setup("perfedavg", order=order), tiny_model(6)
    x, y = batch(7, n=8)
    alpha = 0.3
    loss, g, _ = loss_and_grad(algo, w, x, y, torch.ones(8, dtype=torch.bool), hp(alpha=alpha))
    d, d2 = [0, 2, 4, 6], [1, 3, 5, 7]  # D and D' inside one minibatch
    g_d = grad_of(lambda p: ce(p, x[d], y[d]), w)
    w_tilde = {k: w[k] - alpha * g_d[k] for k in w}  # w̃ = w − α ∇f(w; D)
    outer = flat(grad_of(lambda p: ce(p, x[d2], y[d2]), w_tilde))  # ∇f(w̃; D')
    if order == "second":  # (I − α ∇²f(w; D)) ∇f(w̃; D')
        hess = torch.autograd.functional.hessian(lambda v: ce(unflat(v), x[d], y[d]), flat(w))  # [P, P]
        outer = outer - alpha * hess @ outer
    torch.testing.assert_close(flat(g), outer, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss, ce(w_tilde, x[d2], y[d2]))


def test_perfedavg_orders_differ():
    w, (x, y) = tiny_model(6), batch(7, n=8)
    ones = torch.ones(8, dtype=torch.bool)
    fo = loss_and_grad(setup("perfedavg", order="first"), w, x, y, ones, hp(alpha=0.3))[1]
    so = loss_and_grad(setup("perfedavg", order="second"), w, x, y, ones, hp(alpha=0.3))[1]
    assert (flat(fo) - flat(so)).abs().max() > 1e-4


def test_perfedavg_short_batch_splits_like_the_plain_loop():
    algo, w = setup("perfedavg"), tiny_model(8)
    x, y = batch(9, n=8)
    mask = torch.arange(8) < 5
    padded = loss_and_grad(algo, w, x, y.masked_fill(~mask, -1), mask, hp(alpha=0.3))
    alone = loss_and_grad(algo, w, x[:5], y[:5], torch.ones(5, dtype=torch.bool), hp(alpha=0.3))
    torch.testing.assert_close(padded[0], alone[0])
    assert_dicts_close(padded[1], alone[1])


def test_perfedavg_evaluates_after_one_step_on_training_data():
    algo, w = setup("perfedavg"), tiny_model(10)
    x_train, y_train = batch(11, n=7)
    x_test, _ = batch(12, n=4)
    pad = torch.zeros(2, D_IN)  # padding rows of the client's training set
    ctx = hp(alpha=0.5) | {
        "train_x": torch.cat([x_train, pad]),
        "train_y": torch.cat([y_train, -torch.ones(2).long()]),
        "train_mask": torch.arange(9) < 7,
    }
    g = grad_of(lambda p: ce(p, x_train, y_train), w)
    adapted = {k: w[k] - 0.5 * g[k] for k in w}  # w − α ∇f_i(w)
    torch.testing.assert_close(algo.predict(w, {}, x_test, ctx), logits_of(adapted, x_test))


def test_perfedavg_server_averages_participants_uniformly():
    algo = setup("perfedavg")
    uploads = {"cls0.bias": torch.arange(12.0).reshape(1, 4, 3)}  # [H, C, K]
    weights = torch.tensor([[100.0, 0.0, 1.0, 3.0]])
    out = algo.aggregate(uploads, weights, None, round_of(weights))["cls0.bias"]
    torch.testing.assert_close(
        out[0], (uploads["cls0.bias"][0, 0] + uploads["cls0.bias"][0, 2] + uploads["cls0.bias"][0, 3]) / 3
    )


def test_perfedavg_rejects_unknown_order():
    with pytest.raises(UserError, match="perfedavg: order must be one of first, second .got 'hf'."):
        configure("perfedavg", order="hf")


# -- FedAMP ----------------------------------------------------------------------------------------------------
def models(C: int, seed: int) -> dict:
    ms = [tiny_model(seed + c) for c in range(C)]
    return {k: torch.stack([m[k] for m in ms])[None] for k in KEYS}  # [1, C, ...]


def vec(m: dict, c: int) -> torch.Tensor:
    return torch.cat([m[k][0, c].reshape(-1) for k in KEYS])


def amp_round(C: int, **values) -> Round:
    return round_of(torch.ones(1, C), **{k: [v] for k, v in values.items()})


def test_heurfedamp_cloud_models():
    algo, W = setup("fedamp"), models(4, 20)
    sigma, xi_ii = 3.0, 0.3
    out = algo.aggregate(W, torch.ones(1, 4), None, amp_round(4, sigma=sigma, self_attention=xi_ii))
    for i in range(4):
        cos = lambda j: torch.dot(vec(W, i), vec(W, j)) / (vec(W, i).norm() * vec(W, j).norm())
        others = [j for j in range(4) if j != i]
        denom = sum(torch.exp(sigma * cos(h)) for h in others)
        xi = {j: torch.exp(sigma * cos(j)) / denom * (1 - xi_ii) for j in others} | {i: torch.tensor(xi_ii)}
        for k in KEYS:  # u_i = Σ_j ξ_ij w_j
            torch.testing.assert_close(out[k][0, i], sum(xi[j] * W[k][0, j] for j in range(4)))


def test_fedamp_distance_cloud_models():
    algo, W = setup("fedamp", attention="distance"), models(3, 30)
    alpha, sigma = 0.5, 40.0
    out = algo.aggregate(W, torch.ones(1, 3), None, amp_round(3, sigma=sigma, alpha_k=alpha))
    for i in range(3):
        a_prime = lambda j: math.exp(-float(((vec(W, i) - vec(W, j)) ** 2).sum()) / sigma) / sigma  # A'(||·||²)
        xi = {j: alpha * a_prime(j) for j in range(3) if j != i}
        xi[i] = 1 - sum(xi.values())
        for k in KEYS:
            torch.testing.assert_close(out[k][0, i], sum(xi[j] * W[k][0, j] for j in range(3)))


def test_fedamp_single_client_keeps_its_model():
    W = models(1, 40)
    out = setup("fedamp").aggregate(W, torch.ones(1, 1), None, amp_round(1, sigma=1.0, self_attention=0.5))
    assert_dicts_close(out, W)


def test_fedamp_local_loss_is_proximal_to_the_cloud_model():
    algo, w, u = setup("fedamp"), tiny_model(50), tiny_model(51)
    x, y = batch(52)
    lam, alpha = 2.0, 0.5
    ctx = hp(lam=lam, alpha_k=alpha) | {"cloud": u}
    loss, g, _ = loss_and_grad(algo, w, x, y, torch.ones(6, dtype=torch.bool), ctx)
    expected = lambda p: ce(p, x, y) + lam / (2 * alpha) * sum(((p[k] - u[k]) ** 2).sum() for k in KEYS)
    torch.testing.assert_close(loss, expected(w))
    assert_dicts_close(g, grad_of(expected, w), atol=1e-6, rtol=1e-5)


def test_fedamp_download_keeps_personal_models():
    algo, W = setup("fedamp"), models(3, 60)
    state = State(params={k: v.clone() for k, v in W.items()}, buffers={})
    cloud = {k: v + 1 for k, v in W.items()}
    algo.download(state, cloud, round_of(torch.ones(1, 3)))
    assert_dicts_close(state.params, W)
    assert state.client["cloud"] is cloud


def test_fedamp_rejects_unknown_attention():
    with pytest.raises(UserError, match="fedamp: attention must be one of cosine, distance .got 'softmax'."):
        configure("fedamp", attention="softmax")


# -- all three ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, over",
    [
        ("pfedme", {"lam": 5.0, "beta": 0.7, "personal_lr": 0.03}),
        ("perfedavg", {"alpha": 0.2, "order": "first"}),
        ("fedamp", {"sigma": 5.0, "self_attention": 0.2, "lam": 3.0}),
    ],
)
def test_batched_hyperparameters_equal_single_runs(name, over):
    """The per-config hyperparameters reach the server hooks per configuration, not the first one's for all."""
    assert_batched_equals_alone(name, over, rounds=2)


def assert_batched_equals_alone(name: str, over: dict, rounds: int) -> None:
    """Two configurations (the defaults, and `over` with another seed) trained as one batched run end with each
    configuration's own accuracies and parameters, as when it is trained alone."""
    train, test = synthetic_clients(C=3, n=(10, 20), seed=0), synthetic_clients(C=3, n=(10, 20), seed=1)
    base = configure(name, proj_dim=HID, rounds=rounds, batch_size=8, lr=1e-2, participation=0.67)
    cfgs = [base, base | over | {"seed": 1}]
    batched = Engine(create(name), cfgs, train, test)
    acc = batched.run()["acc"]  # [R, H, C]
    for h, cfg in enumerate(cfgs):
        alone = Engine(create(name), [cfg], train, test)
        torch.testing.assert_close(acc[:, h], alone.run()["acc"][:, 0])
        assert_dicts_close(
            {k: v[h] for k, v in batched.state.params.items()}, {k: v[0] for k, v in alone.state.params.items()}
        )
