"""FedNova: the server step against the paper's eq. 6–7 written out per client (the normaliser ‖a_i‖₁ of App. B for
SGD with and without momentum), the vectorized engine against the plain per-client loop, and `fednova` against a
transcription of NIID-Bench's release (tests/ref_fednova.py) over several rounds at partial participation, with a
broken transcription that fails. Uneven clients throughout: they take different numbers of local steps."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import configure
from harness import release_batches

from featcache.algorithms import create
from featcache.testing import assert_matches_equations, assert_matches_plain_loop, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_fednova


def steps(n: int, cfg: dict) -> int:
    """τ_i: the minibatches a client of n rows takes over its local epochs (a short last batch kept, or dropped unless
    it is the client's only one)."""
    per_epoch = max(1, n // cfg["batch_size"]) if cfg["drop_last"] else math.ceil(n / cfg["batch_size"])
    return cfg["local_epochs"] * per_epoch


def a_norm(tau: int, rho: float) -> float:
    """‖a_i‖₁ of App. B: a_i's k-th entry is (1 − ρ^k)/(1 − ρ) under momentum ρ, 1 under plain SGD."""
    return sum((1 - rho ** (k + 1)) / (1 - rho) for k in range(tau)) if rho else float(tau)


def paper_server(x, clients, n, memory, cfg):
    """Eq. 6–7: d_i = (x − y_i)/‖a_i‖₁, x ← x − (Σ_i p_i ‖a_i‖₁) Σ_i p_i d_i, p_i = n_i / Σ_j n_j."""
    p = [ni / sum(n) for ni in n]
    norms = [a_norm(steps(ni, cfg), cfg["momentum"]) for ni in n]
    assert len(set(norms)) > 1, "the clients should take different numbers of steps"
    tau_eff = sum(pi * ai for pi, ai in zip(p, norms))
    out = {}
    for k in x:
        d = [(x[k].double() - y[k].double()) / ai for y, ai in zip(clients, norms)]
        out[k] = x[k].double() - tau_eff * sum(pi * di for pi, di in zip(p, d))
    return out


def test_closed_form_normaliser_is_the_sum_of_a_i():
    """The closed form fednova computes, [τ − ρ(1 − ρ^τ)/(1 − ρ)]/(1 − ρ), is App. B's Σ_k (1 − ρ^k)/(1 − ρ)."""
    from types import SimpleNamespace

    algo = create("fednova", configure("fednova"))
    rnd = SimpleNamespace(client_steps=torch.tensor([1, 3, 7]), H=2, hp={"momentum": torch.tensor([0.0, 0.9])})
    got = algo.norm(rnd)  # [H, C]
    for h, rho in enumerate((0.0, 0.9)):
        for c, tau in enumerate((1, 3, 7)):
            assert got[h, c].item() == pytest.approx(a_norm(tau, rho), rel=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fednova_server_is_eq6_eq7(momentum):
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults)."""
    assert_matches_equations("fednova", server=paper_server, rounds=2, momentum=momentum)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fednova_equals_the_plain_loop(momentum):
    assert_matches_plain_loop("fednova", rounds=2, momentum=momentum)


C, B, ROUNDS, RATE, RHO, REG = 6, 8, 4, 0.5, 0.5, 1e-3

TRAINED: dict = {}  # algorithm -> its global model after the release comparison's rounds


def release_runs(name: str, broken: bool = False):
    """(featcache's global model after ROUNDS rounds, the transcription's after each round) on uneven clients at
    participation 0.5, SGD with momentum ρ = 0.5 and weight decay, drop_last=False (NIID-Bench's loaders)."""
    train, test = synthetic_clients(C=C, n=(10, 44), D=8, K=4, seed=0), synthetic_clients(C=C, n=(8, 12), D=8, K=4)
    algo = create(name)
    cfg = configure(
        algo,
        proj_dim=8,
        rounds=ROUNDS,
        batch_size=B,
        drop_last=False,
        participation=RATE,
        optimizer="sgd",
        momentum=RHO,
        weight_decay=REG,
        lr=0.05,
        local_epochs=2,
    )
    engine = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in engine.state.params.items()}
    seeds = torch.tensor([0])
    selected = [[c for c in range(C) if participation(seeds, r, C, RATE)[0, c]] for r in range(ROUNDS)]
    sizes = [int(n) for n in train.counts]
    assert len({steps(n, cfg) for n in sizes}) > 2

    batches = release_batches(train, B, drop_last=False)

    if name not in TRAINED:  # one engine run per algorithm for the file's comparisons
        engine.run(logs=False)
        TRAINED[name] = {k: v[0, 0] for k, v in engine.state.params.items()}
    ours = TRAINED[name]
    saved = ref_fednova.train_net_fednova

    def plain_sgd_normaliser(net, glob, b, epochs, lr, rho, reg):  # broken: ‖a_i‖₁ = τ_i under momentum
        a_i, d = saved(net, glob, b, epochs, lr, rho, reg)
        tau = sum(len(b(e)) for e in range(epochs))
        return tau, {k: v * a_i / tau for k, v in d.items()}

    ref_fednova.train_net_fednova = plain_sgd_normaliser if broken else saved
    try:
        ref = ref_fednova.fednova(x0, selected, sizes, batches, cfg["local_epochs"], cfg["lr"], RHO, REG)
    finally:
        ref_fednova.train_net_fednova = saved
    return ours, ref, selected


def largest_difference(ours: dict, ref: dict) -> float:
    return max(float((v - ref[k]).abs().max()) for k, v in ours.items())


def test_fednova_is_niid_benchs_release_at_partial_participation():
    ours, ref, selected = release_runs("fednova")
    assert all(len(s) < C for s in selected) and len({tuple(s) for s in selected}) > 1
    assert largest_difference(ours, ref[-1]) < 2e-6
    assert largest_difference(ref[0], ref[-1]) > 1e-2  # the rounds moved the model


def test_a_broken_transcription_and_fedavg_fail_the_comparison():
    ours, ref, _ = release_runs("fednova", broken=True)
    assert largest_difference(ours, ref[-1]) > 1e-4
    fedavg, ref, _ = release_runs("fedavg")  # FedAvg's mean of the updates: the steps' imbalance left in
    assert largest_difference(fedavg, ref[-1]) > 1e-4
