"""Baselines (FedProx, SCAFFOLD, MOON, FedBN, FedPer, FedRep, FedRoD, Local): every local loss equals its paper's
equation written out with explicit sums, SCAFFOLD's control variates follow option II, and each method shares
exactly the parameters its paper shares."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import configure
from torch.func import grad

from featcache.algorithms import create
from featcache.cache import ClientData
from featcache.training.engine import Engine
from tests.synthetic import synthetic_clients

D, P, K = 3, 4, 3  # input features, projection width, classes of the tiny hand-checked heads


def setup(name: str, **over):
    cfg = configure(name, proj_dim=P, **over)
    algo = create(name, cfg)
    params, buffers = algo.init(cfg, D, K, torch.Generator().manual_seed(0))
    return algo, params, buffers


def config(algo, **over) -> dict:
    return configure(algo, **{"proj_dim": 8, "batch_size": 16} | over)


@pytest.fixture(scope="module")
def data():
    return synthetic_clients(seed=0), synthetic_clients(seed=1)


def run(name: str, data, **over) -> Engine:
    train, test = data
    algo = create(name)
    eng = Engine(algo, [config(algo, rounds=2, lr=1e-2, **over)], train, test)
    eng.out = eng.run()
    return eng


def same_across_clients(t: torch.Tensor) -> bool:
    return torch.equal(t, t[:, :1].expand_as(t))


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, D, generator=g)  # [N, D]
    y = torch.tensor([0, 2, 1, 2, -1])  # the last row is padding
    return x, y, y >= 0


def perturbed(params: dict, seed: int, scale: float = 0.3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in params.items()}


# -- direct transcriptions, one sample at a time with explicit sums ------------------------------------------------
def project(p: dict, xn: torch.Tensor) -> list:
    """z_j = ReLU(Σ_i W_ji x_i + b_j)."""
    W, b = p["proj0.weight"], p["proj0.bias"]
    return [torch.relu(sum(W[j, i] * xn[i] for i in range(len(xn))) + b[j]) for j in range(len(b))]


def classify(p: dict, z: list, name: str = "cls0") -> list:
    """l_k = Σ_j V_kj z_j + c_k."""
    V, c = p[f"{name}.weight"], p[f"{name}.bias"]
    return [sum(V[k, j] * z[j] for j in range(len(z))) + c[k] for k in range(len(c))]


def neg_log_softmax(logits: list, y: int, prior: list | None = None) -> torch.Tensor:
    """−log(π_y e^{l_y} / Σ_c π_c e^{l_c}), π = 1 unless a prior is given."""
    prior = prior or [1.0] * len(logits)
    den = sum(prior[c] * torch.exp(logits[c]) for c in range(len(logits)))
    return -torch.log(prior[y] * torch.exp(logits[y]) / den)


def cosine(a: list, b: list) -> torch.Tensor:
    dot = sum(ai * bi for ai, bi in zip(a, b))
    return dot / (torch.sqrt(sum(ai * ai for ai in a)) * torch.sqrt(sum(bi * bi for bi in b)))


def mean_ce(p: dict, x, y, mask) -> torch.Tensor:
    rows = [n for n in range(len(y)) if mask[n]]
    return sum(neg_log_softmax(classify(p, project(p, x[n])), int(y[n])) for n in rows) / len(rows)


def hp(**values) -> dict:
    return {"hp": {k: torch.tensor(v) for k, v in values.items()}}


# -- FedProx --------------------------------------------------------------------------------------------------------
def test_fedprox_loss_is_eq2():
    algo, params, buffers = setup("fedprox")
    x, y, mask = batch()
    glob = perturbed(params, seed=2)
    ce, _ = algo.local_loss(params, buffers, x, y, mask, hp(mu=0.3) | {"global": glob})
    stack = lambda tree: {k: v[None, None] for k, v in tree.items()}  # one model as an [H, C] = [1, 1] stack
    value, grads = algo.penalty(stack(params), {"hp": {"mu": torch.tensor([[0.3]])}, "global": stack(glob)})
    sq = sum(float(a - b) ** 2 for k in params for a, b in zip(params[k].flatten(), glob[k].flatten()))
    expected = mean_ce(params, x, y, mask) + 0.3 / 2 * sq  # F_k(w) + μ/2 ||w − w^t||²
    assert abs(float(ce + value[0, 0]) - float(expected)) < 1e-5
    assert sq > 0.1
    for k, p in params.items():  # the closed-form gradient is autograd's of the term
        leaf = p.detach().requires_grad_(True)
        ((leaf - glob[k]).square().sum() * 0.3 / 2).backward()
        torch.testing.assert_close(grads[k][0, 0], leaf.grad)


def test_an_anchor_is_laid_out_like_the_models_it_pulls():
    """FedProx's w^t comes in each trained weight's memory layout (a linear weight trains transposed), so w − w^t
    runs at full speed; the values are w^t's, still one model per configuration broadcast over the clients."""
    from featcache.algorithms.base import laid_like

    w = torch.randn(2, 3, 5, 4).mT  # [H, C, 4, 5], each model transposed in memory
    anchor = torch.randn(2, 4, 5)[:, None].expand(2, 3, 4, 5)
    out = laid_like(anchor, w)
    assert torch.equal(out, anchor) and out.stride()[2:] == w.stride()[2:] and out.stride(1) == 0
    assert laid_like(anchor, torch.randn(2, 3, 4, 5)) is anchor  # the same layout already: nothing copied


