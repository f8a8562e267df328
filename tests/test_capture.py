"""Captured local steps (featcache/training/capture.py, steps.py): on the CPU the "replay" mode follows the CUDA
protocol (static slots, disarmed warm-up runs, one step function per key) and must give the eager run's results bit
for bit, for every algorithm; the checks that this comparison can fail break the protocol on purpose. On a GPU, real
CUDA graphs are compared with the eager GPU run."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import configure, fast_settings

from featcache.algorithms import create, list_algorithms
from featcache.training.capture import Static, resolve_mode, signature
from featcache.training.engine import Engine
from featcache.training.steps import LocalSteps
from featcache.errors import UserError
from featcache.testing import assert_capturable, masked_optimizers

ALGOS = sorted(list_algorithms())


def configs(name: str, **over) -> list[dict]:
    """Two configurations (other rate, other seed), uneven clients with a short last batch, partial participation."""
    algo = create(name)
    cfg = configure(
        algo,
        fast=True,
        **{"proj_dim": 8, "rounds": 3, "batch_size": 16, "drop_last": False, "participation": 0.75} | over,
    )
    return [cfg, cfg | {"seed": 1, "lr": cfg["lr"] * 2}]


def trained(name: str, data, capture_mode: str, device: str, **over) -> tuple[Engine, dict]:
    """A run with `capture_mode` on `device`: the engine and its results."""
    train, test = data
    engine = Engine(create(name), configs(name, **over), train, test, device=device, capture=capture_mode)
    out = engine.run()
    return engine, {"acc": out["acc"], "train_loss": out["train_loss"]} | {
        f"param {k}": v for k, v in engine.state.params.items()
    } | {f"buffer {k}": v for k, v in engine.state.buffers.items()}


def assert_close(a: dict, b: dict, name: str) -> None:
    assert a.keys() == b.keys()
    for k in a:  # float tolerance: graphs may pick other kernels than the eager run
        torch.testing.assert_close(
            a[k].cpu(), b[k].cpu(), equal_nan=True, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {k}: {m}"
        )


@pytest.mark.parametrize("name", ALGOS)
def test_replayed_steps_equal_eager_steps(name, data):
    assert assert_capturable(name, train=data[0], test=data[1], **fast_settings(name))


def test_two_epochs_and_phases_each_get_their_graph(data):
    """FedPFT+Con trains two phases (other trained names) and the last batch is short: four step kinds, and the
    context is loaded afresh in every epoch of every round."""
    with masked_optimizers():
        engine = Engine(create("fedpft-con"), configs("fedpft-con"), *data, capture="replay")
        engine.run()
    graphs = engine.clients.runner.graphs
    assert type(engine.clients.runner.opt).__name__.startswith("Masked") and not graphs.failures
    frozen_sets = {key[0] for key in graphs.steps}
    widths = {key[1] for key in graphs.steps}
    assert len(frozen_sets) == 2 and len(widths) == 2 and len(graphs.steps) == 4


@pytest.mark.parametrize("breakage", ["stale context", "armed warm-up", "stale batch", "replaced parameters"])
def test_the_comparison_fails_when_the_protocol_is_broken(breakage, data, monkeypatch):
    """The bit-for-bit comparison catches each way a captured step goes wrong on a GPU: a context not copied into
    its slot (FedProto's prototypes change every round), warm-up runs that train, a batch not copied, parameters
    replaced between rounds instead of updated in place."""
    if breakage == "stale context":
        original_load = Static.load

        def first_only(self, tree):  # the slot is filled when made, never again
            if not getattr(self, "filled", False):
                original_load(self, tree)
                self.filled = True

        monkeypatch.setattr(Static, "load", first_only)
    elif breakage == "armed warm-up":
        monkeypatch.setattr("featcache.training.steps.disarmed", lambda part: contextlib.nullcontext())
    elif breakage == "replaced parameters":  # a load() that makes new tensors: a graph keeps training the old ones
        from featcache.training import optim

        original_load = optim._Run.load

        def replacing(self, params, **kw):
            self.params = {k: v.clone() for k, v in self.params.items()}
            return original_load(self, params, **kw)

        monkeypatch.setattr(optim._Run, "load", replacing)
    else:
        original_replay = LocalSteps._replay

        def stale_batch(self, graphs, key, idx, *rest):  # every step replays on round 1's first batch
            first = self.__dict__.setdefault("first_idx", {}).setdefault(idx.shape, idx.clone())
            return original_replay(self, graphs, key, first, *rest)

        monkeypatch.setattr(LocalSteps, "_replay", stale_batch)
    with pytest.raises(AssertionError, match="differs from eager"):
        assert_capturable("fedproto", train=data[0], test=data[1])


def test_a_context_that_changes_every_round_stops_capturing(data, monkeypatch):
    """A plug-in whose context grows every round (here a schedule of all rounds so far) makes a new kind of step
    every round: after MAX_GRAPHS kinds the engine runs such steps eagerly (still equal to eager) instead of
    capturing without end."""
    from featcache.training import capture
    from featcache.algorithms.base import FedAvg

    class Schedule(FedAvg):
        name = "schedule-test"

        def context(self, state, rnd):
            past = 1.0 - torch.arange(max(rnd.round, 0) + 1, device=rnd.device) / rnd.rounds  # [r + 1]
            return super().context(state, rnd) | {"schedule": past.expand(rnd.H, rnd.C, -1)}  # [H, C, r + 1]

        def local_loss(self, params, buffers, x, y, mask, ctx):
            loss, new = super().local_loss(params, buffers, x, y, mask, ctx)
            return loss * ctx["schedule"][-1], new

    monkeypatch.setattr(capture, "MAX_GRAPHS", 3)
    with masked_optimizers():
        engine = Engine(Schedule(), configs("fedavg", rounds=4, drop_last=True), *data, capture="replay")
        engine.run()
    graphs = engine.clients.runner.graphs
    assert len(graphs.steps) == 3 and len(engine.clients.runner.contexts) == 3  # round 4's kind: no graph, no slot kept
    assert graphs.failures == {"more": "more than 3 kinds of step: the others run eagerly"}
    assert assert_capturable(Schedule(), rounds=4, train=data[0], test=data[1])


def test_local_train_called_again_for_the_same_round_reads_its_new_inputs(data):
    """The slots are refilled per call of local_train, not per round number: the same round trained twice with other
    participants and other prototypes gives the eager results."""
    out = {}
    with masked_optimizers():
        for mode in ("replay", "off"):
            engine = Engine(create("fedproto"), configs("fedproto"), *data, capture=mode)
            state = engine.init_state()
            P = engine.clients.P
            first, other = list(range(P)), list(range(engine.C - P, engine.C))  # P of C each
            engine.local_train(state, 0, [[c in first for c in range(engine.C)]] * 2)
            state.server["prototypes"] = state.server["prototypes"] + 1.0  # another context for the second call
            engine.local_train(state, 0, [[c in other for c in range(engine.C)]] * 2)
            out[mode] = {k: v.clone() for k, v in state.params.items()}
    for k, v in out["off"].items():
        torch.testing.assert_close(out["replay"][k], v, rtol=0, atol=0)


def test_an_algorithm_can_opt_out(data):
    algo = create("fedavg")
    algo.capturable = False
    engine = Engine(algo, configs("fedavg"), *data, capture="replay")
    assert engine.clients.runner.graphs is None


def test_static_slots_keep_broadcasts_compact():
    base = torch.randn(2, 5, 3)  # [H, K, d]
    tree = {"padded": base[:, None, None].expand(2, 4, 4, 5, 3), "n": 7, "hp": {"lr": torch.ones(2)}}
    slot = Static(tree)
    assert slot.tree["padded"].untyped_storage().nbytes() == base.numel() * 4  # not 16x
    newer = torch.randn(2, 5, 3)
    slot.load(tree | {"padded": newer[:, None, None].expand(2, 4, 4, 5, 3)})
    assert torch.equal(slot.tree["padded"][:, 3, 1], newer) and slot.tree["n"] == 7
    assert signature(tree) != signature(tree | {"n": 8})  # a host value is baked into the graph: another key
    assert signature(tree) != signature(tree | {"padded": torch.randn(2, 4, 4, 5, 3)})  # no longer a broadcast
    assert signature(tree) == signature(tree | {"hp": {"lr": torch.zeros(2)}})  # values are not part of it


def test_modes(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setenv("FEATCACHE_CAPTURE", "off")
    assert resolve_mode("auto", gpu) == "off" and resolve_mode("replay", gpu) == "replay"  # an argument wins
    monkeypatch.delenv("FEATCACHE_CAPTURE")
    assert resolve_mode("auto", cpu) == "off" and resolve_mode(None, gpu) == "cuda"
    assert resolve_mode("replay", cpu) == "replay"
    with pytest.raises(UserError, match="needs a CUDA device"):
        resolve_mode("cuda", cpu)
    with pytest.raises(UserError, match="must be one of"):
        resolve_mode("graphs", cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ALGOS)
def test_cuda_graphs_equal_eager_on_the_gpu(name, data):
    engine, captured = trained(name, data, "cuda", device="cuda")
    _, eager = trained(name, data, "off", device="cuda")
    assert not engine.clients.runner.graphs.failures, engine.clients.runner.graphs.failures
    assert_close(captured, eager, name)


class FakeCuda:
    """Stands in for torch.cuda in Graphs._cuda: records the protocol (warm-up on a side stream, capture inside
    torch.cuda.graph with the shared pool) and can fail the capture."""

    def __init__(self, fail: bool = False):
        self.log: list[str] = []
        self.fail = fail
        self.capturing = False
        fake = self

        class Stream:
            def wait_stream(self, other):
                fake.log.append("wait")

        class CUDAGraph:
            def pool(self):
                return "pool"

            def replay(self):
                fake.log.append("replay")

        @contextlib.contextmanager
        def graph(g, pool=None):
            fake.log.append(f"capture(pool={pool})")
            fake.capturing = True
            try:
                yield
                if fake.fail:
                    raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
            finally:
                fake.capturing = False

        self.Stream, self.CUDAGraph, self.graph = Stream, CUDAGraph, graph
        self.current_stream = lambda: Stream()
        self.stream = lambda s: contextlib.nullcontext()
        self.synchronize = lambda: fake.log.append("sync")
        self.device = lambda d: fake.log.append(f"device {d}") or contextlib.nullcontext()
        self.set_stream = lambda s: fake.log.append("stream restored")


@pytest.mark.parametrize("fail", [False, True])
def test_cuda_protocol_with_a_fake_cuda(fail, monkeypatch):
    """Warm-up runs and the capture happen disarmed; graphs share one pool; a capture that fails leaves the step
    running eagerly, with one line saying why."""
    from featcache.training import capture

    fake = FakeCuda(fail)
    monkeypatch.setattr(capture.torch, "cuda", fake)
    part = torch.ones(2, 3, dtype=torch.bool)
    seen = []

    def fn():
        seen.append(("captured" if fake.capturing else "eager", bool(part.any())))
        fake.log.append("step")

    graphs = capture.Graphs("cuda", torch.device("cuda", 1))
    graphs.capture("a", fn, capture.disarmed(part))
    graphs.capture("b", fn, capture.disarmed(part))
    assert seen[: capture.WARMUP + 1] == [("eager", False)] * capture.WARMUP + [("captured", False)]
    assert bool(part.all())  # re-armed after capture
    graphs.run("a")
    assert fake.log[0] == "device cuda:1" and fake.log.count("device cuda:1") == 3  # two captures and the run
    assert fake.log.count("stream restored") == 2  # after each capture, failed or not
    if fail:
        assert set(graphs.failures) == {"a", "b"}
        assert graphs.failures["a"] == "RuntimeError: operation not permitted when stream is capturing"
        assert seen[-1] == ("eager", True) and graphs.pool is None  # the step itself, run eagerly
    else:
        assert not graphs.failures and fake.log[-1] == "replay"
        assert "capture(pool=None)" in fake.log and "capture(pool=pool)" in fake.log  # the second graph shares it
