"""The shared test harness: `configure` builds every configuration through `config.resolve` (so each value is
checked against its declaration), the synthetic federated data, the host-read counter and the image folders the
extraction tests read."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch
from harness import one_thread, write_folders
from hypothesis import HealthCheck, settings
from torch.utils._python_dispatch import TorchDispatchMode

from featcache.algorithms import create
from featcache.algorithms.ccvr import CCVR
from featcache.algorithms.fedbabu import FedBABU
from featcache.algorithms.fedetf import FedETF
from featcache.algorithms.fednova import FedNova
from featcache.algorithms.fedpft import Alternating
from featcache.algorithms.fedrep import FedRep
from featcache.algorithms.fedtgp import FedTGP
from featcache.algorithms.pfedgate import PFedGate
from featcache.algorithms.scaffold import Scaffold
from featcache.training.config import resolve
from tests.synthetic import synthetic_clients

# The digest memo (featcache.cache.identity.memo_path) of a test session, its subprocesses included, lives in a
# folder of its own: the suite never writes the user's ~/.cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="featcache-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

# Property tests: no example database in the repo, no per-example deadline (a CPU under load swings several-fold),
# examples drawn from a fixed seed so a CI failure reproduces (HYPOTHESIS_PROFILE=explore draws fresh ones).
settings.register_profile(
    "ci",
    database=None,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("explore", parent=settings.get_profile("ci"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Settings that keep the generic engine tests (every algorithm, few rounds) fast while every phase still runs, by
# class (its subclasses included).
FAST = {
    # Both phases in two epochs. The generic 20-round test runs at lr 1e-2 (an Adam rate); SGD with momentum 0.9
    # there takes steps like the paper's plain SGD at lr 0.1.
    Alternating: {"momentum": 0.9, "r_f": 1, "r_a": 1, "local_epochs": 2},
    FedRep: {"head_epochs": 2},  # both phases and the switch, at a fifth of the cost
    FedBABU: {"finetune_epochs": 1},  # the fine-tuning still runs before every evaluation, at a fifth of the cost
    FedETF: {"finetune_epochs": 1, "finetune_rounds": 1, "finetune_phase_epochs": 1},  # every step of the
    # adaptation before every evaluation, at 3 epochs instead of 123
    CCVR: {"samples_per_class": 40},  # the calibration before every evaluation, on a fifth of the virtual rows
    Scaffold: {"lr": 0.1},  # plain SGD at 0.01 moves too little in 3 rounds to show learning
    FedNova: {"lr": 0.1},  # the same: plain SGD at 0.01 by default
    FedTGP: {"server_epochs": 10},  # the server's passes, a tenth of run_me.sh's 100: still learns in 20 rounds
    # An 8-unit head keeps too little at s = 0.5 (and the logits' ReLU too little signal at lr 1e-3) to learn in a few
    # rounds; test_algo_pfedgate covers the released settings and s < 1.
    PFedGate: {"optimizer": "adam", "lr": 0.01, "lr_gate": 0.1, "sparsity": 1.0, "local_epochs": 3},
}


def fast_settings(algo) -> dict:
    """FAST's settings for `algo` (a name, class or instance): those of the nearest class in its MRO, or none."""
    cls = type(create(algo)) if isinstance(algo, str) else algo if isinstance(algo, type) else type(algo)
    return next((dict(FAST[k]) for k in cls.__mro__ if k in FAST), {})


def configure(algo, *, fast: bool = False, **overrides) -> dict:
    """The resolved configuration of `algo` (a name, class or instance) with `overrides` (and FAST's settings first
    when `fast`); `seed` is set after resolving (a run's seed is not a --set setting)."""
    impl = create(algo) if isinstance(algo, str) else algo
    seed = overrides.pop("seed", 0)
    given = (fast_settings(impl) if fast else {}) | overrides
    return resolve(impl, given) | {"seed": seed}


def client_model(eng, c: int, h: int = 0) -> tuple[dict, dict, dict]:
    """Model (h, c) of an engine after its last round: its params, buffers and the context its `predict` reads."""
    ctx = eng.algo.context(eng.state, eng.last_round)
    return (
        {k: v[h, c] for k, v in eng.state.params.items()},
        {k: v[h, c] for k, v in eng.state.buffers.items()},
        torch.utils._pytree.tree_map(lambda t: t[h, c], ctx),
    )


@pytest.fixture(scope="module")
def data():
    """Train and test splits of the separable synthetic clients, with two cached views."""
    return synthetic_clients(seed=0, views=2), synthetic_clients(seed=1, views=2)


class HostReads(TorchDispatchMode):
    """Records every aten op that moves a tensor's value to the host (on a CPU tensor: `.item()`, `bool()`,
    `int()`, `float()`; `.tolist()`, `.cpu()` and `.numpy()` dispatch nothing there: see `host_reads`)."""

    READS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch):
    """A function returning a context manager that counts every host read while active, into a list it yields:
    the dispatched reads of `HostReads` and calls of `.tolist()`, `.cpu()`, `.numpy()`."""
    import contextlib

    @contextlib.contextmanager
    def counting():
        found: list[str] = []
        with monkeypatch.context() as m:
            for method in ("tolist", "cpu", "numpy"):
                original = getattr(torch.Tensor, method)

                def counted(self, *a, _name=method, _orig=original, **k):
                    found.append(_name)
                    return _orig(self, *a, **k)

                m.setattr(torch.Tensor, method, counted)
            with HostReads() as mode:
                yield found
        found[:0] = mode.reads

    return counting


@pytest.fixture
def single_thread():
    """Torch on one thread for the test (extraction tests compare bytes across runs)."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """d1, d2 x classes a, b, c x 8 images (each domain split 70/30 into train and test by the reader)."""
    return write_folders(tmp_path_factory.mktemp("images"))


@pytest.fixture(autouse=True)
def _registry_as_it_was():
    """A test that registers algorithms (a plug-in's, loaded in the process) leaves the registry as it found it: the
    tests of a worker share one process, and a registry test must not see another test's plug-ins."""
    from featcache.algorithms import registry

    saved = dict(registry._ALGOS)
    yield
    registry._ALGOS.clear()
    registry._ALGOS.update(saved)
