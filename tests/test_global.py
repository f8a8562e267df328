"""The global-model metric: the server's aggregated model on the union of all clients' test rows.

Each number is checked against a computation by hand on tiny tensors: clients' models set to random values, the
server model aggregated with plain float64 arithmetic, the head's forward pass written out (x W₁ᵀ + b₁, ReLU,
W₂ᵀ + b₂), and the correct predictions counted over every test row of every client."""

from __future__ import annotations

import pytest
import torch
from conftest import configure

from featcache.algorithms import create, list_algorithms
from featcache.training.engine import Engine
from featcache.training.evaluate import evaluate, evaluate_global
from tests.synthetic import synthetic_clients

# Which algorithms have a server model to evaluate (each states why in its module docstring).
WITH_GLOBAL = {
    "fedavg",
    "fedprox",
    "scaffold",
    "moon",
    "fedproc",
    "fedproc-official",
    "fedcac",
    "fedrod",
    "pfedme",
    "pfedsd",
    "perfedavg",
    "fedavgm",
    "fedadagrad",
    "fedyogi",
    "fedadam",
    "moon-official",
    "fedlc",
    "feddecorr",
    "feddecorr-official",
    "fedntd",
    "fedntd-official",
    "fednova",
    "feddyn",
    "feddyn-official",
    "ditto",
    "fedbabu",
    "apfl",
    "apfl-official",
    "fedala",
    "feddbe",
    "fpl",
    "fpl-official",
    "ccvr",
    "ccvr-official",
    "fedetf",
}


def config(algo, **over) -> dict:
    return configure(algo, fast=True, **{"proj_dim": 6, "batch_size": 8, "drop_last": False} | over)


@pytest.fixture(scope="module")
def data():
    kw = dict(C=3, n=(9, 25), D=5, K=3, spread=3.0)  # noisy: the models get some rows wrong, unevenly per client
    return synthetic_clients(seed=0, **kw), synthetic_clients(seed=1, **kw)


def scramble(state, seed: int) -> dict:
    """Give every model its own random parameters (as if local training had moved them apart); returns a copy."""
    g = torch.Generator().manual_seed(seed)
    for k, v in state.params.items():
        state.params[k] = torch.randn(v.shape, generator=g)
    return {k: v.clone().double() for k, v in state.params.items()}  # [H, C, ...]


def server_step(eng, state, part):
    """The engine's server phase of one round (the algorithm's own hooks, as Engine.run calls them)."""
    now = eng.last_round = eng.round_context(0, part)
    eng.algo.after_local(state, now)
    uploads = eng.algo.upload(state, now)
    eng.algo.download(state, eng.algo.aggregate(uploads, eng.train.counts[None].float() * now.part, state, now), now)
    return now


def by_hand(w: dict, test, prefix: str = "cls0") -> float:
    """Pooled accuracy of one model (float64 tensors) on every test row of every client: correct / rows."""
    correct = rows = 0
    for c in range(test.features.shape[0]):
        n = int(test.counts[c])
        x, y = test.features[c, :n].double(), test.labels[c, :n]
        z = torch.relu(x @ w["proj0.weight"].T + w["proj0.bias"])
        logits = z @ w[f"{prefix}.weight"].T + w[f"{prefix}.bias"]
        correct += int((logits.argmax(-1) == y).sum())
        rows += n
    return correct / rows


def mean_over(clients: dict, weights: torch.Tensor) -> dict:
    """Σ_c w_c θ_c / Σ_c w_c for one configuration's client models name -> [C, ...]."""
    w = weights.double() / weights.double().sum()
    return {k: torch.einsum("c,c...->...", w, v) for k, v in clients.items()}


@pytest.mark.parametrize("name", ["fedavg", "fedcac", "pfedsd"])
def test_global_accuracy_is_the_weighted_mean_model_on_all_test_rows(name, data):
    """FedAvg's server model Σ n_k θ_k / Σ n_k over the participants; FedCAC's global part is the same mean (its
    clients hold mixed models); pFedSD predicts with its personal models but its server model with itself."""
    train, test = data
    algo = create(name)
    eng = Engine(algo, [config(algo), config(algo, seed=1)], train, test)
    state = eng.init_state()
    before = scramble(state, seed=7)
    part = [[True, False, True], [True, True, True]]  # configuration 0: client 1 sits the round out
    now = server_step(eng, state, part)
    got = evaluate_global(eng.algo, state, test, now)  # [H]
    for h in range(2):
        weights = train.counts * torch.tensor(part[h])  # n_k, 0 for absent clients
        w = mean_over({k: v[h] for k, v in before.items()}, weights)
        assert got[h].item() == pytest.approx(by_hand(w, test), abs=1e-6)
    per_client = evaluate(eng.algo, state, test, now)[0]  # pooled, not the unweighted mean of the clients' accuracies
    if name == "fedavg":
        assert got[0].item() != pytest.approx(per_client.mean().item(), abs=1e-6)


