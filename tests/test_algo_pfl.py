"""FedCAC, pFedSD and pFedGate (FedPFT Table 2's remaining baselines) against direct transcriptions of their papers'
equations on tiny tensors: explicit loops, their own forward pass, never the algorithms' helpers."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import configure

from featcache.algorithms import create
from featcache.algorithms.pfedgate import Layout, knapsack
from featcache.training.engine import Engine, State
from tests.synthetic import synthetic_clients
from tests.test_algo_personal import (
    D_IN,
    HID,
    K,
    KEYS,
    assert_batched_equals_alone,
    assert_dicts_close,
    batch,
    ce,
    grad_of,
    hp,
    logits_of,
    loss_and_grad,
    models,
    round_of,
    setup,
    tiny_model,
)


# -- FedCAC ------------------------------------------------------------------------------------------------------
def critical_reference(new: torch.Tensor, old: torch.Tensor, tau: float) -> torch.Tensor:
    """The released code's evaluate_critical_parameter for one tensor: top-τ of |(new − old)·new|."""
    c = ((new - old) * new).abs()
    metric = c.reshape(-1)
    nz = int(tau * metric.numel())
    top = torch.topk(metric, nz).values
    thresh = top[-1] if len(top) else math.inf
    if thresh <= 1e-10:
        rest = metric[metric > 1e-20]
        if len(rest):
            thresh = rest.sort().values[0]
    return (c >= thresh).float()


def test_fedcac_critical_parameters_are_the_most_sensitive():
    algo = setup("fedcac", tau=0.5)
    old, new = models(3, 0), models(3, 10)
    new["cls0.bias"][0, 1] = old["cls0.bias"][0, 1]  # a layer that did not move: threshold falls to the smallest >0
    state = State(
        params={k: v.clone() for k, v in new.items()},
        buffers={},
        client={"start": old, "critical": {k: torch.zeros_like(v) for k, v in new.items()}},
    )
    part = torch.tensor([[1, 1, 0]])
    algo.after_local(state, round_of(part))
    for c in range(3):
        for k in KEYS:
            want = critical_reference(new[k][0, c], old[k][0, c], 0.5) if c < 2 else torch.zeros_like(new[k][0, c])
            torch.testing.assert_close(state.client["critical"][k][0, c], want, msg=f"client {c} {k}")
    assert state.client["critical"]["proj0.weight"][0, 0].mean() == 0.5


def test_fedcac_server_collaborates_among_overlapping_clients():
    """Transcription of the released server: overlap, the growing threshold, the customized and global models."""
    algo, W = setup("fedcac"), models(4, 20)
    g = torch.Generator().manual_seed(3)
    masks = {k: (torch.rand(v.shape, generator=g) < 0.5).float() for k, v in W.items()}
    uploads = W | {"critical." + k: m for k, m in masks.items()}
    weights = torch.tensor([[10.0, 20.0, 30.0, 40.0]])
    t, beta = 3, 8.0
    rnd = round_of(torch.ones(1, 4), beta=[beta])
    rnd = type(rnd)(**{**rnd.__dict__, "round": t})
    state = State(params={k: v.clone() for k, v in W.items()}, buffers={}, client={"critical": masks})
    out = algo.aggregate(uploads, weights, state, rnd)
    flat = [torch.cat([masks[k][0, c].reshape(-1) for k in KEYS]) for c in range(4)]
    ov = [[1 - (flat[i] - flat[j]).abs().sum() / (flat[i].sum() * 2) for j in range(4)] for i in range(4)]
    others = [ov[i][j] for i in range(4) for j in range(4) if i != j]
    avg, mx = sum(others) / len(others), max(others)
    thresh = avg + (t + 1) / beta * (mx - avg)
    for i in range(4):
        collab = [i] + [j for j in range(4) if j != i and ov[i][j] >= thresh]
        for k in KEYS:
            torch.testing.assert_close(out["custom"][k][0, i], sum(W[k][0, j] for j in collab) / len(collab))
    for k in KEYS:
        torch.testing.assert_close(out["global"][k][0], sum(W[k][0, c] * weights[0, c] for c in range(4)) / 100)
    algo.download(state, out, rnd)
    for i in range(4):
        for k in KEYS:
            m = masks[k][0, i]
            mixed = m * out["custom"][k][0, i] + (1 - m) * out["global"][k][0]
            torch.testing.assert_close(state.params[k][0, i], mixed)


