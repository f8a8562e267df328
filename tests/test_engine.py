"""The round engine: vectorized training equals a plain per-client loop for every registered algorithm, every
algorithm learns on separable data, and the engine's pieces (batch order, participation, optimizers) behave."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import configure

from featcache.algorithms import create, list_algorithms
from featcache.training import evaluate
from featcache.training.engine import Engine
from featcache.training.evaluate import stale_cohorts
from featcache.training.hparams import HParams
from featcache.training.optim import SGD, Adam
from featcache.training.cohort import Cohort
from featcache.training.schedule import batch_order, participation
from featcache.testing import plain_loop, synthetic_clients

ALGOS = sorted(list_algorithms())


def config(algo, **over) -> dict:
    return configure(algo, fast=True, proj_dim=8, **over)


# pFedGate's gate weights have near-zero gradients that Adam normalises to steps of the learning rate's size: the
# float32 rounding of batch sums, which a vectorized step of any prefix width orders differently from the plain loop,
# comes out amplified to ~1e-5 on a few elements
ATOL = {"pfedgate": 1e-4}


@pytest.mark.parametrize("name", ALGOS)
def test_vectorized_equals_plain_loop(name, data):
    train, test = data
    algo = create(name)
    cfg = config(algo, rounds=3, batch_size=16, drop_last=False, participation=0.75)
    vec = Engine(algo, [cfg], train, test)
    out = vec.run()
    ref_acc, ref_params = plain_loop(create(name), cfg, train, test)
    torch.testing.assert_close(out["acc"][:, 0], ref_acc, rtol=0, atol=1e-6)
    assert set(vec.state.params) == set(ref_params)
    for k, v in vec.state.params.items():  # the trained parameters themselves, not only accuracies
        torch.testing.assert_close(
            v[0], ref_params[k], atol=ATOL.get(name, 1e-5), rtol=1.3e-6, msg=lambda m: f"{name} {k}: {m}"
        )


@pytest.mark.parametrize("name", ALGOS)
def test_learns_separable_data(name, data):
    train, test = data
    algo = create(name)
    out = Engine(algo, [config(algo, rounds=20, batch_size=16, lr=1e-2)], train, test).run()
    assert out["acc"][-1].mean() > 0.6, f"{name} reached {out['acc'][-1].mean():.2f} (chance 0.2)"


def test_batched_configs_equal_single_runs(data):
    train, test = data
    algo = create("fedavg")
    cfgs = [config(algo, rounds=3, lr=lr, seed=s) for lr, s in [(1e-2, 0), (1e-3, 1), (3e-2, 2)]]
    batched = Engine(algo, cfgs, train, test).run()["acc"]  # [R, H, C]
    for h, cfg in enumerate(cfgs):
        alone = Engine(create("fedavg"), [cfg], train, test).run()["acc"][:, 0]
        torch.testing.assert_close(batched[:, h], alone)


def test_batch_order_is_a_permutation_of_valid_rows():
    counts = torch.tensor([5, 9, 1])
    order = batch_order(torch.tensor([0, 7]), rnd=3, epoch=1, counts=counts, n_max=9)  # [H, C, N]
    for h in range(2):
        for c, n in enumerate(counts.tolist()):
            assert sorted(order[h, c, :n].tolist()) == list(range(n))
    assert not torch.equal(order[0], order[1])  # other seed, other order
    torch.testing.assert_close(order, batch_order(torch.tensor([0, 7]), 3, 1, counts, 9))


def test_a_cohorts_batch_order_is_its_clients_order_among_all():
    seeds, counts = torch.tensor([0, 5]), torch.tensor([7, 3, 9, 1, 4])
    full = batch_order(seeds, 2, 1, counts, 9)  # [H, C, N]
    ids = torch.tensor([[0, 3], [2, 4]])  # [H, P]
    assert torch.equal(batch_order(seeds, 2, 1, counts, 9, clients=ids), full[torch.arange(2)[:, None], ids])


def test_cohort_gathers_and_writes_back_only_its_clients():
    part = [[True, False, True, False], [False, True, True, False]]  # [H][C], 2 of 4 each
    cohort = Cohort(part, 2, torch.device("cpu"))
    assert cohort.host == [[0, 2], [1, 2]] and not cohort.everyone
    state = torch.arange(2 * 4 * 3.0).reshape(2, 4, 3)  # [H, C, d]
    taken = cohort.take(state)  # [H, P, d]
    assert torch.equal(taken[1, 0], state[1, 1]) and torch.equal(taken[0, 1], state[0, 2])
    back = cohort.put(state.clone(), taken + 100)
    assert torch.equal(back - state, torch.tensor(part)[..., None].float().expand(-1, -1, 3) * 100)
    wide = torch.randn(2, 1, 5).expand(2, 4, 5)  # a broadcast over clients stays one
    assert cohort.take(wide).stride(1) == 0 and torch.equal(cohort.take(wide), wide[:, :2])
    first, second = Cohort.slices(part, 2, 1, torch.device("cpu"))  # one model per configuration at a time
    assert first.host == [[0], [1]] and second.host == [[2], [2]] and first.part == [[True], [True]]
    assert len(Cohort.slices(part, 2, 5, torch.device("cpu"))) == 1
    everyone = Cohort.slices([[True] * 4] * 2, 4, 3, torch.device("cpu"))  # the last slice padded, sitting out
    assert [c.host for c in everyone] == [[[0, 1, 2]] * 2, [[3, 0, 1]] * 2] and not everyone[0].everyone
    assert everyone[1].part == [[True, False, False]] * 2 and everyone[1].real == 1
    back = everyone[1].put(torch.zeros(2, 4), torch.ones(2, 3))  # the padding is not written back
    assert torch.equal(back, torch.tensor([[0.0, 0, 0, 1]] * 2))
    with pytest.raises(ValueError):
        Cohort([[True] * 4, [True, False, False, False]], 2, torch.device("cpu"))


def test_a_round_trains_only_its_participants(data):
    """Optimizer moments, gradients and the step's batch exist for the P participants, not the C clients."""
    train, test = data
    algo = create("fedavg")
    eng = Engine(
        algo,
        [config(algo, rounds=2, participation=0.5), config(algo, rounds=2, participation=0.5, seed=1)],
        train,
        test,
    )
    assert eng.clients.P == eng.C // 2
    shapes = {tuple(v.shape[:2]) for v in (*eng.clients.runner.opt.params.values(), *eng.clients.runner.opt.m.values())}
    assert shapes == {(2, eng.clients.P)}
    seen = []
    original = eng.clients.runner._step
    eng.clients.runner._step = lambda held, batch, *a: seen.append(batch.idx.shape[:2]) or original(held, batch, *a)
    eng.run()
    assert set(seen) == {(2, eng.clients.P)}
    full = Engine(algo, [config(algo, rounds=2)], train, test)
    assert full.clients.P == full.C and full.clients.runner.opt.params["cls0.weight"].shape[:2] == (1, full.C)


