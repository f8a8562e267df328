"""pFedGate as released (featcache/algorithms/pfedgate.py): against an independent transcription of the released
code (tests/ref_pfedgate.py, yxdyc/pFedGate b8cfa15) for 3 rounds on tiny tensors, and its pieces on hand-made
tensors: the greedy knapsack, the straight-through gradient, batch-mean gates, optimizer state kept across rounds."""

from __future__ import annotations

import pytest
import torch
from conftest import client_model, configure

from featcache.algorithms import create
from featcache.testing import assert_capturable, assert_matches_plain_loop
from featcache.training.engine import Engine
from tests import ref_pfedgate as ref
from tests.test_algo_official import tiny_clients

GATE_NAMES = {
    "gate0.weight": "gating.1.weight",
    "gate0.bias": "gating.1.bias",
    "gate0.bn.weight": "gating.2.weight",
    "gate0.bn.bias": "gating.2.bias",
    "gate0.bn.running_mean": "gating.2.running_mean",
    "gate0.bn.running_var": "gating.2.running_var",
}
HEAD = ("proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias")
CFG = dict(
    rounds=3,
    local_epochs=1,
    batch_size=8,
    drop_last=True,
    optimizer="sgd",
    lr=0.05,
    lr_gate=0.5,
    momentum=0.9,
    weight_decay=5e-4,
    sparsity=0.5,
    blocks=5,
    proj_dim=8,
    participation=1.0,
    seed=0,
)
RELEASED = dict(
    bz=8,
    lr_model=0.05,
    lr_gating=0.5,
    sparse_factor=0.5,
    fine_grained_block_split=5,
    seperate_trans=0,
    lr_scheduler="constant",
    gate_input_norm="none",
    online_aggregate=1,
    bi_level_opt=0,
    drop_last=True,
)


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def featcache_run(**settings):
    """featcache's run: per client the head it evaluates with, its gating layer and its test scores; the global θ."""
    train, test = tiny_clients(0, (40, 52, 68, 96)), tiny_clients(1, (18, 19, 20, 22))
    algo = create("pfedgate")
    eng = Engine(algo, [configure(algo, **(CFG | settings))], train, test)
    init = {k: v[0, 0].clone() for k, v in (eng.state.params | eng.state.buffers).items()}
    eng.run()
    state, out = eng.state, []
    for c in range(4):
        params, buffers, ctx_c = client_model(eng, c)
        n = int(test.counts[c])
        rows = {"rows": torch.ones(n, dtype=torch.bool)}  # every row of x is a real one
        with torch.no_grad():
            logits = eng.algo.predict(params, buffers, test.features[c, :n], ctx_c | rows)
        model = {k: buffers["held." + k] for k in HEAD} | {
            GATE_NAMES[k]: v for k, v in (params | buffers).items() if k in GATE_NAMES
        }
        out.append({"model": model, "logits": logits})
    return train, test, init, out, {k: state.params[k][0, 0] for k in HEAD}


def released_run(train, test, init, **args):
    init = {k: init[k] for k in HEAD} | {GATE_NAMES[k]: v for k, v in init.items() if k in GATE_NAMES}
    out, glob = ref.run_released(
        RELEASED | args, train, test, init, rounds=3, order=ref.featcache_order(train, 8, seed=0)
    )
    return out, glob


def largest_difference(ours, theirs) -> float:
    (out, glob), (ref_out, ref_glob) = ours, theirs
    diffs = [(glob[k] - ref_glob[k]).abs().max() for k in glob]
    for a, b in zip(out, ref_out):
        diffs += [(v - b["model"][k]).abs().max() for k, v in a["model"].items()]
        diffs.append((a["logits"] - b["logits"]).abs().max())
    return float(max(diffs))


@pytest.mark.parametrize("sparsity", [0.5, 1.0])
def test_pfedgate_equals_the_released_code(sparsity, float64):
    """3 rounds: every client's head (as it evaluates with it), gating layer and BN statistics, its test scores and
    the global model equal the transcription's within 1e-5; a changed hyperparameter does not."""
    train, test, init, out, glob = featcache_run(sparsity=sparsity)
    theirs = released_run(train, test, init, sparse_factor=sparsity)
    assert largest_difference((out, glob), theirs) < 1e-5
    assert (
        largest_difference((out, glob), released_run(train, test, init, sparse_factor=sparsity, lr_gating=0.25)) > 1e-3
    )


def test_pfedgate_sparse_matches_the_plain_loop_and_captures():
    """At s = 0.5 (the generic engine tests run s = 1): vectorized == one torch.optim pair per client kept alive,
    clipped per group; captured steps replay bit for bit."""
    assert_matches_plain_loop("pfedgate", sparsity=0.5)
    assert assert_capturable("pfedgate", sparsity=0.5)