def test_fedcac_threshold_passes_the_maximum_late_in_training():
    """After β rounds no pair reaches the threshold: critical parameters stay with their own client."""
    algo, W = setup("fedcac"), models(3, 30)
    masks = {k: torch.ones_like(v) for k, v in W.items()}
    masks["cls0.bias"][0, 0] = 0
    uploads = W | {"critical." + k: m for k, m in masks.items()}
    rnd = round_of(torch.ones(1, 3), beta=[2.0])
    rnd = type(rnd)(**{**rnd.__dict__, "round": 5})
    out = algo.aggregate(uploads, torch.ones(1, 3), State(params=W, buffers={}), rnd)
    assert_dicts_close({k: v[0, 0] for k, v in out["custom"].items()}, {k: v[0, 0] for k, v in W.items()})


# -- pFedSD ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("has_teacher", [0.0, 1.0])
def test_pfedsd_loss_is_ce_plus_self_distillation(has_teacher):
    algo, w, teacher = setup("pfedsd"), tiny_model(0), tiny_model(1)
    x, y = batch(2)
    T, lam = 3.0, 0.7
    ctx = hp(temperature=T, lam=lam) | {"personal": teacher, "has_teacher": torch.tensor(has_teacher)}
    loss, g, _ = loss_and_grad(algo, w, x, y, torch.ones(6, dtype=torch.bool), ctx)

    def expected(p):
        s, t = logits_of(p, x), logits_of(teacher, x)
        kd = 0.0
        for n in range(len(x)):  # T²·KL(softmax(t/T) ‖ softmax(s/T)), row by row
            pt, ps = torch.softmax(t[n] / T, -1), torch.softmax(s[n] / T, -1)
            kd = kd + T * T * (pt * (pt.log() - ps.log())).sum()
        return ce(p, x, y) + has_teacher * lam * kd / len(x)

    torch.testing.assert_close(loss, expected(w))
    assert_dicts_close(g, grad_of(expected, w), atol=1e-6, rtol=1e-5)


def test_pfedsd_evaluates_and_distils_from_the_personalized_model():
    algo, w, personal = setup("pfedsd"), tiny_model(3), tiny_model(4)
    x, _ = batch(5)
    torch.testing.assert_close(algo.predict(w, {}, x, {"personal": personal}), logits_of(personal, x))
    W = models(3, 40)
    state = State(
        params={k: v.clone() for k, v in W.items()},
        buffers={},
        client={"personal": {k: torch.zeros_like(v) for k, v in W.items()}, "has_teacher": torch.zeros(1, 3)},
    )
    algo.after_local(state, round_of(torch.tensor([[1, 0, 1]])))
    for c in range(3):
        for k in KEYS:
            want = W[k][0, c] if c != 1 else torch.zeros_like(W[k][0, c])
            torch.testing.assert_close(state.client["personal"][k][0, c], want)
    torch.testing.assert_close(state.client["has_teacher"], torch.tensor([[1.0, 0.0, 1.0]]))


def test_pfedsd_first_round_equals_fedavg():
    train, test = synthetic_clients(C=3, n=(10, 20), seed=0), synthetic_clients(C=3, n=(10, 20), seed=1)
    sd, avg = (
        Engine(create(name), [configure(name, proj_dim=HID, rounds=1, batch_size=8)], train, test)
        for name in ("pfedsd", "fedavg")
    )
    sd.run(), avg.run()
    assert_dicts_close(sd.state.params, avg.state.params)


# -- pFedGate ----------------------------------------------------------------------------------------------------
def test_pfedgate_knapsack_takes_every_block_that_still_fits():
    """found_max_value_greedy: by value, descending, ties by block order; a block that does not fit is skipped and a
    later, smaller one still taken (so not a top-k)."""
    value = torch.tensor([0.0, 9, 8, 8, 2, 7, 7])  # block 0 is no item (a tensor's first block)
    sizes = [1, 5, 3, 3, 1, 2, 2]
    taken = knapsack(value, [1, 2, 3, 4], sizes, capacity=7.0)  # 5 fits; 3, 3 do not (8 > 7); 1 does
    assert taken.tolist() == [True, False, False, True]
    assert knapsack(value, [5, 6], sizes, capacity=2.0).tolist() == [True, False]  # a tie: the lower block
    batched = knapsack(torch.stack([value, value.flip(0)]), [1, 2, 3, 4], sizes, capacity=7.0)  # [2, 4]
    assert batched.tolist() == [[True, False, False, True], [False, True, True, True]]  # 3, 1, (5 no), 3