def test_a_fedavg_server_never_writes_the_shared_tensors_into_every_clients_state(data):
    """FedAvg's server at p < 1: the participants' shared tensors are averaged as they trained, and the [H, C] state
    keeps one broadcast model per configuration (personal ones, FedPer's classifier, per client), FedProx's w^t
    included (`uses_global`); an overridden server side (MOON's after_local, which keeps each client's trained
    model) gets every tensor written back. The same where the participants train in slices (`at_once`), and the
    run is the one trained in one pass."""
    train, test = data
    cases = (("fedavg", set()), ("fedper", {"cls0.weight", "cls0.bias"}), ("fedprox", set()), ("moon", None))
    for (name, personal), at_once in itertools.product(cases, (None, 1)):
        algo = create(name)
        eng = Engine(algo, [config(algo, rounds=2, participation=0.5)], train, test, at_once=at_once)
        got = eng.run()
        if at_once:
            assert eng.clients.at_once == 1 < eng.clients.P
            whole = Engine(algo, [config(algo, rounds=2, participation=0.5)], train, test).run()
            torch.testing.assert_close(got["acc"], whole["acc"], rtol=0, atol=1e-6)
        if personal is None:
            assert eng.clients.aside == ()
            continue
        assert set(eng.clients.aside) == set(eng.state.params) - personal
        for k, v in eng.state.params.items():
            assert (v.stride(1) == 0) == (k not in personal), k  # broadcast: one model per configuration


