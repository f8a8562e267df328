"""The hooks' order is written once, in training/engine.py (`initial_state`, `Engine.local_train`'s epochs,
`client_side`, `server_side`): the engine, the footprint's meta replay (training/footprint.py) and the plain
per-client loop (`featcache.testing.plain_loop`) call an algorithm's hooks in the same sequence. A spy subclass of
each built-in algorithm records its hook calls (those its own hooks make too); a sequence is compared with its
repetitions folded (steps, clients, epochs and rounds repeat the same calls), the replay's in the hooks it runs
(`footprint.REPLAYED`)."""

from __future__ import annotations

import pytest
from conftest import configure

from featcache.algorithms import create, list_algorithms
from featcache.testing import plain_loop
from featcache.training import footprint
from featcache.training.engine import Engine

HOOKS = (
    "init",
    "init_state",
    "context",
    "local_loss",
    "after_step",
    "after_local",
    "upload",
    "aggregate",
    "download",
    "predict",
)


def spy(name: str):
    """An instance of a subclass of algorithm `name` whose hooks append their names to its class's `calls`."""
    base = type(create(name))

    def recorded(hook: str):
        def method(self, *args, **kwargs):
            type(self).calls.append(hook)
            return getattr(base, hook)(self, *args, **kwargs)

        return method

    cls = type(f"Spy{base.__name__}", (base,), {"calls": [], **{h: recorded(h) for h in HOOKS}})
    return cls()


def folded(calls: list[str]) -> list[str]:
    """`calls` with every immediate repetition of a call, or of a run of calls, folded into one: (a b a b c) -> (a b
    c)."""
    out = list(calls)
    changed = True
    while changed:
        changed = False
        for width in range(1, len(out) // 2 + 1):
            i = 0
            while i + 2 * width <= len(out):
                if out[i : i + width] == out[i + width : i + 2 * width]:
                    del out[i + width : i + 2 * width]
                    changed = True
                else:
                    i += 1
    return out


def test_folding_keeps_the_order_and_drops_repetitions():
    assert folded(list("aabababc")) == list("abc")
    assert folded(list("abcabcd")) == list("abcd") and folded(list("abcb")) == list("abcb")


@pytest.mark.parametrize("name", sorted(list_algorithms()))
def test_the_engine_the_footprint_replay_and_the_plain_loop_call_the_hooks_in_one_order(name, data):
    train, test = data
    cfg = configure(name, fast=True, proj_dim=8, rounds=2, batch_size=16, drop_last=False, participation=1.0)
    calls = {}
    for path, run in {
        "engine": lambda algo: Engine(algo, [cfg], train, test).run(logs=False),  # test accuracy, as the plain loop
        "plain loop": lambda algo: plain_loop(algo, cfg, train, test),
        "footprint": lambda algo: footprint.estimate(algo, cfg, train, test),
    }.items():
        algo = spy(name)
        run(algo)
        calls[path] = type(algo).calls
    engine = folded(calls["engine"])
    assert engine[:2] == ["init", "init_state"] and engine[-2:] == ["context", "predict"], engine
    assert folded(calls["plain loop"]) == engine
    replayed = lambda calls: folded([c for c in calls if c in footprint.REPLAYED])  # (hooks call other hooks too)
    assert replayed(calls["footprint"]) == replayed(calls["engine"])
