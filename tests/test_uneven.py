"""Uneven clients: a round computes the steps its clients have (the cohort's prefix that still has a batch), and
every client still trains exactly as it would alone, in the plain loop, whatever the client sizes, participation,
number of configurations batched (a grid) and models per pass (`at_once`). BatchNorm is off: on a batch of one row
(a short last batch) it divides float32 rounding by sqrt(eps), and both sides round the batch mean differently."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from conftest import configure
from hypothesis import given, settings

from featcache.algorithms import create
from featcache.cache import ClientData
from featcache.testing import plain_loop, synthetic_clients
from featcache.training.engine import Engine


def with_counts(counts: list[int], seed: int) -> ClientData:
    """The synthetic clients cut to `counts` rows each (rows beyond a client's count are padding)."""
    full = synthetic_clients(C=len(counts), n=(max(counts), max(counts)), D=8, K=3, seed=seed)
    n = torch.tensor(counts)
    real = torch.arange(full.features.shape[1]) < n[:, None]  # [C, N]
    return ClientData(full.features * real[..., None], torch.where(real, full.labels, -1), n, full.num_classes, None)


@settings(max_examples=20)
@given(
    counts=st.lists(st.integers(1, 60), min_size=2, max_size=6),
    batch=st.integers(3, 24),
    rate=st.sampled_from([1.0, 0.5]),
    lrs=st.lists(st.sampled_from([1e-2, 3e-2]), min_size=1, max_size=3),
    at_once=st.sampled_from([None, 1, 2]),
    name=st.sampled_from(["fedavg", "fedprox", "scaffold", "fedproto", "fedpcl"]),
)
def test_each_client_trains_as_alone_whatever_the_sizes(counts, batch, rate, lrs, at_once, name):
    train, test = with_counts(counts, 0), with_counts([max(1, c // 2) for c in counts], 1)
    cfgs = [
        configure(
            name, fast=True, proj_dim=4, bn=False, rounds=2, batch_size=batch, drop_last=False, participation=rate
        )
        | {"seed": h, "lr": lr}
        for h, lr in enumerate(lrs)
    ]
    eng = Engine(create(name), cfgs, train, test, at_once=at_once)
    acc = eng.run(logs=False)["acc"]  # [R, H, C]
    steps = eng.plan.client_steps.tolist()
    if rate == 1 and eng.clients.at_once == eng.clients.P:  # every client: each step trains the clients with a batch
        assert [len(h[0]) for h in eng.clients.runner.host] == [sum(s > i for s in steps) for i in range(max(steps))]
    for h, cfg in enumerate(cfgs):
        ref_acc, ref_params = plain_loop(create(name), cfg, train, test)
        torch.testing.assert_close(acc[:, h], ref_acc, rtol=0, atol=1e-6)
        for k, v in eng.state.params.items():
            torch.testing.assert_close(v[h], ref_params[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {k}: {m}")


@settings(max_examples=10)
@given(counts=st.lists(st.integers(1, 200), min_size=1, max_size=12), name=st.sampled_from(["fedavg", "fedpcl"]))
def test_scoring_in_row_buckets_gives_every_real_rows_scores(counts, name):
    """Evaluation scores clients of similar sizes together: the rows it scores stay within 1.25x the real rows
    (or one group where the clients are that even), and every real row gets the score of the padded [C, N] pass."""
    from featcache.training.evaluate import row_buckets, scores
    from featcache.training.models import map_models

    data = with_counts(counts, 2)
    cfg = configure(name, fast=True, proj_dim=4, rounds=1, batch_size=8, drop_last=False) | {"seed": 0}
    eng = Engine(create(name), [cfg], data, data)
    eng.run(logs=False)
    groups = row_buckets(data.counts)
    scored = sum(n * (len(counts) if ids is None else len(ids)) for ids, n in groups)
    assert scored <= 1.25 * sum(counts) or len(groups) == 1
    assert sorted(c for ids, _ in groups if ids is not None for c in ids.tolist()) in ([], list(range(len(counts))))
    now = eng.last_round
    got = scores(eng.algo, eng.state, data, now)  # [H, C, N, K]
    ctx = eng.algo.context(eng.state, now) | {"rows": data.mask.expand(1, *data.mask.shape)}
    padded = map_models(
        lambda p, b, c, x: eng.algo.predict(p, b, x, c), (eng.state.params, eng.state.buffers, ctx), (data.features,)
    )
    real = data.mask.expand(*got.shape[:-1])  # [H, C, N]
    torch.testing.assert_close(got[real], padded[real], rtol=1e-5, atol=1e-5)
