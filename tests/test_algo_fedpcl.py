"""FedPCL (Tan et al., NeurIPS 2022, §4) against its paper's equations, transcribed here one sample, class and client
at a time in float64 on tiny tensors: local prototypes (eq. 5), global prototypes (eq. 6, literal and plain mean),
padding (eq. 7), the loss L_g + L_p (eq. 8–10, the denominators over A(y), the labels other than y), the prototype
exchange before round 1 (Alg. 1 line 1) and nearest-local-prototype inference. The head is run without BN here: BN
belongs to the head, not to the equations."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import client_model, configure

from featcache.algorithms import create
from featcache.cache import ClientData
from featcache.training.engine import Engine
from tests.synthetic import synthetic_clients

K, D, M = 4, 6, 5  # classes, feature width, projection width


def clients() -> ClientData:
    """3 clients; client 1 holds no row of class 3, client 2 none of classes 0 and 3 (eq. 7 has something to pad)."""
    data = synthetic_clients(C=3, n=(10, 14), D=D, K=K, seed=0)
    labels = data.labels.clone()
    labels[1][labels[1] == 3] = 2
    labels[2][(labels[2] == 0) | (labels[2] == 3)] = 1
    return ClientData(data.features, labels, data.counts, K)


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def engine(**settings) -> Engine:
    """fedpcl without BN on the three clients in float64, with `settings`; its state is the one before round 1."""
    data = clients()
    train = ClientData(data.features.double(), data.labels, data.counts, K)
    return Engine(create("fedpcl"), [configure("fedpcl", bn=False, proj_dim=M, batch_size=4, **settings)], train, train)


def z_of(params: dict, c: int, x: torch.Tensor) -> torch.Tensor:
    """The projection network FC + ReLU of client c's model: z(x) [M]."""
    return torch.relu(params["proj0.weight"][0, c] @ x + params["proj0.bias"][0, c])


def rows(data: ClientData, c: int):
    n = int(data.counts[c])
    return [(data.features[c, i], int(data.labels[c, i])) for i in range(n)]


def eq5(params, data, c, j):
    """C_i^(j) = 1/|D_ij| Σ_{(x,y) ∈ D_ij} z(x), or None when client c holds no row of class j."""
    zs = [z_of(params, c, x) for x, y in rows(data, c) if y == j]
    return sum(zs) / len(zs) if zs else None


def eq6(params, data, j, literal=True):
    """C̄^(j) = 1/|N_j| Σ_{i ∈ N_j} |D_ij|/N_j C_i^(j) (literal); the plain mean over N_j otherwise."""
    owners = [c for c in range(data.features.shape[0]) if eq5(params, data, c, j) is not None]
    size = {c: sum(1 for _, y in rows(data, c) if y == j) for c in owners}
    N_j = sum(size.values())
    if literal:
        return sum(size[c] / N_j * eq5(params, data, c, j) for c in owners) / len(owners)
    return sum(eq5(params, data, c, j) for c in owners) / len(owners)


def eq7(params, data, c, j, literal=True):
    """Client c's padded prototype of class j: its own, or the global one when it holds no row of j."""
    own = eq5(params, data, c, j)
    return own if own is not None else eq6(params, data, j, literal)


def contrast(z, y, protos, tau):
    """−log exp(z·C^(y)/τ) / Σ_{a ∈ A(y)} exp(z·C^(a)/τ), A(y) the labels other than y (eq. 8 and 9's summand)."""
    return -math.log(
        math.exp(float(z @ protos[y]) / tau) / sum(math.exp(float(z @ protos[a]) / tau) for a in range(K) if a != y)
    )


@pytest.mark.parametrize("global_agg", ["eq6", "mean"])
def test_prototypes_exchanged_before_round_1_are_eq5_eq6_eq7(global_agg, float64):
    eng = engine(global_agg=global_agg)
    literal = global_agg == "eq6"
    params, data, server = eng.state.params, eng.train, eng.state.server
    for j in range(K):
        torch.testing.assert_close(server["prototypes"][0, j], eq6(params, data, j, literal), rtol=0, atol=1e-12)
        for c in range(3):
            torch.testing.assert_close(server["padded"][0, c, j], eq7(params, data, c, j, literal), rtol=0, atol=1e-12)
            own = eq5(params, data, c, j)
            if own is not None:
                torch.testing.assert_close(eng.state.client["protos"][0, c, j], own, rtol=0, atol=1e-12)
    # literal eq. 6: the weights |D_ij|/N_j sum to 1 and are divided once more by |N_j|: shorter than the plain mean
    if literal:
        assert float(eq6(params, data, 0).norm()) < float(eq6(params, data, 0, literal=False).norm())


@pytest.mark.parametrize("terms", ["both", "global", "local"])
def test_local_loss_is_eq8_plus_eq9(terms, float64):
    """The mean over a batch of L_g + L_p per sample (eq. 10; the paper's Σ over D_i, divided by the batch size),
    L_p averaging the m = 3 clients' padded sets; `terms` keeps one of them (Table 6)."""
    eng = engine(terms=terms)
    c = 1
    params = {k: v[0, c] for k, v in eng.state.params.items()}
    buffers = {k: v[0, c] for k, v in eng.state.buffers.items()}
    ctx = torch.utils._pytree.tree_map(lambda t: t[0, c], eng.algo.context(eng.state, eng.round_context(0)))
    tau = float(ctx["hp"]["tau"])  # 0.07 as the run holds it (float32)
    assert tau == pytest.approx(0.07)
    batch = rows(eng.train, c)[:6]
    x = torch.stack([b[0] for b in batch])
    y = torch.tensor([b[1] for b in batch])
    loss, _ = eng.algo.local_loss(params, buffers, x, y, y >= 0, ctx)

    glob = [eq6(eng.state.params, eng.train, j) for j in range(K)]
    padded = [[eq7(eng.state.params, eng.train, p, j) for j in range(K)] for p in range(3)]
    total = 0.0
    for xi, yi in batch:
        z = z_of(eng.state.params, c, xi)
        l_g = contrast(z, int(yi), glob, tau)  # eq. 8
        l_p = sum(contrast(z, int(yi), padded[p], tau) for p in range(3)) / 3  # eq. 9
        total += {"both": l_g + l_p, "global": l_g, "local": l_p}[terms]
    assert float(loss) == pytest.approx(total / len(batch), rel=1e-10)


def test_inference_is_the_nearest_local_prototype_by_inner_product(float64):
    """Prediction: argmax_j z(x)·C_i^(j) over the client's own prototypes, after two rounds of training."""
    eng = engine(rounds=2)
    eng.run()
    state = eng.state
    for c in range(3):
        params, buffers, ctx = client_model(eng, c)
        x = eng.train.features[c, : int(eng.train.counts[c])]
        scores = eng.algo.predict(params, buffers, x, ctx)  # [n, K]
        for i in range(len(x)):
            z = z_of(state.params, c, x[i])
            own = [eq5(state.params, eng.train, c, j) for j in range(K)]
            sims = {j: float(z @ own[j]) for j in range(K) if own[j] is not None}
            assert int(scores[i].argmax()) == max(sims, key=sims.get)
