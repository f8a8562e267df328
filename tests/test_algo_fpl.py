"""FPL: batched FINCH against the release's utils/finch.py (tests/ref_fpl.py) on random point sets, the server's
cluster and unbiased prototypes, the local loss (L_CE + L_CPCL + L_UPCR) against the equations written out with
explicit sums in float64, the vectorized engine against the plain per-client loop, and `fpl-official` against a
transcription of WenkeHuang/RethinkFL's release over several rounds at partial participation, with a broken
transcription and `fpl`'s prototype pass failing the same comparison."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import configure
from harness import release_batches
from torch.func import grad

from featcache.algorithms import create
from featcache.algorithms.fpl import cluster_prototypes, finch
from featcache.testing import assert_matches_plain_loop, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_fpl
from tests.test_algo_baselines import classify, neg_log_softmax, project


def same_cluster(labels) -> np.ndarray:
    """[n, n] bool: points i and j share a cluster (labels of any numbering)."""
    labels = np.asarray(labels)
    return labels[:, None] == labels[None, :]


def on_circle(degrees) -> torch.Tensor:
    a = torch.tensor(degrees, dtype=torch.float32) * math.pi / 180
    return torch.stack([a.cos(), a.sin()], -1)  # [n, 2]


def test_finch_keeps_the_coarsest_partition_with_more_than_one_cluster():
    """Four tight pairs → partition 0: the pairs; partition 1: {0..3}, {4..7}; partition 2 would be one cluster and
    is not taken. A point alone is its own cluster; padding takes no part."""
    x = on_circle([0, 2, 20, 22, 80, 82, 100, 102])[None]  # [1, 8, 2]
    labels = finch(x, torch.ones(1, 8, dtype=torch.bool))[0]
    assert same_cluster(labels).tolist() == same_cluster([0, 0, 0, 0, 1, 1, 1, 1]).tolist()
    x = torch.cat([on_circle([0, 2, 60, 62, 0, 0, 0, 0])[None], on_circle([5, 0, 0, 0, 0, 0, 0, 0])[None]])
    valid = torch.tensor([[True] * 4 + [False] * 4, [True] + [False] * 7])  # 4 points, then 1
    labels = finch(x, valid)
    assert same_cluster(labels[0, :4]).tolist() == same_cluster([0, 0, 1, 1]).tolist()  # partition 0 kept
    assert int(labels[1, 0]) == 0


@pytest.mark.parametrize("d", [2, 6])
def test_finch_is_the_releases_on_random_sets(d):
    """Groups of 2 to 20 points (padded to 20, in one batched call) against utils/finch.py's last partition."""
    gen = torch.Generator().manual_seed(d)
    sizes = [n for n in range(2, 21) for _ in range(2)]
    x = torch.randn(len(sizes), 20, d, generator=gen)
    x[:, :, 0] += torch.rand(len(sizes), 20, generator=gen) * 3  # clumps along one direction
    valid = torch.arange(20) < torch.tensor(sizes)[:, None]  # [G, 20]
    labels = finch(x, valid)
    partitions = set()
    for g, n in enumerate(sizes):
        c, num_clust = ref_fpl.FINCH(x[g, :n].numpy(), ensure_early_exit=False)
        assert same_cluster(labels[g, :n]).tolist() == same_cluster(c[:, -1]).tolist(), (g, n)
        partitions.add(c.shape[1])
    assert len(partitions) >= 2  # some groups end beyond partition 0


