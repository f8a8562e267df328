"""FedProto and FedProc: local losses equal direct transcriptions of the papers' equations, the server averages
prototypes (and, for FedProc, parameters) as the papers say, and the variants (inference, α schedules, privacy
noise) behave."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import configure

from featcache.algorithms import create
from featcache.training.config import resolve
from featcache.training.engine import Engine
from featcache.errors import UserError
from tests.synthetic import synthetic_clients

TRAIN, TEST = synthetic_clients(C=3, n=(10, 16), D=6, K=4, seed=0), synthetic_clients(C=3, n=(10, 16), D=6, K=4, seed=1)


def make(name: str, seeds=(0,), **over):
    """An engine on the small synthetic clients, its (bound) algorithm and its initial state."""
    base = configure(name, **{"proj_dim": 5, "rounds": 4, "batch_size": 4} | over)
    cfgs = [base | {"seed": s} for s in seeds]
    eng = Engine(create(name), cfgs, TRAIN, TEST)
    return eng.algo, eng, eng.init_state()


def bound(name: str, **over):
    """Algorithm `name` bound to the defaults plus `over`, and that configuration."""
    cfg = configure(name, **over)
    return create(name, cfg), cfg


def tiny_batch(D=3, K=3, B=5):
    """x [B, D], labels with one padding row, and its mask."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, D, generator=g)
    y = torch.tensor([0, 2, 1, 2, -1])
    return x, y, y >= 0, g


def ce_row(logits: torch.Tensor, label: int) -> torch.Tensor:
    return -torch.log(torch.exp(logits[label]) / sum(torch.exp(logits[k]) for k in range(len(logits))))


# -- FedProto ---------------------------------------------------------------------------------------------------
def test_fedproto_loss_is_ce_plus_lambda_times_prototype_distance():
    x, y, mask, g = tiny_batch()
    algo, cfg = bound("fedproto", proj_dim=4)
    params, buffers = algo.init(cfg, 3, 3, g)
    glob = torch.randn(3, 4, generator=g)  # [K, d]
    has = torch.tensor([True, False, True])  # class 1 has no global prototype yet
    lam = 0.7
    ctx = {"hp": {"lam": torch.tensor(lam)}, "prototypes": glob, "has": has}
    loss, _ = algo.local_loss(params, buffers, x, y, mask, ctx)

    ce, reg, n = 0.0, 0.0, 0
    for j in range(len(y)):
        if not mask[j]:
            continue
        label = int(y[j])
        z = torch.relu(params["proj0.weight"] @ x[j] + params["proj0.bias"])
        ce = ce + ce_row(params["cls0.weight"] @ z + params["cls0.bias"], label)
        if has[label]:
            reg = reg + sum((z[i] - glob[label, i]) ** 2 for i in range(4)) / 4  # nn.MSELoss over the d entries
        n += 1
    torch.testing.assert_close(loss, ce / n + lam * reg / n)


def test_fedproto_round_one_is_plain_cross_entropy():
    algo, eng, state = make("fedproto")
    assert not state.server["has"].any()
    ctx = {"hp": {"lam": torch.tensor(5.0)}, "prototypes": state.server["prototypes"][0], "has": state.server["has"][0]}
    params = {k: v[0, 0] for k, v in state.params.items()}
    x, y = TRAIN.features[0], TRAIN.labels[0]
    with_reg, _ = algo.local_loss(params, {}, x, y, TRAIN.mask[0], ctx)
    fedavg = create("fedavg", configure("fedavg", **{k: v for k, v in algo.cfg.items() if k in ("proj_dim", "bn")}))
    plain, _ = fedavg.local_loss(params, {}, x, y, TRAIN.mask[0], {})
    torch.testing.assert_close(with_reg, plain)


def test_fedproto_server_averages_prototypes_over_owning_participants():
    algo, eng, state = make("fedproto")
    g = torch.Generator().manual_seed(1)
    previous = torch.randn(1, 4, 5, generator=g)  # [H, K, d]
    state.server = {"prototypes": previous, "has": torch.tensor([[False, True, False, False]])}
    protos = torch.randn(1, 3, 4, 5, generator=g)  # [H, C, K, d]
    counts = torch.tensor(
        [[[2.0, 0.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 4.0, 5.0]]]
    )  # class 1: nobody; 3: client 2
    weights = torch.tensor([[10.0, 20.0, 0.0]])  # client 2 sits this round out
    server = algo.aggregate({"protos": protos, "counts": counts}, weights, state, eng.round_context(0, weights > 0))
    for k in range(4):
        owners = [i for i in range(3) if counts[0, i, k] > 0 and weights[0, i] > 0]
        expect = sum(protos[0, i, k] for i in owners) / len(owners) if owners else previous[0, k]  # unweighted
        torch.testing.assert_close(server["prototypes"][0, k], expect)
    assert server["has"].tolist() == [[True, True, True, False]]


def test_fedproto_shares_no_parameters():
    algo, eng, state = make("fedproto")
    eng.run()
    assert set(algo.upload(eng.state, eng.last_round)) == {"protos", "counts"}
    w = eng.state.params["cls0.weight"]  # [H, C, K, d]
    assert not torch.allclose(w[0, 0], w[0, 1])  # personalised heads
    assert eng.state.server["has"].all()