def test_fedprox_anchors_to_the_round_start_model(data):
    train, test = data
    algo = create("fedprox")
    eng = Engine(algo, [config(algo, rounds=2, participation=0.5)], train, test)
    eng.run()
    for k, v in eng.state.params.items():  # after download every client holds w^{t+1}, and that is the anchor
        torch.testing.assert_close(eng.state.server["global"][k], v[:, 0])
        torch.testing.assert_close(v, v[:, :1].expand_as(v))


# -- SCAFFOLD -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_scaffold_step_is_corrected_by_c_minus_ci(optimizer, data):
    """Alg. 1 line 10 on one full-batch step per client: y ← y − η (d + c − c_i), d = the optimizer's direction for
    the loss gradient g (SGD without momentum: d = g, the paper's step; Adam's first step: d = g / (|g| + ε)). The
    correction is applied exactly, outside the optimizer's moments, for the clients that take part only."""
    train, test = data
    lr = 0.05
    eng = Engine(
        create("scaffold"),
        [
            config(
                create("scaffold"),
                lr=lr,
                optimizer=optimizer,
                momentum=0.0,
                weight_decay=0.0,
                batch_size=int(train.counts.max()),
                drop_last=False,
            )
        ],
        train,
        test,
    )
    state = eng.init_state()
    g = torch.Generator().manual_seed(9)
    c = state.server["control"] = {k: torch.randn(v.shape, generator=g) for k, v in state.server["control"].items()}
    c_i = state.client["control"] = {k: torch.randn(v.shape, generator=g) for k, v in state.params.items()}
    y0 = {k: v.clone() for k, v in state.params.items()}
    part = [[True, False, True, True]]
    eng.local_train(state, 0, part)
    fedavg = create("fedavg", dict(eng.algo.cfg))
    for i in range(4):
        leaf = {k: v[0, i].clone().requires_grad_(True) for k, v in y0.items()}
        n = int(train.counts[i])
        loss, _ = fedavg.local_loss(leaf, {}, train.features[i, :n], train.labels[i, :n], train.mask[i, :n], {})
        grads = dict(zip(leaf, torch.autograd.grad(loss, list(leaf.values()))))
        for k, gk in grads.items():
            d = gk if optimizer == "sgd" else gk / (gk.abs() + 1e-8)
            want = y0[k][0, i] - lr * (d + c[k][0] - c_i[k][0, i]) if part[0][i] else y0[k][0, i]
            torch.testing.assert_close(state.params[k][0, i], want, atol=1e-6, rtol=1e-5)


def test_scaffold_local_steps_count_the_engine_minibatches(data):
    train, test = data
    for drop_last in (True, False):
        algo = create("scaffold")
        cfg = config(algo, local_epochs=3, drop_last=drop_last)
        eng = Engine(algo, [cfg], train, test)
        expected = []
        for n in train.counts.tolist():
            n_eff = n // 16 * 16 if drop_last else n
            expected.append(len(range(0, n_eff, 16)))
        now = eng.round_context(0)
        assert now.client_steps.tolist() == expected and now.steps_per_epoch == max(expected)


def test_scaffold_with_bn_averages_running_statistics(data):
    eng = run("scaffold", data, bn=True, participation=0.5)
    for k, v in eng.state.buffers.items():
        assert same_across_clients(v), k
    n = sum(v[0, 0].numel() for v in eng.state.params.values()) * 2 + sum(
        v[0, 0].numel() for v in eng.state.buffers.values()
    )
    assert eng.out["upload_floats"][0] == n