def test_the_server_keeps_cluster_means_and_their_mean():
    """Class 0: four owners in two tight pairs → two cluster prototypes (the means of each pair) and u^0 their mean;
    class 1: one owner → its prototype alone; class 2: no owner (a non-participant's prototype is not used)."""
    protos = torch.zeros(1, 4, 3, 2)
    protos[0, :, 0] = torch.tensor([[1.0, 0.0], [3.0, 0.1], [0.0, 1.0], [0.2, 2.0]])
    protos[0, 2, 1] = torch.tensor([0.5, 0.5])
    protos[0, 1, 2] = torch.tensor([9.0, 9.0])
    owned = torch.tensor([[[1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0]]]).bool()
    out = cluster_prototypes(protos, owned, slots=2)
    assert out["valid"].tolist() == [[[True, True], [True, False], [False, False]]]
    got = out["clusters"][0, 0][out["clusters"][0, 0, :, 0].argsort()]  # [2, 2] in a fixed order
    torch.testing.assert_close(got, torch.tensor([[0.1, 1.5], [2.0, 0.05]]))
    torch.testing.assert_close(out["unbiased"][0, 0], torch.tensor([1.05, 0.775]))
    torch.testing.assert_close(out["clusters"][0, 1, 0], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(out["unbiased"][0, 1], torch.tensor([0.5, 0.5]))


D, P, K, S = 3, 4, 3, 2  # the tiny hand-checked head: input features, projection width, classes, cluster slots


def tiny(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"proj0.weight": (P, D), "proj0.bias": (P,), "cls0.weight": (K, P), "cls0.bias": (K,)}
    params = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    params["proj0.bias"] = params["proj0.bias"].abs() + 2  # z ≠ 0: its cosine is defined
    return params


def written_out(p: dict, clusters, valid, x, y, mask, tau, cpcl, upcr):
    """(1/|B|) Σ_n [−log softmax(V z_n + c)_{y_n} + [y_n has clusters] (λ_c L_CPCL + λ_u L_UPCR)], with
    L_CPCL = −log Σ_{s∈C^y} e^{cos(z,c_ys)/τ} / Σ_k Σ_{s∈C^k} e^{cos(z,c_ks)/τ}, u^k the mean of class k's valid
    clusters and L_UPCR = (1/d) Σ_j (z_j − u^y_j)²."""
    rows = [n for n in range(len(y)) if mask[n]]
    total = 0.0
    for n in rows:
        z = project(p, x[n])
        yn = int(y[n])
        total = total + neg_log_softmax(classify(p, z), yn)
        own = [s for s in range(S) if valid[yn, s]]
        if not own:
            continue
        norm = lambda v: sum(t**2 for t in v) ** 0.5
        cos = lambda k, s: sum(z[j] * clusters[k, s, j] for j in range(P)) / (norm(z) * norm(clusters[k, s]))
        e = {(k, s): torch.exp(cos(k, s) / tau) for k in range(K) for s in range(S) if valid[k, s]}
        l_cpcl = -torch.log(sum(e[yn, s] for s in own) / sum(e.values()))
        u = [sum(clusters[yn, s, j] for s in own) / len(own) for j in range(P)]
        l_upcr = sum((z[j] - u[j]) ** 2 for j in range(P)) / P
        total = total + cpcl * l_cpcl + upcr * l_upcr
    return total / len(rows)


def test_fpl_loss_and_gradient_are_the_equations():
    algo = create("fpl", configure("fpl", proj_dim=P))
    params = tiny(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2, -1])  # class 2 has no prototypes; the last row is padding
    mask = y >= 0
    clusters = torch.rand(K, S, P, generator=g, dtype=torch.float64)
    valid = torch.tensor([[True, True], [True, False], [False, False]])
    unbiased = (clusters * valid[..., None]).sum(1) / valid.sum(1).clamp(min=1)[:, None]
    for tau, cpcl, upcr in ((0.02, 1.0, 1.0), (0.5, 0.3, 2.0)):
        f64 = lambda v: torch.tensor(v, dtype=torch.float64)
        ctx = {
            "hp": {"tau": f64(tau), "cpcl": f64(cpcl), "upcr": f64(upcr)},
            "clusters": clusters,
            "valid": valid,
            "unbiased": unbiased,
        }
        loss = lambda p: algo.local_loss(p, {}, x, y, mask, ctx)[0]
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        expected = written_out(leaves, clusters, valid, x, y, mask, tau, cpcl, upcr)
        expected.backward()
        assert abs(float(loss(params)) - float(expected.detach())) < 1e-10
        for k, v in grad(loss)(params).items():
            torch.testing.assert_close(v, leaves[k].grad, rtol=1e-9, atol=1e-10)
    none = ctx | {"valid": torch.zeros_like(valid)}  # round 1: no prototypes, the cross-entropy alone
    ce = algo.local_loss(params, {}, x, y, mask, none)[0]
    assert abs(float(ce) - float(written_out(params, clusters, none["valid"], x, y, mask, 1.0, 1.0, 1.0))) < 1e-12


