"""FedALA (featcache/algorithms/fedala.py): one download's adaptive local aggregation against the paper's update of
W_i^p written out per client in float64, the engine against the plain per-client loop, and featcache against a
transcription of PFLlib's released code (tests/ref_fedala.py) over several rounds at partial participation, with a
broken copy and FedAvg failing the same comparison."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import configure
from harness import release_batches

from featcache.algorithms import create
from featcache.algorithms.fedala import FedALA, sampled_rows, top_layers
from featcache.testing import assert_matches_plain_loop, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.schedule import participation
from tests import ref_fedala
from tests.test_algo_personal import assert_batched_equals_alone

C, B, ROUNDS, RATE = 6, 8, 4, 0.5
pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: threads only contend on a loaded machine
NAMES = ("proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias")


def forward(net: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ net["proj0.weight"].T + net["proj0.bias"]) @ net["cls0.weight"].T + net["cls0.bias"]


class Seen(FedALA):
    """FedALA that keeps what its first download saw: every client's Θ_i, the server's Θ, the flags and W."""

    name = "fedala-seen"
    seen: list = []

    def download(self, state, server, rnd):
        copy = lambda tree: {k: v.clone() for k, v in tree.items()}
        flags = state.client["ala_started"].clone()
        before = copy(state.params), copy(server), copy(state.client["ala_weights"]), flags
        super().download(state, server, rnd)
        Seen.seen.append((*before, copy(state.params), copy(state.client["ala_weights"])))


def test_one_download_is_the_papers_adaptive_local_aggregation():
    """Θ̂_i = Θ_i + (Θ − Θ_i) ⊙ W_i: the lower layer takes Θ, the classifier's W^p steps per minibatch of the sampled
    rows, W ← clip(W − η ∇L(Θ̂_i) ⊙ (Θ − Θ_i), 0, 1), from ones, for max_start_epochs epochs (threshold 0: the start
    phase never converges); every client, participant or not, in float64. Round 2 trains W one epoch from there."""
    train, test = synthetic_clients(C=3, n=(9, 14), D=4, K=3), synthetic_clients(C=3, n=(4, 6), D=4, K=3, seed=1)
    Seen.seen = []
    algo = Seen()
    eta, epochs = 3.0, 3
    cfg = configure(
        "fedala", proj_dim=3, rounds=2, batch_size=4, optimizer="sgd", momentum=0.0, weight_decay=0.0, lr=0.5,
        eta=eta, threshold=0.0, max_start_epochs=epochs, participation=0.67,
    )  # fmt: skip
    eng = Engine(algo, [cfg], train, test)
    out = eng.run()
    counts, moved = [int(n) for n in train.counts], []
    for r, (local, glob, W, started, after, W_after) in enumerate(Seen.seen):
        assert started.tolist() == [[bool(r)] * 3]
        offset, sizes = sampled_rows(torch.tensor([0]), r, counts, 80)
        for c in range(3):
            theta = {k: local[k][0, c].double() for k in NAMES}  # Θ_i
            g = {k: glob[k][0].double() for k in NAMES}  # Θ
            w = {k: W[k][0, c].double() for k in ("cls0.weight", "cls0.bias")}  # W_i^p before
            rows = range(int(offset[0, c]), int(offset[0, c]) + sizes[c])
            x, y = train.features[c, list(rows)].double(), train.labels[c, list(rows)]
            mixed = lambda w: {k: g[k] if k.startswith("proj0") else theta[k] + (g[k] - theta[k]) * w[k] for k in g}
            for _ in range(epochs if r == 0 else 1):
                for s in range(0, sizes[c], 4):  # minibatches of the slice, the last one short
                    leaves = {k: t.clone().requires_grad_(k.startswith("cls0")) for k, t in mixed(w).items()}
                    loss = F.cross_entropy(forward(leaves, x[s : s + 4]), y[s : s + 4])
                    grads = dict(zip(w, torch.autograd.grad(loss, [leaves[k] for k in w])))  # ∇_{Θ̂^p} L
                    w = {k: (w[k] - eta * grads[k] * (g[k] - theta[k])).clamp(0, 1) for k in w}
            for k, t in mixed(w).items():
                torch.testing.assert_close(after[k][0, c].double(), t, rtol=1e-5, atol=1e-6)
            for k in w:
                torch.testing.assert_close(W_after[k][0, c].double(), w[k], rtol=1e-5, atol=1e-6)
                moved.append(bool((W_after[k][0, c] != W[k][0, c]).any()))
            n = int(test.counts[c])
            hits = (forward(mixed(w), test.features[c, :n].double()).argmax(-1) == test.labels[c, :n]).double()
            assert out["acc"][r, 0, c].item() == pytest.approx(hits.mean().item(), abs=1e-6)  # Θ̂_i predicts
    assert sum(moved) > len(moved) / 2  # the weights learned, in both rounds
    model = eng.algo.global_model(eng.state, eng.last_round)
    assert model is not None and all(torch.equal(model[0][k], Seen.seen[-1][1][k]) for k in NAMES)  # Θ, before ALA


def test_a_client_whose_model_is_the_global_one_skips_aggregation():
    """With one client, Θ = Θ_1 at every download: ALA never runs (its start phase waits), FedALA is FedAvg."""
    train, test = synthetic_clients(C=1, seed=0), synthetic_clients(C=1, seed=1)
    runs = {}
    for name in ("fedala", "fedavg"):
        eng = Engine(create(name), [configure(name, rounds=2, proj_dim=4)], train, test)
        eng.run()
        runs[name] = eng
    assert not runs["fedala"].state.client["ala_started"].any()
    for k, v in runs["fedavg"].state.params.items():
        assert torch.equal(runs["fedala"].state.params[k], v)


def test_layers_pick_the_top_layers():
    names = ["proj0.weight", "proj0.bias", "proj0.bn.weight", "proj0.bn.bias", "cls0.weight", "cls0.bias"]
    assert top_layers(names, 1) == ["cls0.weight", "cls0.bias"]
    assert top_layers(names, 2) == names == top_layers(names, 5)


@pytest.mark.parametrize("settings", [{"bn": True}, {"layers": 2, "optimizer": "sgd", "lr": 0.1}])
def test_engine_equals_the_plain_loop(settings):
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults); ALA on every client
    at each download, BN statistics (bn=True) or the whole head weighed (layers=2)."""
    assert_matches_plain_loop("fedala", rounds=2, **settings)


