"""FedLC: the calibrated loss against the paper's equation written out with explicit sums, the engine against the
plain per-client loop, and against a transcription of FL-bench's release (tests/ref_fedlc.py) over several rounds at
partial participation, where a copy calibrated by the counts of all clients (PFLlib's reading) fails."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import configure
from harness import release_batches

from featcache.algorithms import create, objective_note
from featcache.testing import assert_matches_plain_loop, assert_reduces_to, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_fedlc

D, P, K = 3, 4, 3  # input features, projection width, classes of the hand-checked head


def setup(**over):
    cfg = configure("fedlc", proj_dim=P, **over)
    algo = create("fedlc", cfg)
    params, _ = algo.init(cfg, D, K, torch.Generator().manual_seed(0))
    return algo, {k: v.double() for k, v in params.items()}


def paper_loss(params, x, y, counts, tau, others: bool) -> float:
    """ℓ_LC per row with explicit sums, averaged over the real rows: s_j = f_j − τ n_j^{−1/4},
    −log(e^{s_y} / Σ_j e^{s_j}) (over j ≠ y with `others`); a class the client lacks counts 1e-8 (the choice)."""
    W, b, V, c = (params[k].tolist() for k in ("proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias"))
    total, rows = 0.0, 0
    for n in range(len(y)):
        if y[n] < 0:
            continue
        z = [max(0.0, sum(W[j][i] * float(x[n, i]) for i in range(D)) + b[j]) for j in range(P)]
        f = [sum(V[k][j] * z[j] for j in range(P)) + c[k] for k in range(K)]
        s = [f[k] - tau * (counts[k] if counts[k] > 0 else 1e-8) ** -0.25 for k in range(K)]
        yn = int(y[n])
        den = sum(math.exp(s[k]) for k in range(K) if not (others and k == yn))
        total, rows = total - math.log(math.exp(s[yn]) / den), rows + 1
    return total / rows


@pytest.mark.parametrize("denominator", ["all", "others"])
def test_the_loss_is_the_papers_calibrated_cross_entropy(denominator):
    algo, params = setup(denominator=denominator)
    g = torch.Generator().manual_seed(3)
    params = {k: v + 0.5 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}
    x = torch.randn(6, D, generator=g, dtype=torch.float64)  # [N, D]
    y = torch.tensor([0, 2, 0, 2, 2, -1])  # class 1 absent from the client; the last row is padding
    counts = torch.tensor([7.0, 0.0, 3.0], dtype=torch.float64)  # [K] the client's training counts
    for tau in (0.0, 0.3, 1.0):
        ctx = {"hp": {"tau": torch.tensor(tau, dtype=torch.float64)}, "class_counts": counts}
        loss, _ = algo.local_loss(params, {}, x, y, y >= 0, ctx)
        expected = paper_loss(params, x, y, counts.tolist(), tau, denominator == "others")
        assert abs(float(loss) - expected) < 1e-10, (tau, float(loss), expected)
    scores = algo.predict(params, {}, x, ctx)  # inference: the raw logits, no calibration
    z = torch.relu(x @ params["proj0.weight"].T + params["proj0.bias"])
    torch.testing.assert_close(scores, z @ params["cls0.weight"].T + params["cls0.bias"])


def test_each_client_calibrates_by_its_own_training_counts():
    train, test = synthetic_clients(C=3, n=(10, 20), D=5, K=4, seed=0), synthetic_clients(C=3, D=5, K=4, seed=1)
    cfgs = [configure("fedlc", rounds=1, proj_dim=4, seed=s) for s in (0, 1)]
    eng = Engine(create("fedlc"), cfgs, train, test)
    counts = eng.state.client["class_counts"]  # [H, C, K]
    for c in range(3):
        own = torch.bincount(train.labels[c, : int(train.counts[c])], minlength=4).float()
        assert torch.equal(counts[0, c], own) and torch.equal(counts[1, c], own)


def test_the_printed_equation_carries_the_unbounded_note():
    assert objective_note(create("fedlc"), configure("fedlc", denominator="others"))
    assert not objective_note(create("fedlc"), configure("fedlc"))


@pytest.mark.parametrize("denominator", ["all", "others"])
def test_fedlc_equals_the_plain_loop(denominator):
    assert_matches_plain_loop("fedlc", denominator=denominator, tau=0.5)


def test_tau_zero_is_fedavg():
    assert_reduces_to("fedlc", "fedavg", tau=0.0)


# -- the release -----------------------------------------------------------------------------------------------
C, B, ROUNDS, RATE, TAU = 6, 8, 4, 0.5, 1.0


def release_run(monkeypatch=None, broken: bool = False):
    """(featcache's global model after each round, the transcription's, the selected clients): the same networks,
    clients and minibatches, SGD with momentum and weight decay, every other client lacking a class."""
    train = synthetic_clients(C=C, n=(18, 43), D=8, K=4, seed=1)
    for c in range(0, C, 2):  # label skew: every other client lacks class 3
        train.labels[c][train.labels[c] == 3] = c % 3
    test = synthetic_clients(C=C, n=(8, 16), D=8, K=4, seed=1)
    assert all(int(n) % B != 1 for n in train.counts)  # FL-bench discards one-row batches: none here
    algo = create("fedlc")
    cfg = configure(
        algo, proj_dim=8, rounds=ROUNDS, batch_size=B, drop_last=False, participation=RATE, tau=TAU,
        optimizer="sgd", lr=0.05, momentum=0.5, weight_decay=1e-4,
    )  # fmt: skip
    eng = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in eng.state.params.items()}  # the global network FL-bench starts from
    ours = []
    for r in range(ROUNDS):
        eng.run(until=r + 1)
        ours.append({k: v[0, 0].clone() for k, v in eng.state.params.items()})  # every client holds the download
    seeds = torch.tensor([0])
    selected = [[c for c in range(C) if participation(seeds, r, C, RATE)[0, c]] for r in range(ROUNDS)]

    batches = release_batches(train, B, drop_last=False)

    targets = [train.labels[c, : int(train.counts[c])].tolist() for c in range(C)]
    if broken:  # PFLlib's calibration: the counts summed over all clients
        pooled = [t for ts in targets for t in ts]
        monkeypatch.setattr(
            ref_fedlc, "label_counts", lambda t, k: torch.tensor([float(pooled.count(i)) for i in range(k)])
        )
    ref = ref_fedlc.fedlc(x0, selected, targets, 4, batches, 1, cfg["lr"], cfg["momentum"], cfg["weight_decay"], TAU)
    return ours, ref, selected


def largest_difference(ours, ref) -> float:
    return max(float((a[k] - b[k]).abs().max()) for a, b in zip(ours, ref) for k in a)


def test_fedlc_is_flbenchs_release_at_partial_participation():
    ours, ref, selected = release_run()
    assert all(0 < len(s) < C for s in selected) and len({tuple(s) for s in selected}) > 1
    assert largest_difference(ours, ref) < 2e-6, largest_difference(ours, ref)


def test_a_copy_calibrated_by_every_clients_counts_fails_the_same_comparison(monkeypatch):
    ours, ref, _ = release_run(monkeypatch, broken=True)
    assert largest_difference(ours, ref) > 1e-3