def test_fpl_official_equals_the_plain_loop():
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults), 2 local epochs (the
    prototypes collected in the second); `fpl` runs in test_engine.py's generic comparison."""
    assert_matches_plain_loop("fpl-official", rounds=2, local_epochs=2, tau=0.1)


# -- the release ----------------------------------------------------------------------------------------------------
# τ = 0.02, the release's. Its float32 InfoNCE (exp with no maximum subtracted) loses precision at a row whose z lies
# at cosine ≈ 1 from a negative cluster: on clients of 24 to 48 rows one such row's gradient was 5e-3 off (of 43)
# against float64, featcache's 1e-5, and 4 rounds ended 8e-6 apart. These clients stay at float32 rounding.
C, B, ROUNDS, EPOCHS, LR, RATE, TAU = 8, 8, 3, 2, 0.01, 0.75, 0.02


def engine_runs(name: str):
    """(featcache's global model after each round, its result, the most clusters a class had in a round, the data,
    the online clients of each round)."""
    train, test = synthetic_clients(C=C, n=(16, 32), D=8, K=4, seed=0), synthetic_clients(C=C, n=(8, 12), D=8, K=4)
    algo = create(name)
    cfg = configure(algo, proj_dim=8, rounds=ROUNDS, batch_size=B, participation=RATE, local_epochs=EPOCHS, tau=TAU)
    cfg |= {"optimizer": "sgd", "lr": LR, "momentum": 0.9, "weight_decay": 1e-5, "drop_last": True}
    eng = Engine(algo, [cfg], train, test)
    x0 = {k: v[0, 0].clone() for k, v in eng.state.params.items()}
    per_round, clusters = [], []

    def keep(*_):
        per_round.append({k: v[0, 0].clone() for k, v in eng.state.params.items()})
        clusters.append(int(eng.state.server["valid"].sum(-1).max()))

    out = eng.run(progress=keep)
    seeds = torch.tensor([0])
    online = [[c for c in range(C) if participation(seeds, r, C, RATE)[0, c]] for r in range(ROUNDS)]
    return per_round, out, clusters, (train, test), online, x0


def run_release(x0, online, data):
    """The release's rounds on featcache's online clients and minibatches: (global net, evaluation) per round."""
    train, test = data

    batches = release_batches(train, B, drop_last=True)

    sizes = [int(n) for n in train.counts]
    rows = [(test.features[c, : int(test.counts[c])], test.labels[c, : int(test.counts[c])]) for c in range(C)]
    model = ref_fpl.FPL(x0, C, TAU, LR, EPOCHS)
    nets, evaluations = [], []
    for r, clients in enumerate(online):
        loaders = [lambda epoch, r=r, c=c: batches(r, c, epoch) for c in range(C)]
        model.loc_update(loaders, clients, sizes)
        nets.append({k: v.clone() for k, v in model.global_net.items()})
        evaluations.append(ref_fpl.global_evaluate(model, rows))
    return nets, evaluations


def largest_difference(per_round, out, ref) -> float:
    nets, evaluations = ref
    worst = 0.0
    for r in range(ROUNDS):
        worst = max(worst, *(float((per_round[r][k] - v).abs().max()) for k, v in nets[r].items()))
        acc = torch.tensor([correct / n for correct, n in evaluations[r]])
        worst = max(worst, float((out["acc"][r, 0] - acc).abs().max()))
    return worst


@pytest.fixture(scope="module")
def official():
    return engine_runs("fpl-official")


def test_fpl_official_is_the_release_at_partial_participation(official):
    per_round, out, clusters, data, online, x0 = official
    assert all(len(s) < C for s in online) and len({tuple(s) for s in online}) > 1
    assert max(clusters) >= 2  # FINCH split some class
    ref = run_release(x0, online, data)
    assert largest_difference(per_round, out, ref) < 2e-6
    assert float((ref[0][-1]["proj0.weight"] - ref[0][0]["proj0.weight"]).abs().max()) > 1e-2  # the rounds moved it


def test_a_broken_transcription_fails_the_comparison(official, monkeypatch):
    """The control: each class one prototype, the plain mean of its local prototypes (FedProto's server, no FINCH)."""
    per_round, out, _, data, online, x0 = official
    monkeypatch.setattr(ref_fpl, "cluster", lambda protos: [torch.tensor(protos.mean(0, keepdims=True))])
    assert largest_difference(per_round, out, run_release(x0, online, data)) > 1e-4
