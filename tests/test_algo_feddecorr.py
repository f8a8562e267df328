"""FedDecorr: the regularizer against the paper's (1/d²)||K||²_F written out with explicit sums, the engine against
the plain per-client loop, and `feddecorr-official` against a transcription of the release (tests/ref_feddecorr.py)
over several rounds at partial participation, where a copy with the biased variance fails and `feddecorr` (the
paper's scaling) differs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import configure
from harness import release_batches

from featcache.algorithms import create
from featcache.algorithms.feddecorr import decorrelation, decorrelation_official
from featcache.testing import assert_matches_plain_loop, assert_reduces_to, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_feddecorr

D, P, K = 3, 4, 3  # input features, projection width, classes of the hand-checked head


def paper_term(z: list[list[float]]) -> float:
    """(1/d²) Σ_ij K_ij², K_ij = (1/N) Σ_n ẑ_ni ẑ_nj, ẑ_nj = (z_nj − mean_j) / sqrt(var_j + 1e-8), var with 1/N."""
    N, d = len(z), len(z[0])
    mean = [sum(z[n][j] for n in range(N)) / N for j in range(d)]
    var = [sum((z[n][j] - mean[j]) ** 2 for n in range(N)) / N for j in range(d)]
    zs = [[(z[n][j] - mean[j]) / math.sqrt(var[j] + 1e-8) for j in range(d)] for n in range(N)]
    Kc = [[sum(zs[n][i] * zs[n][j] for n in range(N)) / N for j in range(d)] for i in range(d)]
    return sum(Kc[i][j] ** 2 for i in range(d) for j in range(d)) / d**2


def test_the_term_is_the_papers_frobenius_norm_of_the_correlation_matrix():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 5, generator=g, dtype=torch.float64) @ torch.randn(5, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([True] * 5 + [False] * 2)  # [N] the last two rows are padding
    z[5:] = 1e3  # padding rows hold anything
    valid = z[:5].tolist()
    assert abs(float(decorrelation(z, mask)) - paper_term(valid)) < 1e-12
    corr = torch.corrcoef(z[:5].T)  # K is the correlation matrix (up to ε)
    assert abs(float(decorrelation(z, mask)) - float(corr.square().sum()) / 25) < 1e-6
    centred = torch.randn(6, 5, generator=g, dtype=torch.float64)
    q = torch.linalg.qr(centred - centred.mean(0))[0] * 6**0.5  # [6, 5] centred, orthogonal: K = I, the minimum 1/d
    assert abs(float(decorrelation(q, torch.ones(6, dtype=torch.bool))) - 1 / 5) < 1e-6


def test_the_gradient_reaches_only_the_real_rows():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([True, True, False, True, True, False])
    decorrelation(z, mask).backward()
    assert torch.equal(z.grad[~mask], torch.zeros(2, 4, dtype=torch.float64))
    alone = z.detach()[mask].requires_grad_(True)
    decorrelation(alone, torch.ones(4, dtype=torch.bool)).backward()
    torch.testing.assert_close(z.grad[mask], alone.grad)


@pytest.mark.parametrize("name", ["feddecorr", "feddecorr-official"])
def test_the_loss_is_cross_entropy_plus_beta_times_the_term(name):
    cfg = configure(name, proj_dim=P)
    algo = create(name, cfg)
    params = {k: v.double() for k, v in algo.init(cfg, D, K, torch.Generator().manual_seed(0))[0].items()}
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, D, generator=g, dtype=torch.float64)  # [N, D]
    y = torch.tensor([0, 2, 1, 2, 0, -1])  # the last row is padding
    beta = 0.7
    loss, _ = algo.local_loss(params, {}, x, y, y >= 0, {"hp": {"beta": torch.tensor(beta, dtype=torch.float64)}})
    z = torch.relu(x[:5] @ params["proj0.weight"].T + params["proj0.bias"])  # [5, P] the real rows
    ce = torch.nn.functional.cross_entropy(z @ params["cls0.weight"].T + params["cls0.bias"], y[:5])
    if name == "feddecorr":
        term = paper_term(z.tolist())
    else:
        term = float(ref_feddecorr.FedDecorrLoss()(z))  # the release's FedDecorrLoss on the real rows
    assert abs(float(loss) - (float(ce) + beta * term)) < 1e-10


def test_the_release_scales_the_off_diagonal_by_its_batch():
    """The release's term is (N − 1)² d / (N (d − 1)) times the paper's off-diagonal part, 0 for one row."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(9, 6, generator=g, dtype=torch.float64)
    N, d, ones = 9, 6, torch.ones(9, dtype=torch.bool)
    corr = torch.corrcoef(z.T)
    off = (corr.square().sum() - d) / d**2  # the paper's term less its constant diagonal
    assert abs(float(decorrelation_official(z, ones)) - float(off) * (N - 1) ** 2 * d / (N * (d - 1))) < 1e-6
    assert float(decorrelation_official(z[:1], torch.ones(1, dtype=torch.bool))) == 0.0