def test_scaffold_control_variates_follow_option_ii(data):
    train, test = data
    algo = create("scaffold")
    lr, epochs, B = 0.05, 2, 16
    eng = Engine(algo, [config(algo, lr=lr, local_epochs=epochs, optimizer="sgd")], train, test)
    state = eng.init_state()
    g = torch.Generator().manual_seed(5)
    rand = lambda t: torch.randn(t.shape, generator=g)
    x = {k: v[:, 0].clone() for k, v in state.params.items()}  # [1, ...]
    c = state.server["control"] = {k: rand(v) for k, v in x.items()}
    c_i = state.client["control"] = {k: rand(v) for k, v in state.params.items()}
    y_i = {k: v + rand(v) for k, v in state.params.items()}
    state.params = dict(y_i)
    part = torch.tensor([[True, False, True, True]])
    algo, now = eng.algo, eng.round_context(0, part)
    uploads = algo.upload(state, now)
    assert sum(v[0, 0].numel() for v in uploads.values()) == 2 * sum(v[0, 0].numel() for v in y_i.values())
    server = algo.aggregate(uploads, train.counts[None].float() * part, state, now)
    algo.download(state, server, now)

    S = [i for i in range(4) if part[0, i]]
    for k in x:
        new_ci, deltas = [], []
        for i in range(4):
            steps = epochs * math.ceil((int(train.counts[i]) // B * B) / B)
            plus = c_i[k][0, i] - c[k][0] + (x[k][0] - y_i[k][0, i]) / (steps * lr)  # line 12, option II
            new_ci.append(plus if i in S else c_i[k][0, i])
            deltas.append(plus - c_i[k][0, i])
        torch.testing.assert_close(state.client["control"][k][0], torch.stack(new_ci))
        new_c = c[k][0] + len(S) / 4 * sum(deltas[i] for i in S) / len(S)  # line 17: c + |S|/N Δc
        new_x = x[k][0] + sum(y_i[k][0, i] - x[k][0] for i in S) / len(S)  # line 17: x + Δx, η_g = 1
        torch.testing.assert_close(state.server["control"][k][0], new_c)
        torch.testing.assert_close(state.server["global"][k][0], new_x)
        torch.testing.assert_close(state.params[k][0], new_x.expand_as(state.params[k][0]))


# -- MOON -----------------------------------------------------------------------------------------------------------
def test_moon_loss_is_eq3_eq4():
    algo, params, buffers = setup("moon")
    params["proj0.bias"] = params["proj0.bias"] + 2  # no all-zero projection, where the cosine is undefined
    x, y, mask = batch()
    glob, prev = perturbed(params, seed=6), perturbed(params, seed=7)
    frozen = {"global": glob, "prev": prev, "global_buffers": buffers, "prev_buffers": buffers}  # no BN: empty
    loss, _ = algo.local_loss(params, buffers, x, y, mask, hp(mu=2.0, tau=0.5) | frozen)
    rows = [n for n in range(len(y)) if mask[n]]
    con = 0
    for n in rows:
        z = project(params, x[n])
        pos = torch.exp(cosine(z, project(glob, x[n])) / 0.5)
        neg = torch.exp(cosine(z, project(prev, x[n])) / 0.5)
        con = con - torch.log(pos / (pos + neg))  # eq. 3
    expected = mean_ce(params, x, y, mask) + 2.0 * con / len(rows)  # eq. 4: ℓ_sup + μ ℓ_con
    assert abs(float(loss) - float(expected)) < 1e-5


def test_moon_keeps_the_trained_model_of_participants_as_previous(data):
    train, test = data
    algo = create("moon")
    eng = Engine(algo, [config(algo)], train, test)
    state = eng.init_state()
    old_prev = {k: v.clone() for k, v in state.client["prev"].items()}
    trained = perturbed(state.params, seed=8)
    state.params = dict(trained)
    part = torch.tensor([[True, False, False, True]])
    algo, now = eng.algo, eng.round_context(0, part)
    algo.after_local(state, now)  # the server side in the engine's order
    server = algo.aggregate(algo.upload(state, now), train.counts[None].float() * part, state, now)
    algo.download(state, server, now)
    for k in trained:
        for i in range(4):
            expected = trained[k][0, i] if part[0, i] else old_prev[k][0, i]
            torch.testing.assert_close(state.client["prev"][k][0, i], expected)
        torch.testing.assert_close(state.server["global"][k][0], server[k][0])


def test_moon_frozen_models_normalise_with_their_own_bn_statistics(data):
    """With bn=True the global model runs with the downloaded running statistics and the previous model with those
    its training left, not with the training model's drifting ones: the loss does not depend on the latter."""
    train, test = data
    algo = create("moon")
    eng = Engine(algo, [config(algo, bn=True, rounds=1)], train, test)
    eng.run()
    state, algo = eng.state, eng.algo
    for k, v in state.buffers.items():
        if v.is_floating_point():
            torch.testing.assert_close(state.server["global_buffers"][k], v[:, 0])  # the downloaded statistics
            prev = state.client["prev_buffers"][k][0]  # [C, ...] each client's own, from its training
            assert not torch.allclose(prev[0], prev[1]) and not torch.allclose(prev[0], v[0, 0])
    ctx = torch.utils._pytree.tree_map(lambda t: t[0, 1], algo.context(state, eng.round_context(1)))
    params = {k: v[0, 1] for k, v in state.params.items()}
    buffers = {k: v[0, 1] for k, v in state.buffers.items()}
    drifted = {k: v * 3 + 1 if v.is_floating_point() else v for k, v in buffers.items()}
    x, y = train.features[1, :16], train.labels[1, :16]
    first, _ = algo.local_loss(params, buffers, x, y, y >= 0, ctx)
    second, _ = algo.local_loss(params, drifted, x, y, y >= 0, ctx)
    assert float(first) == float(second)
    ctx["global_buffers"] = drifted  # the control: the frozen models' statistics do move the loss
    assert float(algo.local_loss(params, buffers, x, y, y >= 0, ctx)[0]) != float(first)


def test_moon_first_round_equals_fedavg(data):
    """In round 1 the previous and global models coincide, so ℓ_con has zero gradient."""
    train, test = data
    runs = {}
    for name in ("moon", "fedavg"):
        algo = create(name)
        eng = Engine(algo, [config(algo, rounds=1)], train, test)
        eng.run()
        runs[name] = eng.state.params
    for k, v in runs["fedavg"].items():
        torch.testing.assert_close(runs["moon"][k], v)


# -- parameter sharing: FedBN, FedPer, FedRep, FedRoD, Local ---------------------------------------------------------
@pytest.mark.parametrize(
    "name, shared, over",
    [
        ("fedbn", {"proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias"}, {}),
        ("fedper", {"proj0.weight", "proj0.bias"}, {}),
        ("fedrep", {"proj0.weight", "proj0.bias"}, {"head_epochs": 2}),
        ("fedrod", {"proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias"}, {}),
        ("local", set(), {}),
        ("ditto", {"proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias"}, {}),
    ],
)
def test_shares_exactly_its_papers_parameters(name, shared, over, data):
    eng = run(name, data, **over)
    assert set(eng.algo.upload(eng.state, eng.last_round)) == shared
    local = set(eng.state.params) - shared
    assert local, f"{name} keeps nothing local"
    for k, v in eng.state.params.items():
        assert same_across_clients(v) == (k in shared), k
    assert eng.out["upload_floats"][0] == sum(eng.state.params[k][0, 0].numel() for k in shared)


def test_fedbn_keeps_bn_parameters_and_statistics_local(data):
    eng = run("fedbn", data)
    assert {k for k in eng.state.params if ".bn." in k} == {"proj0.bn.weight", "proj0.bn.bias"}
    for k, v in eng.state.buffers.items():  # running statistics: each client's own
        assert not same_across_clients(v), k


def test_fedrep_trains_head_then_body(data):
    train, test = data
    eng = Engine(create("fedrep"), [config(create("fedrep"), head_epochs=10, local_epochs=1)], train, test)
    algo, at = eng.algo, lambda e: eng.round_context(0, epoch=e)
    assert algo.local_epochs() == 11
    assert [algo.trainable("cls0.weight", at(e)) for e in (0, 9, 10)] == [True, True, False]
    assert [algo.trainable("proj0.weight", at(e)) for e in (0, 9, 10)] == [False, False, True]
    for head_epochs, body_epochs, changed in [(2, 0, {"cls0"}), (0, 1, {"proj0"})]:
        algo = create("fedrep")
        # local_epochs=0 (the head's phase alone) is below the engine's range: set after resolving, for this check
        eng = Engine(algo, [config(algo, head_epochs=head_epochs) | {"local_epochs": body_epochs}], train, test)
        state = eng.init_state()
        before = {k: v.clone() for k, v in state.params.items()}
        eng.local_train(state, 0, torch.ones(1, 4, dtype=torch.bool))
        for k, v in state.params.items():
            assert (not torch.equal(v, before[k])) == (k.split(".")[0] in changed), k


def test_local_client_model_ignores_everyone_elses_data(data):
    train, test = data
    together = run("local", data)
    assert together.out["upload_floats"] == [0, 0]
    g = torch.Generator().manual_seed(11)
    for c in range(train.features.shape[0]):  # replace every other client's data; client c must not notice
        others = (torch.arange(len(train.counts)) != c)[:, None]  # [C, 1]
        features = torch.where(others[..., None], torch.randn(train.features.shape, generator=g), train.features)
        labels = torch.where(others & (train.labels >= 0), (train.labels + 1) % train.num_classes, train.labels)
        alone = run("local", (ClientData(features, labels, train.counts, train.num_classes), test))
        out = alone.out
        torch.testing.assert_close(out["acc"][:, 0, c], together.out["acc"][:, 0, c])
        for k, v in alone.state.params.items():
            torch.testing.assert_close(v[0, c], together.state.params[k][0, c])
            assert not torch.equal(v[0, c - 1], together.state.params[k][0, c - 1])


# -- FedRoD ---------------------------------------------------------------------------------------------------------
def test_fedrod_losses_are_balanced_softmax_and_personal_ce():
    algo, params, buffers = setup("fedrod")
    params = perturbed(params, seed=9)  # the personal head starts as a copy of the generic one: make them differ
    x, y, mask = batch()
    y = torch.tensor([1, 2, 1, 2, -1])  # class 0 absent from this client
    counts = torch.tensor([0.0, 3.0, 5.0])  # n_c over the client's training set
    loss, _ = algo.local_loss(params, buffers, x, y, mask, hp() | {"class_counts": counts})
    rows = [n for n in range(len(y)) if mask[n]]
    bsm = pce = 0
    for n in rows:
        z = project(params, x[n])
        g, p = classify(params, z), classify(params, z, "pcls0")
        bsm = bsm + neg_log_softmax(g, int(y[n]), prior=counts.tolist())  # −log n_y e^{g_y} / Σ n_c e^{g_c}
        pce = pce + neg_log_softmax([gk + pk for gk, pk in zip(g, p)], int(y[n]))
    assert torch.isfinite(loss)
    assert abs(float(loss) - float((bsm + pce) / len(rows))) < 1e-5
    scores = algo.predict(params, buffers, x[:1], {})
    z = project(params, x[0])
    expected = [a + b for a, b in zip(classify(params, z), classify(params, z, "pcls0"))]
    torch.testing.assert_close(scores[0], torch.stack(expected))


def test_fedrod_personal_head_does_not_train_the_shared_model():
    algo, params, buffers = setup("fedrod")
    params = perturbed(params, seed=9)  # the personal head starts as a copy of the generic one: make them differ
    x, y, mask = batch()
    counts = torch.tensor([2.0, 3.0, 5.0])
    ours = grad(lambda p: algo.local_loss(p, buffers, x, y, mask, hp() | {"class_counts": counts})[0])(params)
    rows = [n for n in range(len(y)) if mask[n]]
    leaf = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    bsm = sum(neg_log_softmax(classify(leaf, project(leaf, x[n])), int(y[n]), counts.tolist()) for n in rows)
    bsm.backward()  # body and generic head: only the balanced softmax
    for k in ("proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias"):
        torch.testing.assert_close(ours[k], leaf[k].grad / len(rows))
    fixed = {k: v.detach() for k, v in params.items() if not k.startswith("pcls")}
    head = {k: v.clone().requires_grad_(True) for k, v in params.items() if k.startswith("pcls")}
    pce = 0
    for n in rows:
        z = project(fixed, x[n])
        logits = [gk + pk for gk, pk in zip(classify(fixed, z), classify(head, z, "pcls0"))]
        pce = pce + neg_log_softmax(logits, int(y[n]))
    pce.backward()  # personal head: only the CE of the (detached) generic + personal logits
    for k in head:
        torch.testing.assert_close(ours[k], head[k].grad / len(rows))


def test_fedrod_trains_a_client_that_lacks_classes():
    train, test = synthetic_clients(seed=0), synthetic_clients(seed=1)
    labels = torch.where(train.labels == 0, 1, train.labels)  # class 0 gone everywhere: log n_0 = −inf
    skewed = ClientData(train.features, labels, train.counts, train.num_classes)
    algo = create("fedrod")
    cfg = config(algo, rounds=1, batch_size=7, drop_last=False)  # last batches hold padding rows
    out = Engine(algo, [cfg], skewed, test).run()
    assert torch.isfinite(out["acc"]).all()
