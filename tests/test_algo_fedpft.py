"""FedPFT, FedPFT+Con and FedAvg+Linear against transcriptions of the FedPFT paper's equations (Wu et al., ICLR 2025
submission): the FTM equals self-attention over [f, p] (eq. 2), the MoCo loss equals eq. 7, each phase trains only the
parameters of eq. 4/5 (eq. 8/9 for +Con), prompts and the personal linear layer are never uploaded, the server averages
like FedAvg, and Table 1's Origin / Probe / Match accuracies behave."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import configure

from featcache.algorithms import create
from featcache.algorithms.fedpft import VIEWS_ERROR, enqueue, ftm, info_nce
from featcache.training.engine import Engine
from featcache.training.evaluate import evaluate
from featcache.errors import UserError
from featcache.reproduce.analyses import probe_match
from featcache.training.config import settings_of
from featcache.training.optim import group_of
from tests.synthetic import synthetic_clients

NAMES = ["fedpft", "fedpft-con", "fedavg-linear"]
PERSONAL = {
    "fedpft": {"prompt.kappa"},
    "fedpft-con": {"prompt.kappa", "prompt.rho"},
    "fedavg-linear": {"lin.weight", "lin.bias"},
}


def config(algo, **over) -> dict:
    small = {"proj_dim": 8, "n_prompts": 3, "queue": 16, "con_dim": 4}
    return configure(algo, **{k: v for k, v in small.items() if k in settings_of(algo)} | over)


def engine(name, data, **over) -> Engine:
    algo = create(name)
    return Engine(algo, [config(algo, **over)], *data)


# -- eq. 2: the feature transformation module ------------------------------------------------------------------------
def attention_row0(params, f, prompts, heads, residual):
    """Full self-attention over the tokens [f, p_1..p_n], written out token by token; returns the output at f."""
    tokens = [f] + list(prompts)
    proj = lambda name, t: params[f"ftm.{name}.weight"] @ t + params[f"ftm.{name}.bias"]
    q, k, v = ([proj(s, t) for t in tokens] for s in "qkv")
    m = f.shape[0]
    d = m // heads
    out = torch.zeros(m)
    for h in range(heads):
        sl = slice(h * d, (h + 1) * d)
        scores = [float((q[0][sl] * k[j][sl]).sum()) / math.sqrt(d) for j in range(len(tokens))]
        z = sum(math.exp(s) for s in scores)
        for j, s in enumerate(scores):
            out[sl] += math.exp(s) / z * v[j][sl]
    out = params["ftm.o.weight"] @ out + params["ftm.o.bias"]
    return f + out if residual else out


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("residual", [True, False])
def test_ftm_equals_self_attention(heads, residual):
    g = torch.Generator().manual_seed(0)
    m, n, N = 4, 3, 5
    params = {
        f"ftm.{s}.{p}": torch.randn(m, m, generator=g) if p == "weight" else torch.randn(m, generator=g)
        for s in "qkvo"
        for p in ("weight", "bias")
    }
    f, prompts = torch.randn(N, m, generator=g), torch.randn(n, m, generator=g)
    got = ftm(params, f, prompts, heads, residual)  # [N, m]
    want = torch.stack([attention_row0(params, f[i], prompts, heads, residual) for i in range(N)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_ftm_size_matches_table_15():
    """App. N: τ has 0.26M parameters at m = 256 (ResNet-8) — 4m² + 4m."""
    algo = create("fedpft")
    params, _ = algo.init(config(algo, proj_dim=256), 32, 10, torch.Generator().manual_seed(0))
    size = sum(v.numel() for k, v in params.items() if k.startswith("ftm."))
    assert size == 4 * 256**2 + 4 * 256 and round(size / 1e6, 2) == 0.26


# -- eq. 7: MoCo -------------------------------------------------------------------------------------------------------
def test_info_nce_equals_eq7():
    g = torch.Generator().manual_seed(1)
    q, k, queue = (torch.randn(n, 4, generator=g) for n in (3, 3, 6))
    beta = 0.5
    got = info_nce(q, k, queue, beta)
    for i in range(3):
        pos = math.exp(float(q[i] @ k[i]) / beta)
        neg = sum(math.exp(float(q[i] @ queue[j]) / beta) for j in range(6))
        assert abs(float(got[i]) + math.log(pos / (pos + neg))) < 1e-5


def test_enqueue_is_fifo_of_valid_keys():
    queue = torch.arange(10.0).reshape(5, 2)
    keys = -torch.arange(1.0, 7.0).reshape(3, 2)
    new = enqueue(queue, keys, torch.tensor([True, False, True]))
    torch.testing.assert_close(new, torch.stack([keys[0], keys[2], queue[0], queue[1], queue[2]]))


def con_setup(data):
    """A FedPFT+Con model of client 0 with a minibatch: (algo, params, buffers, x, y, mask, ctx), ctx for the
    transformation phase (epoch 0); `phase_ctx(algo, ctx, epoch)` switches it to another epoch's phase."""
    train, _ = data
    eng = engine("fedpft-con", data)
    state = eng.init_state()
    params = {
        k: v[0, 0] + 0.1 * torch.randn(v.shape[2:], generator=torch.Generator().manual_seed(2))
        for k, v in state.params.items()
    }  # away from the initial zeros / shared init
    buffers = {k: v[0, 0] for k, v in state.buffers.items()}
    x, y, views = train.features[0, :6], train.labels[0, :6], train.views[0, :6]  # [6, D], [6], [6, 2, D]
    mask = torch.tensor([True, True, True, True, True, False])
    ctx = {"hp": {k: v[0] for k, v in eng.hp.items()}, "views": views, "transform": torch.tensor(True)}
    return eng.algo, params, buffers, x, y, mask, ctx