def test_fedproto_inference_options():
    """infer=proto-all (PFLlib's reading): nearest global prototype over every class; infer=proto, the released
    code's own-classes reading, is tested against its transcription in test_algo_official.py."""
    algo, eng, state = make("fedproto", infer="proto-all")
    g = torch.Generator().manual_seed(2)
    glob = torch.randn(4, 5, generator=g)
    has = torch.tensor([True, True, False, True])
    params = {k: v[0, 0] for k, v in state.params.items()}
    x = TEST.features[0, :7]
    ctx = {"prototypes": glob, "has": has}
    pred = algo.predict(params, {}, x, ctx).argmax(-1)
    for j in range(len(x)):
        z = torch.relu(params["proj0.weight"] @ x[j] + params["proj0.bias"])
        dist = {k: float(((z - glob[k]) ** 2).sum()) for k in range(4) if has[k]}
        assert int(pred[j]) == min(dist, key=dist.get)
    algo = algo.bind(dict(algo.cfg) | {"infer": "classifier"})
    logits = torch.relu(x @ params["proj0.weight"].T + params["proj0.bias"]) @ params["cls0.weight"].T
    torch.testing.assert_close(algo.predict(params, {}, x, ctx), logits + params["cls0.bias"])
    with pytest.raises(UserError, match="infer must be one of classifier, proto, proto-all .got 'protos'"):
        resolve(create("fedproto"), {"infer": "protos"})


@pytest.mark.parametrize("kind, spread", [("gaussian", lambda e: e.std()), ("laplace", lambda e: e.abs().mean())])
def test_fedproto_privacy_noise_scale_and_seed(kind, spread):
    over = {"proj_dim": 200, "proto_noise_scale": 0.2, "proto_noise_p": 0.1}
    algo, eng, state = make("fedproto", proto_noise=kind, **over)
    r0 = eng.round_context(0)
    algo.after_local(state, r0)
    clean = state.client["protos"]  # [H, C, K, d]
    noisy = algo.upload(state, r0)["protos"]
    noise = noisy - 0.9 * clean  # C~ = (1 - p) C + e
    assert abs(float(spread(noise)) - 0.2) < 0.02  # std of N(0, s), mean |e| of Laplace(0, s): both s
    torch.testing.assert_close(algo.upload(state, r0)["protos"], noisy)  # same seed and round, same noise
    assert not torch.allclose(algo.upload(state, eng.round_context(1))["protos"], noisy)  # fresh noise every round
    other, eng2, state2 = make("fedproto", seeds=(1,), proto_noise=kind, **over)
    other.after_local(state2, eng2.round_context(0))
    assert not torch.allclose(
        other.upload(state2, eng2.round_context(0))["protos"] - 0.9 * state2.client["protos"], noise
    )
    plain, eng3, state3 = make("fedproto", **over)
    plain.after_local(state3, eng3.round_context(0))
    torch.testing.assert_close(plain.upload(state3, eng3.round_context(0))["protos"], clean)


# -- FedProc ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("normalize", [False, True])
def test_fedproc_loss_is_eq_2_with_eq_4(normalize):
    x, y, mask, g = tiny_batch()
    algo, cfg = bound("fedproc", proj_dim=4, normalize=normalize)
    params, buffers = algo.init(cfg, 3, 3, g)
    centres = torch.randn(3, 4, generator=g)  # [K, Q] global class prototypes
    alpha, tau = 0.3, 0.5
    ctx = {"hp": {"tau": torch.tensor(tau)}, "alpha": torch.tensor(alpha), "prototypes": centres}
    loss, _ = algo.local_loss(params, buffers, x, y, mask, ctx)

    total, n = 0.0, 0
    for j in range(len(y)):
        if not mask[j]:
            continue
        label = int(y[j])
        h = torch.relu(params["proj0.weight"] @ x[j] + params["proj0.bias"])
        z = params["proj1.weight"] @ h + params["proj1.bias"]
        if normalize:
            z = z / z.norm()
        sim = [float(z @ centres[k] / (z.norm() * centres[k].norm())) / tau for k in range(3)]
        others = sum(math.exp(sim[k]) for k in range(3) if k != label)
        l_gpc = -math.log(math.exp(sim[label]) / (math.exp(sim[label]) + others))  # eq. 4
        l_ce = ce_row(params["cls0.weight"] @ z + params["cls0.bias"], label)
        total = total + alpha * l_gpc + (1 - alpha) * l_ce  # eq. 2
        n += 1
    torch.testing.assert_close(loss, total / n)