@pytest.mark.parametrize("name, over", [("feddecorr", {"bn": True}), ("feddecorr-official", {})])
def test_feddecorr_equals_the_plain_loop(name, over):
    assert_matches_plain_loop(name, beta=1.0, **over)


def test_beta_zero_is_fedavg():
    assert_reduces_to("feddecorr", "fedavg", rounds=2, beta=0.0)


# -- the release -----------------------------------------------------------------------------------------------
C, B, ROUNDS, RATE, BETA = 6, 8, 4, 0.5, 0.5


def release_run(name: str = "feddecorr-official", monkeypatch=None, broken: bool = False, rounds: int = ROUNDS):
    """(featcache's global model after each round, the transcription's, the parties): the same networks, parties
    and minibatches (drop_last False: short last batches, one of a single row), SGD with momentum and weight decay."""
    train = synthetic_clients(C=C, n=(18, 43), D=8, K=4, seed=2)
    test = synthetic_clients(C=C, n=(8, 16), D=8, K=4, seed=1)
    assert any(int(n) % B == 1 for n in train.counts)  # a one-row batch: the release's N == 1 branch
    algo = create(name)
    cfg = configure(
        algo, proj_dim=8, rounds=rounds, batch_size=B, drop_last=False, participation=RATE, beta=BETA,
        optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-5,
    )  # fmt: skip
    eng = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in eng.state.params.items()}  # the release's global_net
    ours = []
    for r in range(rounds):
        eng.run(until=r + 1)
        ours.append({k: v[0, 0].clone() for k, v in eng.state.params.items()})  # every client holds the download
    seeds = torch.tensor([0])
    parties = [[c for c in range(C) if participation(seeds, r, C, RATE)[0, c]] for r in range(rounds)]

    batches = release_batches(train, B, drop_last=False)

    if broken:  # the biased variance in the z-score
        monkeypatch.setattr(torch.Tensor, "var", lambda t, dim, keepdim: t.pow(2).mean(dim, keepdim=keepdim))
    sizes = [int(n) for n in train.counts]
    ref = ref_feddecorr.feddecorr(x0, parties, sizes, batches, 1, cfg["lr"], 0.9, cfg["weight_decay"], BETA)
    return ours, ref, parties


def largest_difference(ours, ref) -> float:
    return max(float((a[k] - b[k]).abs().max()) for a, b in zip(ours, ref) for k in a)


def test_feddecorr_official_is_the_release_at_partial_participation():
    ours, ref, parties = release_run()
    assert all(0 < len(p) < C for p in parties) and len({tuple(p) for p in parties}) > 1
    assert largest_difference(ours, ref) < 2e-6, largest_difference(ours, ref)


def test_a_copy_with_the_biased_variance_fails_the_same_comparison(monkeypatch):
    ours, ref, _ = release_run(monkeypatch=monkeypatch, broken=True, rounds=2)
    assert largest_difference(ours, ref) > 1e-4


def test_feddecorr_the_papers_scaling_differs_from_the_release():
    ours, ref, _ = release_run("feddecorr", rounds=2)
    assert largest_difference(ours, ref) > 1e-3
