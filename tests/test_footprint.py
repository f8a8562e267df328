"""The memory estimate made before a run (featcache/training/footprint.py): by lifetime, from the algorithm's own
declarations replayed on its clients; and the refusal that names the setting to lower. Never timed."""

from __future__ import annotations

import pytest
import torch
from conftest import configure

from featcache.algorithms import create, list_algorithms
from featcache.algorithms.base import FedAvg
from featcache.errors import UserError
from featcache.testing import synthetic_clients
from featcache.training import footprint
from featcache.training.footprint import check_memory, estimate, participants
from featcache.training.optim import OPTIMIZERS

D, K = 32, 5


def clients(C: int, views: int = 0, seed: int = 0):
    return synthetic_clients(C=C, n=(20, 30), D=D, K=K, seed=seed, views=views)


def test_the_estimate_is_deterministic_and_adds_up():
    algo, cfg = create("fedpcl"), configure("fedpcl", batch_size=8)
    a, b = estimate(algo, cfg, clients(6), clients(6, seed=1)), estimate(algo, cfg, clients(6), clients(6, seed=1))
    assert a == b and a.traced
    assert a.total(3) == a.data + 3 * (a.state + a.training + a.uploads + a.evaluation)
    assert a.per_config == a.total(1) - a.data
    assert a.data == sum(
        t.numel() * t.element_size() for d in (clients(6), clients(6, seed=1)) for t in (d.features, d.labels, d.counts)
    )


def test_training_tensors_scale_with_the_participants_and_state_does_not():
    algo, cfg = create("fedprox"), configure("fedprox", batch_size=8)
    data = clients(20)
    few, many, all_ = (estimate(algo, cfg, data, P=P) for P in (2, 10, 20))
    assert many.training == 5 * few.training > 0
    assert (few.state, few.evaluation, few.data) == (many.state, many.evaluation, many.data)  # (P = C: see below)
    params, _ = algo.init(cfg, D, K, torch.Generator().manual_seed(0))
    n = sum(p.numel() * 4 for p in params.values())
    assert all_.training == 10 * few.training - 20 * n  # all train at once: their working copies are the state
    assert few.training >= 2 * n * (1 + len(OPTIMIZERS["adam"].state_names))  # working copies and Adam's two moments
    assert (
        estimate(algo, configure("fedprox", batch_size=8, optimizer="sgd"), data, P=2).training == few.training - 2 * n
    )  # SGD keeps one moment


@pytest.mark.parametrize("name, personal", [("fedavg", ()), ("fedper", ("cls0.weight", "cls0.bias"))])
def test_a_fedavg_server_keeps_the_shared_tensors_once_when_not_everyone_trains(name, personal):
    """State: the shared tensors once per configuration, the personal ones per client (P < C); every client's
    copy of everything when all of them train (their trained models are all live at once)."""
    algo, data = create(name), clients(20)
    cfg = configure(name, batch_size=8)
    params, _ = algo.init(cfg, D, K, torch.Generator().manual_seed(0))
    n = sum(p.numel() * 4 for p in params.values())
    own = sum(params[k].numel() * 4 for k in personal)
    few, all_ = estimate(algo, cfg, data, P=2), estimate(algo, cfg, data, P=20)
    assert few.state == 20 * own + (n - own) and all_.state == 20 * n


def test_state_scales_with_the_clients_and_holds_fedpcls_prototypes():
    cfg = configure("fedavg", batch_size=8)
    ten, twenty = (estimate(create("fedavg"), cfg, clients(C), P=C) for C in (10, 20))
    assert twenty.state == 2 * ten.state and twenty.training == 2 * ten.training  # FedAvg keeps only parameters
    cfg = configure("fedpcl", batch_size=8)
    pcl, d = estimate(create("fedpcl"), cfg, clients(10), P=1), cfg["proj_dim"]
    # its own prototypes [C, K, d] and the server's padded sets [C, K, d]; the parameters lack the classifier
    params = (D * d + d) * 4 + 4 * d * 4  # FC(D, d) and BN's weight, bias, running mean and variance
    assert pcl.state >= 10 * params + 2 * 10 * K * d * 4


def test_participants_come_from_the_configuration():
    data = clients(50)
    assert estimate(create("fedavg"), configure("fedavg", participation=0.1), data).participants == 5
    assert participants(configure("fedavg", participation=0.001), 50) == 1  # at least one
    assert participants(configure("fedavg"), 50) == 50
    # a model whose optimizer lives for the whole run trains at width C, the absent ones masked (as the engine)
    assert estimate(create("pfedgate"), configure("pfedgate", participation=0.1), data).participants == 50


