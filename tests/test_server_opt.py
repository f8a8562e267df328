"""Server optimizers (featcache/algorithms/serveropt.py): FedAvgM, FedAdagrad, FedYogi, FedAdam.

Their server step is driven through the engine's own hooks (`client_side`, `server_side`) on tiny models with client
models drawn at random, two configurations of different settings at once, partial participation and uneven clients,
and compared with Reddi et al.'s Algorithm 2 written out in float64 and with a transcription of Flower's strategies
of the same names (tests/ref_flower_strategies.py); copies of those strategies broken on purpose must fail the same
comparison. Then: the reductions to FedAvg, exact resume, a grid over server_lr batched on the configuration axis,
and the server optimizer on another algorithm (FedProx)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import configure

import tests.ref_flower_strategies as flower
from featcache.algorithms import create, list_algorithms
from featcache.algorithms.fedprox import FedProx
from featcache.algorithms.serveropt import Adaptive, FedAdam
from featcache.errors import UserError
from featcache.testing import assert_matches_plain_loop, assert_reduces_to, synthetic_clients
from featcache.training.config import batched
from featcache.training.engine import Engine, client_side, server_side
from tests.synthetic import write_cache
from tests.test_resume import assert_resumes_exactly, ctrl_c_reaches_python  # noqa: F401  (autouse: SIGINT reaches Python)

OPTIMIZERS = ("fedavgm", "fedadagrad", "fedyogi", "fedadam")
C, ROUNDS = 5, 5
PART = [[[1, 0, 1, 1, 0], [1, 1, 0, 1, 1]], [[0, 1, 1, 0, 1], [1, 1, 1, 1, 1]]]  # [round % 2][h][c]
SETTINGS = {  # two configurations per optimizer, every continuous setting different
    "fedavgm": [{"server_lr": 1.0, "server_momentum": 0.9}, {"server_lr": 0.5, "server_momentum": 0.3}],
    "fedadagrad": [
        {"server_lr": 0.05, "server_beta1": 0.9, "server_tau": 1e-3},
        {"server_lr": 0.02, "server_beta1": 0.0, "server_tau": 1e-2},
    ],
    "fedyogi": [
        {"server_lr": 0.05, "server_beta1": 0.9, "server_beta2": 0.99, "server_tau": 1e-3},
        {"server_lr": 0.02, "server_beta1": 0.5, "server_beta2": 0.9, "server_tau": 1e-2},
    ],
    "fedadam": [
        {"server_lr": 0.05, "server_beta1": 0.9, "server_beta2": 0.99, "server_tau": 1e-3},
        {"server_lr": 0.02, "server_beta1": 0.5, "server_beta2": 0.9, "server_tau": 1e-2},
    ],
}


def server_rounds(name: str, settings: list[dict], rule: str | None = None):
    """Drive `name`'s server through the engine's hooks for ROUNDS rounds, configurations `settings` (H of them),
    client models drawn at random around x_t. Returns (x_0, per round: (clients' models, weights, x_{t+1})), every
    tree name -> float64 numpy [H, (C,) ...]."""
    algo = create(name)
    train, test = synthetic_clients(C=C, n=(5, 12), D=3, K=2, seed=0), synthetic_clients(C=C, n=(5, 12), D=3, K=2)
    extra = {} if rule is None else {"server_rule": rule}
    cfgs = [configure(algo, proj_dim=2, rounds=ROUNDS, **s, **extra, seed=h) for h, s in enumerate(settings)]
    eng = Engine(algo, cfgs, train, test)
    state, g = eng.state, torch.Generator().manual_seed(7)
    as_np = lambda tree: {k: v.double().numpy().copy() for k, v in tree.items()}
    x0, rounds = as_np(state.server["global"]), []
    for rnd in range(ROUNDS):
        now = eng.round_context(rnd, PART[rnd % 2])
        x = state.server["global"]  # [H, ...]
        state.params = {k: now.expand(v) + 0.1 * torch.randn(2, C, *v.shape[1:], generator=g) for k, v in x.items()}
        weights = train.counts[None].float() * now.part  # [H, C]
        models = as_np(state.params)
        server_side(eng.algo, state, now, client_side(eng.algo, state, now), weights)
        rounds.append((models, weights.double().numpy(), as_np(state.server["global"])))
    return x0, rounds


# -- Reddi et al., Algorithm 2 (and Hsu et al.'s FedAvgM), written out ----------------------------------------------
SECOND_MOMENT = {
    "fedadagrad": lambda v, d2, b2: v + d2,
    "fedyogi": lambda v, d2, b2: v - (1 - b2) * d2 * np.sign(v - d2),
    "fedadam": lambda v, d2, b2: b2 * v + (1 - b2) * d2,
}


def algorithm2(name: str, s: dict, x0: dict, rounds: list, h: int, by_rows: bool | None = None) -> list[dict]:
    """x_1, ..., x_T of configuration h. FedAvgM: Δ_t = Σ_k n_k x_k / Σ n_k − x_t over the participants,
    m_t = β m + Δ_t, x += η m_t; Algorithm 2: Δ_t = 1/|S| Σ_{k∈S} x_k − x_t, m_t = β1 m + (1 − β1) Δ_t, v_t by the
    optimizer's rule from v_{−1} = τ², x += η m_t / (√v_t + τ). `by_rows` swaps the weighting (n_k or uniform)."""
    x = {k: v[h] for k, v in x0.items()}
    m = {k: np.zeros_like(v) for k, v in x.items()}
    v = {k: np.full_like(a, s.get("server_tau", 0.0) ** 2) for k, a in x.items()}
    out = []
    for models, weights, _ in rounds:
        by_n = (name == "fedavgm") if by_rows is None else by_rows
        w = weights[h] if by_n else (weights[h] > 0).astype(float)  # n_k, or uniform over S
        for k in x:
            mean = np.tensordot(w, models[k][h], axes=(0, 0)) / w.sum()
            d = mean - x[k]
            if name == "fedavgm":
                m[k] = s["server_momentum"] * m[k] + d
                x[k] = x[k] + s["server_lr"] * m[k]
            else:
                m[k] = s["server_beta1"] * m[k] + (1 - s["server_beta1"]) * d
                v[k] = SECOND_MOMENT[name](v[k], d * d, s.get("server_beta2"))
                x[k] = x[k] + s["server_lr"] * m[k] / (np.sqrt(v[k]) + s["server_tau"])
        out.append({k: a.copy() for k, a in x.items()})
    return out


def worst(name: str, expected: list[list[dict]], rounds: list) -> float:
    """The largest relative difference between the engine's x_t (every round, configuration, parameter) and
    `expected` [h][t] (inf where either is NaN)."""
    err = 0.0
    for t, (_, _, got) in enumerate(rounds):
        for h, per_round in enumerate(expected):
            for k, want in per_round[t].items():
                rel = np.abs(got[k][h] - want) / (np.abs(want) + 1e-3)
                err = max(err, float(np.max(np.nan_to_num(rel, nan=np.inf))))
    return err


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_server_step_is_algorithm_2(name):
    x0, rounds = server_rounds(name, SETTINGS[name])
    expected = [algorithm2(name, s, x0, rounds, h) for h, s in enumerate(SETTINGS[name])]
    assert worst(name, expected, rounds) < 2e-5  # float32 against float64
    swapped = [algorithm2(name, s, x0, rounds, h, by_rows=name != "fedavgm") for h, s in enumerate(SETTINGS[name])]
    assert worst(name, swapped, rounds) > 1e-3  # the clients' weighting shows on these uneven clients
    moved = max(float(np.abs(rounds[-1][2][k] - x0[k]).max()) for k in x0)
    assert moved > 1e-2  # the server's model moved: the comparison is not between two unchanged models


# -- Flower's strategies ------------------------------------------------------------------------------------------
def flower_settings(name: str, s: dict):
    """The arguments of the Flower strategy `name` for featcache's settings `s`."""
    if name == "fedavgm":
        return {"server_learning_rate": s["server_lr"], "server_momentum": s["server_momentum"]}
    args = {"eta": s["server_lr"], "tau": s["server_tau"]}
    return args if name == "fedadagrad" else args | {"beta_1": s["server_beta1"], "beta_2": s["server_beta2"]}


FLOWER_SETTINGS = SETTINGS | {  # flwr's FedAdagrad has no beta_1 (FedOpt gets 0.0)
    "fedadagrad": [s | {"server_beta1": 0.0} for s in SETTINGS["fedadagrad"]]
}


def flower_run(strategies: dict, name: str, x0: dict, rounds: list) -> list[list[dict]]:
    """Per configuration, the Flower strategy's global model after each round (flwr's server_round = t + 1)."""
    out = []
    for h, s in enumerate(FLOWER_SETTINGS[name]):
        names = list(x0)
        strategy = strategies[name]([x0[k][h] for k in names], **flower_settings(name, s))
        per_round = []
        for t, (models, weights, _) in enumerate(rounds):
            results = [([models[k][h][c] for k in names], int(weights[h][c])) for c in range(C) if weights[h][c] > 0]
            per_round.append(dict(zip(names, strategy.aggregate_fit(t + 1, results))))
        out.append(per_round)
    return out


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_server_rule_flower_is_flowers_strategy_and_a_broken_strategy_is_not(name):
    x0, rounds = server_rounds(name, FLOWER_SETTINGS[name], rule=None if name == "fedavgm" else "flower")
    assert worst(name, flower_run(flower.STRATEGIES, name, x0, rounds), rounds) < 2e-5
    assert worst(name, flower_run(flower.BROKEN, name, x0, rounds), rounds) > 1e-2  # the negative control


def test_the_two_rules_differ_where_flower_differs_from_algorithm_2():
    """v_{−1} = τ² vs 0 and FedAdam's bias correction: the flwr rule is not Algorithm 2 on the same rounds."""
    x0, rounds = server_rounds("fedadam", SETTINGS["fedadam"], rule="flower")
    expected = [algorithm2("fedadam", s, x0, rounds, h) for h, s in enumerate(SETTINGS["fedadam"])]
    assert worst("fedadam", expected, rounds) > 1e-2


# -- reductions, resume, grids --------------------------------------------------------------------------------------
def test_fedavgm_without_momentum_at_rate_1_is_fedavg_bit_for_bit():
    assert set(assert_reduces_to("fedavgm", "fedavg", exact=True, server_momentum=0.0).values()) == {0.0}
    assert set(assert_reduces_to("fedavgm", "fedavg", exact=True, server_momentum=0.0, participation=1.0).values()) == {
        0.0
    }
    with pytest.raises(AssertionError, match="differs from fedavg"):
        assert_reduces_to("fedavgm", "fedavg", server_momentum=0.5)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_engine_equals_the_plain_loop(name):
    assert_matches_plain_loop(name)


@pytest.mark.parametrize(
    "name, extra", [("fedavgm", {}), ("fedadam", {}), ("fedyogi", {"server_rule": "flower", "optimizer": "sgd"})]
)
def test_a_stopped_run_resumes_byte_for_byte(name, extra):
    with tempfile.TemporaryDirectory() as tmp:
        cache = write_cache(Path(tmp) / "c.h5", C=4, D=16, K=3, n=(16, 40), spread=4.0)
        opts = {"participation": 0.5, "batch_size": 8, "proj_dim": 8} | extra
        assert_resumes_exactly(
            cache,
            name,
            [(2, "kill"), (3, "ctrl-c")],
            1,
            rounds=4,
            seeds=[0, 1],
            set=[f"{k}={v}" for k, v in opts.items()],
        )


def test_a_grid_over_server_lr_runs_as_one_batch_and_equals_separate_runs():
    algo = create("fedadam")
    train, test = synthetic_clients(seed=0), synthetic_clients(seed=1)
    lrs = [0.1, 0.01, 0.001]
    cfgs = [configure(algo, proj_dim=8, rounds=3, batch_size=16, participation=0.75, server_lr=lr) for lr in lrs]
    shared, floats = batched(cfgs, algo)  # one bucket: server_lr and the other server settings are [H] tensors
    assert floats["server_lr"] == lrs and "server_lr" not in shared
    assert {"server_beta1", "server_beta2", "server_tau"} <= set(floats)
    together = Engine(algo, cfgs, train, test)
    acc = together.run()["acc"]  # [R, H, C]
    for h, cfg in enumerate(cfgs):
        alone = Engine(algo, [cfg], train, test)
        torch.testing.assert_close(alone.run()["acc"][:, 0], acc[:, h], rtol=0, atol=1e-6)
        for k, v in alone.state.params.items():
            torch.testing.assert_close(v[0], together.state.params[k][h])
    assert not torch.equal(together.state.params["cls0.weight"][0], together.state.params["cls0.weight"][1])


def test_any_fedavg_server_algorithm_takes_a_server_optimizer_by_name():
    algo = create("fedprox+fedadam")  # made by the registry on first use: FedProx's clients, FedAdam's server
    assert type(algo).__mro__[1:3] == (FedAdam, Adaptive) and FedProx in type(algo).__mro__
    assert algo.uses_global and not algo.fedavg_server and create("fedprox+fedadam").name == "fedprox+fedadam"
    assert {"mu", "server_lr", "server_beta2"} <= set(configure("fedprox+fedadam"))
    assert_matches_plain_loop("fedprox+fedadam", mu=0.5)
    assert_reduces_to("moon+fedavgm", "moon", server_momentum=0.0)
    assert "fedprox+fedadam" not in list_algorithms()  # made on use, never listed: `featcache algos` stays the table
    with pytest.raises(UserError, match="fedpcl overrides upload, aggregate, download"):
        create("fedpcl+fedadam")
    with pytest.raises(UserError, match="unknown algorithm 'fedprox\\+fedsgd'"):
        create("fedprox+fedsgd")


def test_a_server_optimizer_steps_on_what_the_algorithm_shares():
    """fedbn+fedadam raised KeyError (its BatchNorm layers never reach the server): the server's step and memory
    cover the shared parameters alone, and FedAvgM at β = 0, η = 1 is FedBN itself."""
    assert_matches_plain_loop("fedbn+fedadam")
    assert set(assert_reduces_to("fedbn+fedavgm", "fedbn", exact=True, server_momentum=0.0).values()) == {0.0}