@pytest.mark.parametrize("name", ["fedavg", "fedper", "fedprox"])
def test_participants_trained_in_one_pass_in_id_order_upload_their_trained_tensors_uncopied(name):
    """FedAvg's server at p < 1 with every participant in one pass: where the step order is the clients' ids (equal
    clients), the uploads are the trained tensors themselves (no [H, P] buffer is made); where it is not (uneven
    clients), they are copied into id order. Either run is the one trained in slices."""
    algo = create(name)
    for n, copied in (((40, 40), False), ((20, 60), True)):
        train, test = synthetic_clients(C=6, n=n, seed=0), synthetic_clients(C=6, n=n, seed=1)
        cfg = [config(algo, rounds=2, participation=0.5, batch_size=8, drop_last=False)]
        whole, sliced = Engine(algo, cfg, train, test), Engine(algo, cfg, train, test, at_once=1)
        a, b = whole.run(), sliced.run()
        assert whole.clients.aside and bool(whole.clients.sent) == copied, n
        torch.testing.assert_close(a["acc"], b["acc"], rtol=0, atol=1e-6)
        for k, v in whole.state.params.items():
            torch.testing.assert_close(sliced.state.params[k], v, msg=lambda m: f"{name} {n} {k}: {m}")


@pytest.mark.parametrize("name", ALGOS)
def test_training_the_cohort_in_slices_gives_the_same_run(name, data):
    """`at_once` bounds the models one pass of local training holds; the participants train in slices of that many
    with the same batches, so the run is the same (full participation and p < 1)."""
    train, test = data
    algo = create(name)
    for p in (1.0, 0.75):
        cfgs = [
            config(algo, rounds=2, batch_size=16, drop_last=False, participation=p),
            config(algo, rounds=2, batch_size=16, drop_last=False, participation=p, seed=1),
        ]
        whole, sliced = Engine(algo, cfgs, train, test), Engine(algo, cfgs, train, test, at_once=2)
        assert sliced.clients.at_once == (sliced.clients.P if algo.keeps_optimizer_state else 2)
        a, b = whole.run(), sliced.run()
        torch.testing.assert_close(b["acc"], a["acc"], rtol=0, atol=1e-6)
        torch.testing.assert_close(b["train_loss"], a["train_loss"], rtol=1e-6, atol=1e-6, equal_nan=True)
        for k, v in whole.state.params.items():
            torch.testing.assert_close(sliced.state.params[k], v, msg=lambda m: f"{name} p={p} {k}: {m}")


PERSONAL = [n for n in ALGOS if create(n).bind(config(create(n))).personal_predict]


@pytest.mark.parametrize("name", PERSONAL)
def test_non_participants_keep_their_scores(name, data, monkeypatch):
    """Where `predict` is personal, an evaluation scores again only the clients that trained since the last one
    (in cohorts of at most `at_once` models) and keeps the others' figures: the records equal those of scoring
    every client at every evaluation of the same training, so the declaration holds. (Training in other slices
    may round differently: `test_training_the_cohort_in_slices_gives_the_same_run`.)"""
    train, test = data
    algo = create(name)
    C = train.features.shape[0]
    cfgs = [
        config(algo, rounds=4, batch_size=16, drop_last=False, participation=0.5, eval_every=1, seed=s) for s in (0, 1)
    ]
    widths, scores, cohort_scores = [], evaluate.scores, evaluate.cohort_scores

    def spy(algo, state, data, rnd, model=None, first=False):
        if model is None:  # the clients' own models (a global model changes every round)
            widths.append(C)
        return scores(algo, state, data, rnd, model, first)

    def cohort_spy(algo, models, data, cohort):
        widths.append(cohort.ids.shape[1])
        return cohort_scores(algo, models, data, cohort)

    monkeypatch.setattr(evaluate, "scores", spy)
    monkeypatch.setattr(evaluate, "cohort_scores", cohort_spy)
    reused = Engine(algo, cfgs, train, test, at_once=1).run()
    assert widths[:2] == [C, C] and widths[2:] and max(widths[2:]) == 1  # test and train rows, then cohorts of 1
    for logs in (True, False):
        monkeypatch.setattr(type(algo), "personal_predict", False)
        every = Engine(algo, cfgs, train, test, at_once=1).run(logs=logs)  # the same training, in the same slices
        monkeypatch.undo()
        again = Engine(algo, cfgs, train, test, at_once=1).run(logs=logs) if not logs else reused
        for k in ("test_acc", "test_loss", "train_acc", "global_acc"):
            if every.get(k) is not None:
                assert torch.equal(again[k], every[k]), (name, k, logs)


def test_stale_cohorts_pad_each_configuration_with_its_own_clients():
    stale = [[False, True, False, True, True], [True, False, False, False, False]]
    cohorts = stale_cohorts(stale, 2, torch.device("cpu"))
    assert [c.host for c in cohorts] == [[[1, 3], [0, 0]], [[4], [0]]]
    assert stale_cohorts([[True] * 3, [False, True, False]], 2, torch.device("cpu")) is None  # one has every client
    assert [c.host for c in stale_cohorts([[False] * 3], 4, torch.device("cpu"))] == [[[0]]]


