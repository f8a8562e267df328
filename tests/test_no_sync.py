"""No host synchronisation inside a round's local steps: counts the operations that read a device tensor back to
the host (`.item()`, `bool()`, `int()`, `float()` on a tensor, `.tolist()`, `.cpu()`, `.numpy()`) while
`Engine.local_train` runs one round, and asserts there are none. On a CPU the reads dispatch as
`aten::_local_scalar_dense` / `aten::item` / `aten::is_nonzero` (recorded with a TorchDispatchMode); `.tolist()`,
`.cpu()` and `.numpy()` of a CPU tensor dispatch nothing, so they are counted by wrapping the methods."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from featcache.algorithms import create
from featcache.training.engine import ENGINE_DEFAULTS, Engine
from tests.synthetic import synthetic_clients

READS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default"}
COPIES = ("tolist", "cpu", "numpy")


class HostReads(TorchDispatchMode):
    """Records every aten op that moves a tensor's value to the host."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def data():
    return synthetic_clients(seed=0, views=2), synthetic_clients(seed=1, views=2)


@pytest.mark.parametrize("name", ["fedavg", "fedpcl", "fedproto", "fedproc", "scaffold", "fedprox", "moon",
                                  "fedpft-con", "fedrep", "pfedme", "perfedavg", "fedamp",
                                  "fedcac", "pfedsd", "pfedgate"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("capture", ["off", "replay"])
def test_local_steps_never_read_the_device(name, optimizer, capture, data, monkeypatch):
    """Eager steps (the CPU's fused optimizers) and captured ones (masked optimizers, static slots, warm-up runs,
    following the CUDA-graph protocol on the CPU)."""
    train, test = data
    algo = create(name)
    cfg = ENGINE_DEFAULTS | algo.defaults | {"proj_dim": 8} | getattr(algo, "test_overrides", {}) | {
        "rounds": 2, "batch_size": 16, "drop_last": False, "optimizer": optimizer, "participation": 0.75}
    eng = Engine(algo, [cfg, cfg | {"seed": 1}], train, test, capture=capture)
    state = eng.init_state()
    part = [[c != 1 for c in range(eng.C)], [True] * eng.C]  # host [H][C]: a non-participant, clients of
    # different sizes (the masked paths) and a configuration where everyone steps (the slab path)
    copies: list[str] = []
    for method in COPIES:
        original = getattr(torch.Tensor, method)

        def counted(self, *a, _name=method, _orig=original, **k):
            copies.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counted)
    with HostReads() as mode:
        bad = eng.local_train(state, 0, part)
    monkeypatch.undo()
    assert mode.reads == [] and copies == [], f"{name}: host reads {mode.reads + copies}"
    assert bad.shape == (eng.H, eng.C) and not bad.any()