def test_fedrod_global_model_is_the_generic_head(data):
    """FedRoD's G-FL model: the averaged body and generic classifier, without any personal head."""
    train, test = data
    algo = create("fedrod")
    eng = Engine(algo, [config(algo)], train, test)
    state = eng.init_state()
    before = scramble(state, seed=3)
    now = server_step(eng, state, [[True] * 3])
    w = mean_over({k: v[0] for k, v in before.items() if not k.startswith("pcls")}, train.counts)
    assert evaluate_global(eng.algo, state, test, now)[0].item() == pytest.approx(by_hand(w, test), abs=1e-6)


def test_pfedme_global_model_is_the_servers_w(data):
    """pFedMe's GM: w = (1 − β) w_old + β · uniform mean of the participants' local models, evaluated as it is
    (not through a personalized θ̃)."""
    train, test = data
    algo = create("pfedme")
    eng = Engine(algo, [config(algo, beta=0.5)], train, test)
    state = eng.init_state()
    old = {k: v[0].double().clone() for k, v in state.server["global"].items()}
    before = scramble(state, seed=5)
    part = [[True, True, False]]
    now = server_step(eng, state, part)
    mean = mean_over({k: v[0] for k, v in before.items()}, torch.tensor(part[0]).double())
    w = {k: 0.5 * old[k] + 0.5 * mean[k] for k in mean}
    assert evaluate_global(eng.algo, state, test, now)[0].item() == pytest.approx(by_hand(w, test), abs=1e-6)


@pytest.mark.parametrize("name", sorted(list_algorithms()))
def test_which_algorithms_have_a_global_model(name, data):
    """A run records the global accuracy [R_eval, H] exactly for the algorithms whose server holds a model; it
    equals evaluating the final state's global model afresh."""
    train, test = synthetic_clients(seed=0, views=2), synthetic_clients(seed=1)
    algo = create(name)
    eng = Engine(algo, [config(algo, rounds=2, batch_size=16, drop_last=False)], train, test)
    out = eng.run()
    if name not in WITH_GLOBAL:
        assert out["global_acc"] is None and eng.algo.global_model(eng.state, eng.last_round) is None
        return
    assert out["global_acc"].shape == (2, 1)
    torch.testing.assert_close(out["global_acc"][-1], evaluate_global(eng.algo, eng.state, eng.test, eng.last_round))


# The algorithms whose clients all predict with the server's model after download: their global metric is pooled.
SERVER_OPTIMIZERS = {"fedavgm", "fedadagrad", "fedyogi", "fedadam"}
HOLD_GLOBAL = {"fedavg", "fedprox", "scaffold", "moon", "moon-official", "fedproc", "fedproc-official", "perfedavg"}
HOLD_GLOBAL |= {"fedlc", "feddecorr", "feddecorr-official", "fedntd", "fedntd-official", "fednova"}
HOLD_GLOBAL |= {"feddyn", "feddyn-official"}
HOLD_GLOBAL |= {"fpl", "fpl-official"}
HOLD_GLOBAL |= {"ccvr", "ccvr-official"}  # every client predicts with the calibrated classifier
HOLD_GLOBAL |= SERVER_OPTIMIZERS


@pytest.mark.parametrize("name", sorted(list_algorithms()))
def test_the_global_metric_is_pooled_from_the_clients_only_where_they_hold_the_global_model(name, data):
    """Where every client holds the server's model, the pooled client hits are exactly the separately evaluated
    global accuracy (partial participation, two configurations); elsewhere the engine evaluates it apart."""
    train, test = data
    algo = create(name)
    if name not in WITH_GLOBAL:
        return
    assert create(name).clients_hold_global == (name in HOLD_GLOBAL)
    if name not in HOLD_GLOBAL:
        return
    eng = Engine(
        algo,
        [config(algo, rounds=2, participation=0.5), config(algo, rounds=2, participation=0.5, seed=1)],
        train,
        test,
    )
    out = eng.run()
    apart = evaluate_global(eng.algo, eng.state, eng.test, eng.last_round)  # [H] its own forward pass
    assert torch.equal(out["global_acc"][-1], apart)
