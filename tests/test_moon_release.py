"""MOON as released (QinbinLi/MOON, main.py) at partial participation: `moon-official` against a transcription of
the released round loop and `train_net_fedcon` (tests/ref_moon.py), given the same networks, parties, minibatches
and Adam settings. The release gives a party that has not trained yet its own initial network as the previous
model and reports a round-0 contrastive loss of 0; `moon` (the paper's reading) differs there and only there."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import configure

from featcache.algorithms import create
from featcache.testing import assert_matches_plain_loop, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import batch_order, participation
from tests import ref_moon
from tests.synthetic import write_cache
from tests.test_resume import assert_resumes_exactly, ctrl_c_reaches_python  # noqa: F401  (autouse: SIGINT reaches Python)

C, B, ROUNDS, MU = 6, 16, 4, 5.0


def runs(name: str, rate: float):
    """(engine after ROUNDS rounds, its result, the transcription's (globals per round, logs per round))."""
    train, test = synthetic_clients(C=C, n=(32, 56), D=8, K=3, seed=0), synthetic_clients(C=C, n=(8, 16), D=8, K=3)
    algo = create(name)
    cfg = configure(algo, proj_dim=8, rounds=ROUNDS, batch_size=B, participation=rate, mu=MU, lr=1e-2)
    engine = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in engine.state.params.items()}  # the global network of init_nets(..., 1)
    D, K = train.features.shape[-1], train.num_classes
    gen = torch.Generator().manual_seed(0)  # init_nets: the parties' networks drawn apart from the global one
    assert torch.equal(algo.init(engine.cfg, D, K, gen)[0]["cls0.weight"], x0["cls0.weight"])
    nets = [algo.init(engine.cfg, D, K, gen)[0] for c in range(C)]
    assert not torch.equal(nets[0]["cls0.weight"], x0["cls0.weight"])
    out = engine.run()
    seeds = torch.tensor([0])
    parties = [[c for c in range(C) if participation(seeds, r, C, rate)[0, c]] for r in range(ROUNDS)]

    def batches(r: int, c: int, epoch: int):
        order = batch_order(seeds, r, epoch, train.counts, train.features.shape[1])[0, c]
        n = int(train.counts[c]) // B * B  # the DataLoader's drop_last
        return [(train.features[c, order[s : s + B]], train.labels[c, order[s : s + B]]) for s in range(0, n, B)]

    sizes = [int(n) for n in train.counts]
    ref = ref_moon.moon(x0, nets, parties, sizes, batches, 1, cfg["lr"], cfg["weight_decay"], MU, cfg["tau"])
    return engine, out, ref, parties


def largest_difference(engine, ref) -> float:
    final = ref[0][-1]
    return max(float((v[0, 0] - final[k]).abs().max()) for k, v in engine.state.params.items())


def test_moon_official_is_the_release_at_partial_participation():
    engine, out, (globals_, logs), parties = runs("moon-official", 0.5)
    assert any(c not in parties[0] for c in parties[1])  # a party trains for the first time after round 0
    assert largest_difference(engine, (globals_, logs)) < 2e-6
    for r, per_party in enumerate(logs):  # the training loss each party reports, round by round
        for c, epochs in per_party.items():
            assert out["train_loss"][r, 0, c].item() == pytest.approx(epochs[0][0], abs=2e-6)
            if r == 0:
                assert epochs[0][2] == 0.0  # no previous model in the pool: the contrastive loss is 0


def test_moon_differs_from_the_release_only_where_the_fidelity_table_says():
    """At full participation `moon` trains as the release does (its round-0 μ·log 2 has no gradient) but reports
    μ·log 2 more in round 0; at participation 0.5 its previous model of a party new in round 1 is the global one."""
    engine, out, ref, _ = runs("moon", 1.0)
    assert largest_difference(engine, ref) < 2e-6
    for c, epochs in ref[1][0].items():
        assert out["train_loss"][0, 0, c].item() == pytest.approx(epochs[0][0] + MU * math.log(2), abs=2e-6)
    engine, _, ref, _ = runs("moon", 0.5)
    assert largest_difference(engine, ref) > 1e-3


def test_moon_official_equals_the_plain_loop():
    assert_matches_plain_loop("moon-official")


def test_moon_official_resumes_byte_for_byte(tmp_path):
    cache = write_cache(tmp_path / "c.h5", C=4, D=16, K=3, n=(16, 40), spread=4.0)
    opts = {"participation": 0.5, "batch_size": 8, "proj_dim": 8}
    assert_resumes_exactly(
        cache, "moon-official", [(2, "kill")], 1, rounds=3, seeds=[0, 1], set=[f"{k}={v}" for k, v in opts.items()]
    )