def test_batched_eta_equals_single_runs():
    """η reaches ALA per configuration, and each configuration's start phase ends when its own clients converge."""
    assert_batched_equals_alone("fedala", {"eta": 4.0, "threshold": 0.02}, rounds=2)


# -- against PFLlib's release ------------------------------------------------------------------------------------
def release_runs(name: str = "fedala", broken: bool = False):
    """Per round (featcache's global Θ, every client's model, each one's test hits) and the transcription's, on the
    same data, parties, minibatches and sampled rows."""
    train, test = synthetic_clients(C=C, n=(20, 40), D=8, K=3, seed=0), synthetic_clients(C=C, n=(8, 16), D=8, K=3)
    algo = create(name)
    sgd = {"optimizer": "sgd", "momentum": 0.0, "weight_decay": 0.0, "lr": 0.05}
    ala = {"eta": 5.0, "rand_percent": 80, "layers": 1} if name == "fedala" else {}
    cfg = configure(algo, proj_dim=8, rounds=ROUNDS, batch_size=B, participation=RATE, **sgd, **ala)
    engine = Engine(algo, [cfg], train, test)
    x0 = {k: engine.state.params[k][0, 0].clone() for k in NAMES}
    ours = []
    for r in range(ROUNDS):
        acc = engine.run(until=r + 1)["acc"][-1, 0]  # [C]
        model = engine.algo.global_model(engine.state, engine.last_round)
        glob = x0 if model is None else {k: model[0][k][0] for k in NAMES}
        clients = [{k: engine.state.params[k][0, c].clone() for k in NAMES} for c in range(C)]
        ours.append((glob, clients, [round(float(acc[c]) * int(test.counts[c])) for c in range(C)]))
    seeds = torch.tensor([0])
    parties = [[c for c in range(C) if participation(seeds, r, C, RATE)[0, c]] for r in range(ROUNDS)]
    assert any(c not in parties[0] for c in parties[1]) and all(len(p) < C for p in parties)
    counts = [int(n) for n in train.counts]

    batches = release_batches(train, B, drop_last=True)

    offsets = lambda i, c: 0 if i == 0 else int(sampled_rows(seeds, i - 1, counts, 80)[0][0, c])  # round i's
    rows = [[(train.features[c, n], train.labels[c, n]) for n in range(counts[c])] for c in range(C)]
    tests = [(test.features[c, : int(test.counts[c])], test.labels[c, : int(test.counts[c])]) for c in range(C)]
    saved = ref_fedala.ALA.adaptive_local_aggregation

    def forgetful(self, global_model, local_model):  # W_i^p not kept: every aggregation starts from ones
        self.weights = None
        saved(self, global_model, local_model)

    if broken:
        ref_fedala.ALA.adaptive_local_aggregation = forgetful
    try:
        theirs = ref_fedala.fedala(x0, parties, rows, batches, offsets, 0.05, 1, B, 5.0, 80, 2, tests=tests)
    finally:
        ref_fedala.ALA.adaptive_local_aggregation = saved
    return ours, theirs


def largest_difference(ours, theirs, hits: bool = True) -> float:
    """The largest difference of the global and the clients' models over the rounds (and, with `hits`, the
    assertion that every round's evaluation scores the same test rows right)."""
    out = 0.0
    for (glob, clients, ours_hits), (glob_ref, clients_ref, ref_hits, _) in zip(ours, theirs):
        assert ours_hits == ref_hits or not hits
        for a, b in [(glob, glob_ref), *zip(clients, clients_ref)]:
            out = max(out, max(float((a[k] - b[k]).abs().max()) for k in a))
    return out


def test_fedala_is_pflibs_release_at_partial_participation():
    ours, theirs = release_runs()
    assert largest_difference(ours, theirs) < 2e-6
    epochs = [c.ALA.epochs for c in theirs[-1][3]]
    assert all(e[0] > 10 and e[1:] == [1] * (ROUNDS - 1) for e in epochs), epochs  # a start phase, then one epoch


def test_a_broken_transcription_and_fedavg_fail_the_comparison():
    assert largest_difference(*release_runs(broken=True), hits=False) > 1e-4
    assert largest_difference(*release_runs("fedavg"), hits=False) > 1e-4