@pytest.mark.parametrize(
    "schedule, expect",
    [
        ("linear", lambda t, T: 1 - t / T),
        ("fixed", lambda t, T: 0.5),
        ("two-stage", lambda t, T: 1.0 if t < T / 2 else 0.0),
        ("official", lambda t, T: 0.0 if t == 0 else 1 - min(t / 100, 1)),
    ],
)
def test_fedproc_alpha_schedule(schedule, expect):
    algo, eng, state = make("fedproc", seeds=(0, 1), rounds=10, alpha_schedule=schedule)
    for t in range(10):
        alpha = algo.context(state, eng.round_context(t))["alpha"]
        assert alpha.shape == (2, 3)
        torch.testing.assert_close(alpha, torch.full((2, 3), expect(t, 10)))
    with pytest.raises(UserError, match="alpha_schedule must be one of"):
        resolve(create("fedproc"), {"alpha_schedule": "cosine"})


def test_fedproc_two_stage_trains_features_then_classifier():
    algo, eng, state = make("fedproc", rounds=2, alpha_schedule="two-stage", weight_decay=1e-2)
    everyone = torch.ones(1, 3, dtype=torch.bool)
    for rnd, frozen, moving in [(0, "cls0.weight", "proj0.weight"), (1, "proj0.weight", "cls0.weight")]:
        before = {k: v.clone() for k, v in state.params.items()}
        eng.local_train(state, rnd, everyone)
        torch.testing.assert_close(state.params[frozen], before[frozen], rtol=0, atol=0)
        assert not torch.allclose(state.params[moving], before[moving])


def test_fedproc_initial_prototypes_come_from_the_initial_model():
    algo, eng, state = make("fedproc")
    params = {k: v[0, 0] for k, v in state.params.items()}  # every client starts from the same model
    for k in range(4):
        means = []
        for c in range(3):
            rows = [j for j in range(int(TRAIN.counts[c])) if TRAIN.labels[c, j] == k]
            if rows:
                z = [
                    params["proj1.weight"]
                    @ torch.relu(params["proj0.weight"] @ TRAIN.features[c, j] + params["proj0.bias"])
                    + params["proj1.bias"]
                    for j in rows
                ]
                means.append(sum(z) / len(z))
        torch.testing.assert_close(state.server["prototypes"][0, k], sum(means) / len(means))


@pytest.mark.parametrize("name", ["fedproc", "fedproc-official"])
def test_fedproc_server_fedavgs_the_model_and_averages_prototypes(name):
    algo, eng, state = make(name)
    g = torch.Generator().manual_seed(4)
    state.params = {k: torch.randn(v.shape, generator=g) for k, v in state.params.items()}  # [H, C, ...]
    state.client["protos"] = torch.randn(1, 3, 4, 5, generator=g)
    state.client["counts"] = torch.tensor([[[2.0, 1.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0], [1.0, 4.0, 2.0, 5.0]]])
    weights = torch.tensor([[10.0, 30.0, 0.0]])  # sample counts x participation
    now = eng.round_context(0, weights > 0)
    uploads = algo.upload(state, now)
    assert set(uploads) == set(state.params) | {"protos", "counts"}
    server = algo.aggregate(uploads, weights, state, now)
    for k, v in state.params.items():  # Alg. 1 line 10: Σ |D_i| / |D| w_i over the participants
        torch.testing.assert_close(server["params"][k][0], (10 * v[0, 0] + 30 * v[0, 1]) / 40)
    p, n = state.client["protos"][0], state.client["counts"][0]
    for k in range(3):  # every participant owns classes 0..2
        expect = {
            "fedproc": (p[0, k] + p[1, k]) / 2,  # Alg. 1 line 9: 1/m Σ_i c_i
            "fedproc-official": (n[0, k] * p[0, k] + n[1, k] * p[1, k]) / (n[0, k] + n[1, k]),
        }[name]
        torch.testing.assert_close(server["protos"]["prototypes"][0, k], expect)
    torch.testing.assert_close(server["protos"]["prototypes"][0, 3], state.server["prototypes"][0, 3])  # kept
    algo.download(state, server, now)
    for k, v in state.params.items():
        torch.testing.assert_close(v[0], server["params"][k][0].expand_as(v[0]))  # every client gets the global model


@pytest.mark.parametrize("name", ["fedproto", "fedpcl"])
def test_after_local_recomputes_only_the_participants_prototypes(name):
    """Only the round's participants train, so only their prototypes change: after_local computes theirs (the
    same numbers a pass over every client gives them) and leaves the others' in place."""
    from featcache.algorithms.protos import local_prototypes

    algo, eng, state = make(name, seeds=(0, 1), participation=0.67)
    state.client["protos"], state.client["counts"] = local_prototypes(algo, state, TRAIN)
    part = [[True, False, True], [False, True, True]]
    eng.local_train(state, 0, part)
    now = eng.round_context(0, part)
    assert now.clients.tolist() == [[0, 2], [1, 2]]
    kept = state.client["protos"].clone()
    everyone, _ = local_prototypes(algo, state, TRAIN)  # [H, C, K, d]
    algo.after_local(state, now)
    sat_out = ~torch.tensor(part)  # [H, C]
    assert torch.equal(state.client["protos"][sat_out], kept[sat_out])
    torch.testing.assert_close(state.client["protos"], everyone, rtol=0, atol=1e-6)
    assert not torch.equal(state.client["protos"][~sat_out], kept[~sat_out])  # the participants' moved