def phase_ctx(algo, ctx: dict, epoch: int) -> dict:
    return ctx | {"transform": torch.tensor(algo.phase(epoch) == "transform")}


def test_con_loss_equals_ce_plus_eq7(data):
    algo, params, buffers, x, y, mask, ctx = con_setup(data)
    cfg = algo.cfg
    loss, new = algo.local_loss(params, buffers, x, y, mask, phase_ctx(algo, ctx, 0))  # phase of epoch 0

    relu = lambda p, v: torch.relu(p["proj0.weight"] @ v + p["proj0.bias"])
    ftm_ = lambda f, prompts: attention_row0(params, f, prompts, cfg["heads"], cfg["residual"])
    unit = lambda v: v / v.norm()
    m, beta = float(ctx["hp"]["moco_m"]), float(ctx["hp"]["beta"])  # per-configuration floats
    ema = {
        k: m * buffers[f"ema.{k}"] + (1 - m) * params[k]
        for k in ("proj0.weight", "proj0.bias", "rho0.weight", "rho0.bias")
    }
    terms = []
    for i in range(6):
        if not mask[i]:
            continue
        logits = params["cls0.weight"] @ ftm_(relu(params, x[i]), params["prompt.kappa"]) + params["cls0.bias"]
        ce = -math.log(math.exp(float(logits[y[i]])) / sum(math.exp(float(s)) for s in logits))
        f_q, f_k = relu(params, ctx["views"][i, 0]), relu(ema, ctx["views"][i, 1])
        q = unit(params["rho0.weight"] @ ftm_(f_q, params["prompt.rho"]) + params["rho0.bias"])
        k = unit(ema["rho0.weight"] @ ftm_(f_k, params["prompt.rho"]) + ema["rho0.bias"])
        pos = math.exp(float(q @ k) / beta)
        neg = sum(math.exp(float(q @ buffers["queue"][j]) / beta) for j in range(len(buffers["queue"])))
        terms.append(ce - math.log(pos / (pos + neg)))
        if i == 0:
            torch.testing.assert_close(new["queue"][0], k, rtol=1e-5, atol=1e-5)  # newest key first
    assert abs(float(loss) - sum(terms) / len(terms)) < 1e-4
    for key, v in ema.items():  # MoCo's momentum update of ϕ̃, h̃_ρ
        torch.testing.assert_close(new[f"ema.{key}"], v)
    torch.testing.assert_close(new["queue"][5:], buffers["queue"][:-5])  # 5 valid keys pushed the rest back


def test_con_routes_extractor_gradients_per_phase(data):
    """Eq. 8: in the transformation phase only L_Con trains ϕ; eq. 9: in the model phase only L_CE does."""
    algo, params, buffers, x, y, mask, ctx = con_setup(data)

    def grad_phi(epoch, y_, views):
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss, _ = algo.local_loss(p, buffers, x, y_, mask, phase_ctx(algo, ctx, epoch) | {"views": views})
        return torch.autograd.grad(loss, p["proj0.weight"])[0]

    y2, views2 = (y + 1) % 5, ctx["views"].flip(0)
    transform, model = 0, algo.cfg["r_f"]
    torch.testing.assert_close(grad_phi(transform, y, ctx["views"]), grad_phi(transform, y2, ctx["views"]))
    assert not torch.allclose(grad_phi(transform, y, ctx["views"]), grad_phi(transform, y, views2))
    torch.testing.assert_close(grad_phi(model, y, ctx["views"]), grad_phi(model, y, views2))
    assert not torch.allclose(grad_phi(model, y, ctx["views"]), grad_phi(model, y2, ctx["views"]))


def test_con_needs_views(data):
    for views in (0, 1):
        train = synthetic_clients(seed=0, views=views)
        with pytest.raises(UserError, match=f"^{VIEWS_ERROR}$"):
            engine("fedpft-con", (train, data[1])).init_state()


# -- phases (eq. 4/5, eq. 8/9) -------------------------------------------------------------------------------------
TRAINED = {
    ("fedpft", "transform"): {"prompt.kappa", "ftm."},
    ("fedpft", "model"): {"proj0.", "ftm.", "cls0."},
    ("fedpft-con", "transform"): {"prompt.kappa", "ftm.", "proj0.", "rho0."},
    ("fedpft-con", "model"): {"proj0.", "ftm.", "cls0.", "prompt.rho"},
    ("fedavg-linear", "transform"): {"lin."},
    ("fedavg-linear", "model"): {"proj0.", "cls0."},
}