def test_pfedgate_layout_splits_every_tensor_in_contiguous_sub_blocks():
    lay = Layout((("w", 12, True), ("b", 4, True), ("bn", 7, False)), blocks=5, sparsity=0.5, dtype=torch.float32)
    assert lay.split == {"w": (0, 4, 3, 12), "b": (4, 4, 1, 4), "bn": (8, 4, 2, 7)}  # ⌈12/5⌉ = 3 -> 4 blocks
    assert lay.sizes == [3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 1]
    assert lay.items == [[1, 2, 3, 5, 6, 7], [9, 10, 11]]  # linear / other layers, first blocks never items
    assert lay.capacity == [round(12 * 0.3), round(5 * 0.3)] and lay.s_min == 0.2


def test_pfedgate_gates_are_straight_through():
    """Kept block j: value t_j, gradient 1 + t_j·[t_j > s_min] (t·(1 − sg(g) + g), g = max(t, s_min)); dropped: 0."""
    algo = setup("pfedgate", sparsity=0.5)
    lay = algo.layout(tuple(algo.shapes(tiny_model(0))))
    t = (torch.rand(lay.M, generator=torch.Generator().manual_seed(3)) * 0.9 + 0.05).requires_grad_(True)
    w = algo.gates(t, lay)
    w.sum().backward()
    keep = w.detach() != 0
    first = [b for b, *_ in lay.split.values()]
    assert keep[first].all() and not keep.all()
    torch.testing.assert_close(w.detach(), t.detach() * keep)
    torch.testing.assert_close(t.grad, keep * (1 + t.detach() * (t.detach() > lay.s_min)))


def released_scores(p: dict, x: torch.Tensor, algo) -> torch.Tensor:
    """One batch's sparse model written out: gates = mean of sigmoid(BN(Linear(x))) with running statistics,
    sub-block j of every flattened tensor scaled by its gate where kept, ReLU on the logits."""
    lay = algo.layout(tuple(algo.shapes(p)))
    h = x @ p["gate0.weight"].T + p["gate0.bias"]
    h = (h - p["gate0.bn.running_mean"]) / torch.sqrt(p["gate0.bn.running_var"] + 1e-5) * p["gate0.bn.weight"] + p[
        "gate0.bn.bias"
    ]
    w = algo.gates(torch.sigmoid(h).mean(0), lay)
    model = {}
    for k, (begin, n, each, numel) in lay.split.items():
        flat = p[k].reshape(-1).clone()
        for j in range(n):
            flat[j * each : (j + 1) * each] *= w[begin + j]
        model[k] = flat.view(p[k].shape)
    return torch.relu(logits_of(model, x))


def test_pfedgate_predicts_one_sparse_model_per_test_batch():
    """Consecutive batches of batch_size rows, one gate vector each: a row's score depends on its batch only."""
    algo, B = setup("pfedgate", batch_size=4), 4
    g = torch.Generator().manual_seed(5)
    params, buffers = algo.init(algo.full, D_IN, K, g)
    params = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in params.items()}
    buffers = {k: v.abs() + 0.5 if k.endswith("var") else v for k, v in buffers.items()}
    x = torch.randn(10, D_IN, generator=g)
    rows = torch.ones(10, dtype=torch.bool)
    scores = algo.predict(params, buffers, x, {"rows": rows})
    both = params | {k: v for k, v in buffers.items() if k.startswith("gate0")}
    held = both | {k: buffers["held." + k] for k in KEYS}
    expected = torch.cat([released_scores(held, x[s : s + B], algo) for s in range(0, 10, B)])
    torch.testing.assert_close(scores, expected)
    other = x.clone()
    other[1] += 3.0  # another row of the first batch
    changed = algo.predict(params, buffers, other, {"rows": rows})
    assert not torch.allclose(changed[0], scores[0]) and torch.equal(changed[B:], scores[B:])
    padded = torch.cat([x, torch.randn(3, D_IN, generator=g)])  # padding rows take no part in a batch's gates
    torch.testing.assert_close(algo.predict(params, buffers, padded, {"rows": torch.arange(13) < 10})[:10], scores)


def test_pfedgate_keeps_the_gating_layer_local():
    algo = setup("pfedgate")
    params, buffers = algo.init(algo.full, D_IN, K, torch.Generator())
    assert {k for k in params | buffers if algo.shared(k)} == set(KEYS)


# -- all three ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, over",
    [
        ("fedcac", {"beta": 2.0}),
        ("pfedsd", {"temperature": 1.5, "lam": 0.3}),
        ("pfedgate", {"lr": 3e-2, "lr_gate": 0.2}),
    ],
)
def test_batched_hyperparameters_equal_single_runs(name, over):
    assert_batched_equals_alone(name, over, rounds=3)
