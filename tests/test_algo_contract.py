"""The algorithm contract: every capability is declared, and the registry refuses a declaration the hooks contradict."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import configure

from featcache.algorithms import create, list_algorithms, load
from featcache.algorithms.base import CAPABILITIES, RESTS_ON, FedAvg, contradictions
from featcache.algorithms.registry import register
from featcache.errors import UserError
from featcache.training.config import Setting
from featcache.training.optim import Group

ALGOS = sorted(list_algorithms())


def overridden(cls: type, flag: str) -> list[str]:
    return [h for h in RESTS_ON[flag] if getattr(cls, h) is not getattr(FedAvg, h)]


@pytest.mark.parametrize("name", ALGOS)
def test_every_algorithm_keeps_its_declarations(name):
    cls = list_algorithms()[name]
    assert contradictions(cls) == []
    algo = create(name, configure(name))  # bound: a capability may follow a setting (FedProto's personal_predict)
    assert all(isinstance(getattr(algo, flag), bool) for flag in CAPABILITIES)


@pytest.mark.parametrize("name", ALGOS)
def test_a_builtin_declares_fedavgs_server_wherever_its_server_is_fedavgs(name):
    """No built-in gives up the cost-follows-participants path its hooks allow (FedProx and MOON read w^t from the
    context, `uses_global`, and leave download alone)."""
    cls = list_algorithms()[name]
    assert cls.fedavg_server == (not overridden(cls, "fedavg_server")), overridden(cls, "fedavg_server")


@pytest.mark.parametrize("name", ALGOS)
def test_clients_hold_the_global_model_only_where_every_tensor_is_shared(name):
    """clients_hold_global: the default global model exists (every parameter and buffer shared) and its hooks are
    FedAvg's; a built-in declares it wherever both hold."""
    algo = create(name)
    cfg = configure(name)
    params, buffers = algo.bind(cfg).init(cfg, 16, 3, torch.Generator().manual_seed(0))
    every = all(algo.shared(k) for k in (*params, *buffers))
    assert algo.clients_hold_global == (every and not overridden(type(algo), "clients_hold_global"))


def test_uses_global_hands_w_t_over_in_the_context():
    """FedProx keeps w^t with FedAvg's own hooks (init_state, download) and finds it in its context, while the engine
    keeps FedAvg's server path for it (the participants' shared tensors set aside, never written back)."""
    from featcache.testing import synthetic_clients
    from featcache.training.engine import Engine

    train, test = synthetic_clients(seed=0), synthetic_clients(seed=1)
    eng = Engine(create("fedprox"), [configure("fedprox", rounds=2, participation=0.5)], train, test)
    C = train.features.shape[0]
    rnd = SimpleNamespace(hp={}, expand=lambda t: t[:, None].expand(t.shape[0], C, *t.shape[1:]))  # what context reads
    for run in (False, True):
        if run:
            eng.run()
            assert eng.clients.aside
        ctx = eng.algo.context(eng.state, rnd)
        assert ctx["global_buffers"] == {} and set(ctx["global"]) == set(eng.state.params)
        for k, v in eng.state.params.items():  # every client holds w^t (the initial model, then the download)
            assert torch.equal(ctx["global"][k], v) and torch.equal(eng.state.server["global"][k], v[:, 0])


def declared(**attrs) -> type:
    body = {"name": "contract-test", "paper": "a test"} | attrs
    return type("Declared", (FedAvg,), body)


def download(self, state, server, rnd):
    FedAvg.download(self, state, server, rnd)


@pytest.mark.parametrize(
    "attrs, needle",
    [
        ({"download": download}, "declares fedavg_server = True but overrides download: declare fedavg_server = False"),
        ({"predict_global": FedAvg.predict}, "declares clients_hold_global = True but overrides predict_global"),
        ({"capturable": "yes"}, "capturable = 'yes': declare True or False"),
        ({"groups": {"": Group(), "x": Group(lr="lr_x")}}, "groups['x'].lr = 'lr_x' names no setting"),
        (
            {"settings": {"s": Setting(0.5, "a rate")}, "groups": {"": Group(), "x": Group(lr_scale="s")}},
            "groups['x'].lr_scale = 's' is a batched setting: declare it with batched=False",
        ),
    ],
)
def test_a_declaration_its_hooks_contradict_is_refused(attrs, needle):
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        register(declared(**attrs))
    assert "contract-test" not in list_algorithms()


def test_a_consistent_declaration_is_registered(monkeypatch):
    import featcache.algorithms.registry as registry

    monkeypatch.setattr(registry, "_ALGOS", dict(registry._ALGOS))
    cls = declared(
        download=download,
        fedavg_server=False,
        settings={"s": Setting(0.5, "a rate", batched=False)},
        groups={"": Group(), "x": Group(lr_scale="s")},
    )
    assert register(cls) is cls and create("contract-test").fedavg_server is False


def test_a_plugin_whose_hooks_contradict_its_declarations_is_one_line(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "from featcache.algorithms.base import FedAvg\n\n\n"
        "class Mine(FedAvg):\n"
        "    name = 'mine-contract'\n\n"
        "    def aggregate(self, uploads, weights, state, rnd):\n"
        "        return super().aggregate(uploads, weights, state, rnd)\n"
    )
    with pytest.raises(UserError, match=f"--algo {path}:Mine: Mine: declares fedavg_server = True but overrides agg"):
        load(f"{path}:Mine")
    assert "mine-contract" not in list_algorithms()