@pytest.mark.parametrize("name", sorted(list_algorithms()))
def test_every_built_in_algorithm_is_traced(name):
    """Its state, step and evaluation are estimated from its hooks, not left out."""
    algo = create(name)
    f = estimate(algo, configure(name, batch_size=8), clients(4, views=2 if algo.uses_views else 0))
    assert f.traced and f.training > 0 and f.evaluation > 0


@pytest.mark.parametrize("name", sorted(list_algorithms()))
def test_a_raised_size_setting_is_replayed_on_the_meta_device_to_the_same_estimate(name, monkeypatch):
    """A size setting above its default may ask for more memory than there is: the replay then runs on shapes only
    (nothing allocated) and gives what the real replay gives: the same state and uploads, the step and evaluation
    within 1 %, or 20 % where a hook's loop runs until values converge (FedETF's adaptation: meta tensors hold no
    values, so it stops at another step)."""
    algo, made = create(name), []
    key = next(k for k in footprint.SIZE_SETTINGS if k != "batch_size" and k in configure(name))
    cfg = configure(name, batch_size=8, participation=0.5, **{key: 2 * configure(name)[key]})
    data = clients(20, views=2 if algo.uses_views else 0)
    original = footprint._traced
    spy = lambda algo, cfg, model, train, test: (
        made.append(train.features.device.type) or original(algo, cfg, model, train, test)
    )
    monkeypatch.setattr(footprint, "_traced", spy)
    meta = estimate(algo, cfg, data)
    monkeypatch.setattr(footprint, "_grown", lambda algo, cfg: [])
    real = estimate(algo, cfg, data)
    assert made == ["meta", "cpu"] and meta.traced and real.traced
    assert (meta.state, meta.uploads, meta.data) == (real.state, real.uploads, real.data)
    close = 0.2 if name == "fedetf" else 0.01
    assert abs(meta.training / real.training - 1) < close and abs(meta.evaluation / real.evaluation - 1) < close


def test_clients_whose_models_would_fill_the_memory_are_replayed_on_the_meta_device(monkeypatch):
    """The replay makes every client's state for real only where their models take at most 1/REPLAY_SHARE of the
    available memory; past that, shapes only, to the same estimate."""
    algo, cfg, data, made = create("fedpcl"), configure("fedpcl", batch_size=8), clients(20), []
    original = footprint._traced
    spy = lambda algo, cfg, model, train, test: (
        made.append(train.features.device.type) or original(algo, cfg, model, train, test)
    )
    monkeypatch.setattr(footprint, "_traced", spy)
    real = estimate(algo, cfg, data)
    params, buffers = algo.init(cfg, D, K, torch.Generator().manual_seed(0))
    models = 20 * sum(t.numel() * 4 for t in (*params.values(), *buffers.values()))
    monkeypatch.setattr(footprint, "available_bytes", lambda device: footprint.REPLAY_SHARE * models - 1)
    meta = estimate(algo, cfg, data)
    assert made == ["cpu", "meta"]
    assert (meta.state, meta.uploads, meta.data) == (real.state, real.uploads, real.data)
    assert abs(meta.training / real.training - 1) < 0.01 and abs(meta.evaluation / real.evaluation - 1) < 0.01


class ReadsValues(FedAvg):
    name = "reads-values"

    def local_loss(self, params, buffers, x, y, mask, ctx):
        if float(x.sum()) != 0.0:  # a host read: impossible under vmap
            pass
        return super().local_loss(params, buffers, x, y, mask, ctx)


def test_a_hook_that_fails_leaves_its_terms_out():
    algo, cfg = ReadsValues(), configure("fedavg", batch_size=8)
    f, full = estimate(algo, cfg, clients(4)), estimate(create("fedavg"), cfg, clients(4))
    assert not f.traced and f.state == full.state and 0 < f.training < full.training and f.evaluation == 0


def test_the_refusal_names_the_setting_to_lower(monkeypatch):
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 1024)
    cpu = torch.device("cpu")
    with pytest.raises(
        UserError,
        match=r"fedpcl would need about .* but cpu has 0.0 GiB available: lower proj_dim "
        r"\(now 512, default 256\)",
    ):
        check_memory(create("fedpcl"), configure("fedpcl", proj_dim=512), 2, clients(4), cpu)
    with pytest.raises(UserError, match=r"\(3 model\(s\) x .*: use fewer --seeds$"):
        check_memory(create("fedavg"), configure("fedavg"), 3, clients(4), cpu, "use fewer --seeds")
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 2**40)
    assert (
        check_memory(create("fedavg"), configure("fedavg"), 3, clients(4), cpu)
        == estimate(create("fedavg"), configure("fedavg"), clients(4)).per_config
    )