def test_participation_rate():
    part = participation(torch.tensor([0, 1, 2]), rnd=0, C=10, rate=0.3)
    assert part.shape == (3, 10) and (part.sum(1) == 3).all()
    assert not torch.equal(part[0], participation(torch.tensor([0]), rnd=1, C=10, rate=0.3)[0])


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_stacked_optimizer_matches_torch(opt_name, layout):
    """Slabs (all clients step), per-model views (some do), gradients in a linear layer's transposed layout, and a
    second round started by `load` from other models: all equal torch.optim, model by model."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(2, 3, 4, 5, generator=g)  # [H, C, d_out, d_in]
    lr, wd = torch.tensor([1e-2, 1e-1]), torch.tensor([1e-4, 1e-2])
    make = Adam if opt_name == "adam" else SGD
    ours, opt = {"w": p0.clone()}, None
    refs = [[p0[h, c].clone().requires_grad_(True) for c in range(3)] for h in range(2)]
    for rnd in range(2):  # one optimizer for the run; `load` starts round 2 (moments and counts zeroed)
        if opt is None:
            opt = make(ours, HParams.of({"lr": lr, "weight_decay": wd, "momentum": torch.tensor([0.9, 0.5])}))
        else:
            ours = opt.load({"w": ours["w"] * 0.5})
            refs = [[(r.detach() * 0.5).requires_grad_(True) for r in row] for row in refs]
        torch_opts = [
            [
                (
                    torch.optim.Adam([refs[h][c]], lr=float(lr[h]), weight_decay=float(wd[h]))
                    if opt_name == "adam"
                    else torch.optim.SGD(
                        [refs[h][c]], lr=float(lr[h]), weight_decay=float(wd[h]), momentum=[0.9, 0.5][h]
                    )
                )
                for c in range(3)
            ]
            for h in range(2)
        ]
        for step in range(5):
            grad = torch.randn(2, 3, 4, 5, generator=g)
            grad = grad.mT.contiguous().mT if layout == "transposed" else grad  # how autograd returns x @ W.T's
            active = torch.ones(2, 3, dtype=torch.bool) if step < 2 else torch.rand(2, 3, generator=g) > 0.3
            ours = opt.step({"w": grad}, active)
            for h in range(2):
                for c in range(3):
                    if active[h, c]:
                        refs[h][c].grad = grad[h, c].clone()
                        torch_opts[h][c].step()
        assert ours["w"].stride() == grad.stride()  # the parameter adopted its gradient's layout
        torch.testing.assert_close(ours["w"], torch.stack([torch.stack([r.detach() for r in row]) for row in refs]))


def test_moments_move_into_the_gradients_layout_within_their_memory():
    """A linear weight's gradient arrives transposed: the moments adopt that layout in the memory they have (moved
    through a bounded temporary, values kept), so the first step holds no second copy of them."""
    from featcache.training.optim import _relayout

    g = torch.Generator().manual_seed(0)
    opt = Adam({"w": torch.randn(2, 3, 4, 5, generator=g)}, HParams.of({"lr": [1e-2, 1e-2], "weight_decay": [0, 0]}))
    before = {k: getattr(opt, k)["w"].data_ptr() for k in ("m", "v")}
    grad = torch.randn(2, 3, 5, 4, generator=g).mT  # [H, C, d_out, d_in] in x @ W.T's layout
    opt.step({"w": grad}, torch.ones(2, 3, dtype=torch.bool))
    for k in ("m", "v"):
        assert getattr(opt, k)["w"].stride() == grad.stride() and getattr(opt, k)["w"].data_ptr() == before[k]
    t = torch.randn(2, 3, 4, 5, generator=g)
    moved = _relayout(t.clone(), grad, chunk=2 * 4 * 5 * 4)  # two models per temporary
    assert torch.equal(moved, t) and moved.stride() == grad.stride()


def test_clamped_logsumexp_equals_torch_and_survives_empty_rows():
    """The fast logsumexp (underflowing exponents clamped) gives torch's values and gradients, including −inf
    masks; a row with nothing left (supervised contrast over a batch with one valid row) stays finite."""
    from featcache.algorithms.base import logsumexp
    from featcache.algorithms.fedpcl import supcon

    g = torch.Generator().manual_seed(0)
    s = (torch.randn(4, 7, 9, generator=g) * 60).requires_grad_(True)  # / τ = 0.07 scale: most terms underflow
    mask = torch.rand(4, 7, 9, generator=g) < 0.3
    ours = logsumexp(s.masked_fill(mask, float("-inf")))
    ref = torch.logsumexp(s.masked_fill(mask, float("-inf")), -1)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(torch.autograd.grad(ours.sum(), s)[0], torch.autograd.grad(ref.sum(), s)[0])
    assert torch.isfinite(logsumexp(torch.full((2, 3), float("-inf")))).all()
    z = torch.randn(4, 5, generator=g)
    loss = supcon(z, torch.tensor([0, 1, 0, 2]), torch.tensor([True, False, False, False]), 0.07)
    assert torch.isfinite(loss).all() and (loss == 0).all()


def test_register_refuses_a_duplicate_name():
    from featcache.algorithms import register
    from featcache.algorithms.base import FedAvg
    from featcache.errors import UserError

    class Impostor(FedAvg):
        name = "fedavg"

    with pytest.raises(UserError, match="'fedavg' is already registered by featcache.algorithms.base.FedAvg"):
        register(Impostor)
    assert list_algorithms()["fedavg"] is FedAvg


def test_hooks_get_a_read_only_round_and_only_shared_settings(data):
    """A hook cannot read configuration 0's float as if it held for the grid: per-configuration floats exist only as
    [H] tensors; the round context is frozen; the caller's algorithm object is not modified."""
    import dataclasses

    train, test = data
    algo = create("fedprox")
    cfgs = [config(algo, rounds=1, lr=lr, mu=mu) for lr, mu in [(1e-2, 0.1), (1e-3, 0.5)]]
    eng = Engine(algo, cfgs, train, test)
    assert not algo.cfg and eng.algo is not algo  # the caller's object stays unbound
    assert "lr" not in eng.algo.cfg and "mu" not in eng.algo.cfg and eng.algo.cfg["batch_size"] == cfgs[0]["batch_size"]
    with pytest.raises(TypeError):
        eng.algo.cfg["proj_dim"] = 3
    now = eng.round_context(0)
    torch.testing.assert_close(now.hp["mu"], torch.tensor([0.1, 0.5]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        now.round = 1
    assert now.part.shape == (2, eng.C) and now.part.all() and now.steps_per_epoch == max(now.client_steps.tolist())


def test_no_algorithm_imports_another_algorithms_file():
    """Shared helpers live in algorithms/base.py, protos.py and heads.py; an algorithm file imports no other
    algorithm's."""
    import ast
    from pathlib import Path

    import featcache.algorithms as pkg

    shared = {"base", "protos", "heads", "registry", "plugins", ""}
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                assert (node.module or "") in shared, f"{path.name} imports .{node.module}"


def test_readme_example_algorithm_equals_fedprox(data):
    """The training guide's "Write your own algorithm" FedProx runs as written and trains as the built-in one, whose
    proximal gradient is the closed form μ (w − w^t) rather than autograd's: float32 rounding apart."""
    import re
    from pathlib import Path

    from featcache.algorithms.registry import _ALGOS

    guide = Path(__file__).resolve().parents[1].joinpath("docs/guides/training.md").read_text()
    section = guide.split("## Write your own algorithm", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    train, test = data
    try:
        exec(compile(code, "docs/guides/training.md", "exec"), {})
        cfg = config(create("fedprox"), rounds=2, mu=0.5)
        mine, builtin = Engine(create("myprox"), [cfg], train, test), Engine(create("fedprox"), [cfg], train, test)
        mine.run(), builtin.run()
    finally:
        _ALGOS.pop("myprox", None)
    for k, v in builtin.state.params.items():
        torch.testing.assert_close(mine.state.params[k], v, rtol=0, atol=1e-6)


def test_put_models_writes_each_model_whatever_the_layouts():
    """cohort.put_models: models written into their places, equal whether source and destination share a layout
    (row-major, or last two dims transposed, square ones included) or not."""
    from featcache.training.cohort import models_like, put_models

    src = torch.randn(2, 3, 4, 4)  # [H, n, 4, 4]: square, where a layout mix-up would pass a shape check
    at = torch.tensor([[4, 0, 2], [1, 3, 0]])
    for s, d in itertools.product((src, src.mT.contiguous().mT), repeat=2):
        dst = models_like(d, 5)
        dst.zero_()
        put_models(dst, at, s)
        for h in range(2):
            torch.testing.assert_close(dst[h, at[h]], src[h], rtol=0, atol=0)