@pytest.mark.parametrize("name,phase", list(TRAINED))
def test_phase_trains_exactly_its_parameters(name, phase, data):
    r = {"transform": dict(r_f=1, r_a=0, local_epochs=1), "model": dict(r_f=0, r_a=1, local_epochs=1)}[phase]
    eng = engine(name, data, **r)
    state = eng.init_state()
    before = {k: v.clone() for k, v in state.params.items()}
    eng.local_train(state, 0, torch.ones(1, eng.C, dtype=torch.bool))
    changed = {k for k in before if not torch.equal(before[k], state.params[k])}
    expected = {k for k in before if k.startswith(tuple(TRAINED[name, phase]))}
    assert changed == expected


def test_phase_schedule(data):
    eng = engine("fedpft", data)
    algo, lr = eng.algo, float(eng.hp["lr"][0])
    assert [algo.phase(e) for e in range(algo.local_epochs())] == ["transform"] * 4 + ["model"]  # (R_f, R_a) = (4, 1)
    rate = lambda k: lr * algo.cfg.get(group_of(algo.groups, k).lr_scale, 1.0)  # as the optimizer takes it
    assert rate("ftm.q.weight") == pytest.approx(0.05)  # App. D.3
    assert rate("prompt.kappa") == pytest.approx(0.1)


def test_bad_settings_are_user_errors(data):
    with pytest.raises(UserError, match="r_f"):
        engine("fedpft", data, r_f=3, r_a=1).init_state()  # local_epochs 5 != 4
    with pytest.raises(UserError, match="r_f"):
        engine("fedpft", data, r_f=-1, r_a=6).init_state()
    with pytest.raises(UserError, match="heads"):
        engine("fedpft", data, heads=3).init_state()


# -- upload and aggregation (§3.5, Alg. 1) -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_personal_parameters_never_leave_the_client(name, data):
    eng = engine(name, data, rounds=1)
    eng.run()
    state = eng.state
    uploads = eng.algo.upload(state, eng.last_round)
    assert set(uploads) == set(state.params) - PERSONAL[name]
    for k, v in state.params.items():
        same = all(torch.equal(v[0, 0], v[0, c]) for c in range(eng.C))
        assert same == (k not in PERSONAL[name]), k  # shared: identical after download; personal: client's own


@pytest.mark.parametrize("name", NAMES)
def test_server_averages_shared_parameters_by_sample_count(name, data):
    eng = engine(name, data, participation=0.5)
    state = eng.init_state()
    part = torch.tensor([[True, False, True, False]])
    eng.local_train(state, 0, part)
    local = {k: v.clone() for k, v in state.params.items()}
    weights = eng.train.counts[None].float() * part  # [1, C]
    now = eng.round_context(0, part)
    server = eng.algo.aggregate(eng.algo.upload(state, now), weights, state, now)
    eng.algo.download(state, server, now)
    n = eng.train.counts.tolist()
    for k, v in local.items():
        if k in PERSONAL[name]:
            torch.testing.assert_close(state.params[k], v)  # prompts / T_i untouched by the server
        else:
            avg = (n[0] * v[0, 0] + n[2] * v[0, 2]) / (n[0] + n[2])
            for c in range(eng.C):
                torch.testing.assert_close(state.params[k][0, c], avg)


def test_fedavg_linear_starts_as_fedavg(data):
    """T_i = identity at the start: the initial model predicts exactly as FedAvg's (same generator, same layers)."""
    x = data[0].features[0]
    outs = []
    for name in ("fedavg", "fedavg-linear"):
        cfg = config(create(name))
        algo = create(name, cfg)
        params, buffers = algo.init(cfg, x.shape[-1], 5, torch.Generator().manual_seed(3))
        outs.append(algo.predict(params, buffers, x, {}))
    torch.testing.assert_close(outs[0], outs[1])


# -- Table 1: Origin / Probe / Match ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fedavg", "fedpft"])
def test_probe_match(name, data):
    algo = create(name)
    over = {"lr": 0.1} if name == "fedpft" else {}
    eng = Engine(algo, [config(algo, rounds=2, **over)], *data)
    eng.run()
    algo = eng.algo
    untrained = probe_match(algo, eng.state, *data, steps=0)
    torch.testing.assert_close(
        untrained["origin"], evaluate(eng.algo, eng.state, data[1], eng.last_round)
    )  # Fig. 6a = the model
    torch.testing.assert_close(untrained["match"], untrained["origin"])  # identity transform = the model
    trained = probe_match(algo, eng.state, *data, steps=100, lr=0.05)
    assert trained["probe"].shape == (1, eng.C)
    assert trained["probe"].mean() > 0.9 and trained["match"].mean() > 0.9  # separable data, per-client refit
    assert (trained["match"] >= untrained["match"] - 0.05).all()