def test_a_run_that_does_not_fit_trains_its_participants_in_slices_that_do():
    """fit_at_once: None when every participant fits; else the most per pass that fit (the estimate with that many
    within the memory, one more not); the refusal only when not even one does."""
    algo, cfg, data, cpu = create("fedprox"), configure("fedprox", batch_size=8), clients(40), torch.device("cpu")
    full, one = estimate(algo, cfg, data), estimate(algo, cfg, data, at_once=1)
    assert footprint.fit_at_once(algo, cfg, 2, data, cpu, avail=2 * full.per_config) is None
    avail = 2 * (one.per_config + 5 * one.training) + 7  # room for 6 participants per configuration
    S = footprint.fit_at_once(algo, cfg, 2, data, cpu, avail=avail)
    assert S == 6 and estimate(algo, cfg, data, at_once=S).per_config * 2 <= avail
    assert estimate(algo, cfg, data, at_once=S + 1).per_config * 2 > avail
    with pytest.raises(UserError, match=r"fedprox would need about .*: use fewer --seeds$"):
        footprint.fit_at_once(algo, cfg, 2, data, cpu, "use fewer --seeds", avail=one.per_config)
    fedavg, half = create("fedavg"), configure("fedavg", participation=0.5)  # the shared tensors: one, sliced or not
    sliced = estimate(fedavg, half, data, at_once=5)
    assert sliced.state == estimate(fedavg, half, data).state < estimate(fedavg, configure("fedavg"), data).state
    params, _ = fedavg.init(half, D, K, torch.Generator().manual_seed(0))
    n = sum(p.numel() * 4 for p in params.values())
    assert sliced.uploads == 20 * n  # the participants' uploads gathered from the slices
    assert estimate(fedavg, half, data).uploads == 0  # one pass in id order (one step each): the trained tensors


@pytest.mark.slow
def test_bench_scale_quick_prints_every_case_with_its_estimate_and_ratios():
    """bench/scale.py --quick: one JSON object; every case measured (or skipped, saying why) beside its estimate;
    each p < 1 case's round over the p = 1.0 round of its C; the evaluation with kept figures over every client
    scored; the demo-shaped round; the targets as pass/fail."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "bench" / "scale.py"
    done = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    cases = out["cases"]
    assert [(c["algo"], c["clients"], c["participation"]) for c in cases] == [
        (a, C, p) for C in (10, 30) for a in ("fedavg", "fedpcl", "fedprox") for p in (1.0, 0.1)
    ]
    for c in cases:
        assert c["estimate_bytes"] <= c["estimate_every_client_trains_bytes"]
        assert set(c["estimate_parts"]) == {"process", "state", "training", "uploads", "evaluation", "data"}
        if "skipped" in c:
            assert "exceeds" in c["skipped"] and "peak_rss_bytes" not in c
            continue
        assert c["peak_rss_bytes"] > c["process_bytes"] > 0 and c["seconds_per_round"] > 0 and c["eval_seconds"] >= 0
        assert len(c["round_seconds"]) == out["rounds"]
        assert c["estimate_over_peak"] == round(c["estimate_bytes"] / c["peak_rss_bytes"], 3)
        if c["participation"] < 1:
            full = next(
                f for f in cases if (f["algo"], f["clients"], f["participation"]) == (c["algo"], c["clients"], 1.0)
            )
            assert c["round_over_full_participation"] == round(c["seconds_per_round"] / full["seconds_per_round"], 3)
    (ev,) = out["evaluation"]  # FedPCL evaluated every round, kept figures vs every client scored
    assert (ev["clients"], ev["participation"], ev["eval_every"]) == (30, 0.1, 1)
    assert ev["evaluation_reused_over_every_client"] == round(
        ev["reused"]["seconds_per_evaluation"] / ev["every_client"]["seconds_per_evaluation"], 3
    )
    demo = out["demo"]
    assert demo["gflop_per_round"] == pytest.approx(demo["gflop_training"] + demo["gflop_evaluation"], abs=2e-3)
    assert demo["gflop_training"] > 0 and demo["gflop_evaluation"] > 0 and demo["matmul_seconds_per_round"] > 0
    assert demo["round_over_matmul"] > 0 and isinstance(demo["pass_round_over_matmul"], bool)
    targets = out["targets"]
    assert targets["fedavg_peak_gib_C1000_p0.1"] == {"value": None, "target": 3.0, "pass": None}  # C = 1,000 not run
    assert targets["estimate_within_25pct"]["values"] == [
        c["estimate_over_peak"] for c in cases if "peak_rss_bytes" in c
    ]
