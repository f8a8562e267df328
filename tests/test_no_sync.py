"""No host synchronisation inside a round's local steps: counts the operations that read a device tensor back to
the host (`.item()`, `bool()`, `int()`, `float()` on a tensor, `.tolist()`, `.cpu()`, `.numpy()`) while
`Engine.local_train` runs one round, and asserts there are none. On a CPU the reads dispatch as
`aten::_local_scalar_dense` / `aten::item` / `aten::is_nonzero` (recorded with a TorchDispatchMode); `.tolist()`,
`.cpu()` and `.numpy()` of a CPU tensor dispatch nothing, so they are counted by wrapping the methods (conftest.py's
`host_reads`). Every registered algorithm."""

from __future__ import annotations

import pytest
from conftest import configure

from featcache.algorithms import create, list_algorithms
from featcache.training.engine import Engine


@pytest.mark.parametrize("name", sorted(list_algorithms()))
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("capture", ["off", "replay"])
def test_local_steps_never_read_the_device(name, optimizer, capture, data, host_reads):
    """Eager steps (the CPU's fused optimizers) and captured ones (masked optimizers, static slots, warm-up runs,
    following the CUDA-graph protocol on the CPU)."""
    train, test = data
    algo = create(name)
    cfg = configure(
        algo, fast=True, proj_dim=8, rounds=2, batch_size=16, drop_last=False, optimizer=optimizer, participation=0.75
    )
    eng = Engine(algo, [cfg, cfg | {"seed": 1}], train, test, capture=capture)
    state = eng.init_state()
    # host [H][C]: clients of different sizes (the masked paths); a cohort of P per configuration, or, where the
    # algorithm keeps optimizer state (P = C), a non-participant and a configuration where everyone steps
    everyone = eng.clients.P == eng.C
    part = [[c != 1 for c in range(eng.C)], [True] * eng.C if everyone else [c != 0 for c in range(eng.C)]]
    with host_reads() as reads:
        bad = eng.local_train(state, 0, part).bad
    assert reads == [], f"{name}: host reads {reads}"
    assert bad.shape == (eng.H, eng.C) and not bad.any()
