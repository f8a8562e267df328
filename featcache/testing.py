"""Check an algorithm, built-in or your own, against a plain per-client training loop.

The vectorized engine trains every client of every configuration in one vmapped step; `plain_loop` runs the same
round loop over the plain client backend (`featcache.training.plain.Plain`), which trains and scores each client
alone, one Python iteration per client and minibatch (torch.optim on ordinary leaf tensors and autograd, no vmap, no
stacking, no masks beyond the real batch rows; one optimizer per client for the whole run where the algorithm keeps
optimizer state). The two share the loop (first state, participation, the hooks' order, the server side) and the
batch order (a pure function of seed, round, epoch, client), not the arithmetic of local training and scoring. An
algorithm whose hooks treat each client as its own model gets the same accuracies and parameters from both;
`assert_matches_plain_loop` says so, or names the first parameter that differs:

    from featcache.testing import assert_matches_plain_loop
    assert_matches_plain_loop("path/to/my_algo.py:MyAlgo")     # or a registered name, a class, an instance

Both sides of that check run the algorithm's own hooks, so it cannot see an algorithm whose hooks compute the wrong
mathematics consistently (a server momentum never kept passes it). Two checks test the mathematics:

    assert_reduces_to("fedavgm", "fedavg", server_momentum=0.0)   # settings under which the equations are FedAvg's
    assert_matches_equations("my_avgm.py:MyAvgM", server=fedavgm_server, server_momentum=0.9)

`assert_reduces_to` trains the algorithm at settings where its equations reduce to another algorithm's and asserts
the other algorithm's results; `assert_matches_equations` runs `plain_loop` with the server step (and optionally
the local loss) replaced by plain functions written from the user's own equations (`plain_loop`'s `server`, `loss`).
docs/guides/training.md says what each check catches and what it cannot.

`assert_capturable` checks the protocol of captured steps (CUDA graphs, featcache/training/capture.py) on the CPU:
the engine run in "replay" mode must give the eager run's results bit for bit.

`synthetic_clients` is the small separable federated feature set (Gaussian class centres, clients of different
sizes, a little feature shift per client) it trains on by default; featcache's own tests use both. `OpCount` counts
the ops a step dispatches, `write_format2` writes a cache in the format-2 layout and `write_client_groups` the
clients of any layout with a group per client: the tests and bench/ share them.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .algorithms import create, register
from .algorithms.base import remember_global, weighted_mean
from .cache import ClientData, h5
from .training import optim
from .training.config import resolve
from .training.engine import Engine
from .training.plain import Plain


def synthetic_clients(
    C: int = 4,
    n: tuple[int, int] = (30, 60),
    D: int = 16,
    K: int = 5,
    seed: int = 0,
    spread: float = 1.0,
    views: int = 0,
) -> ClientData:
    centres = torch.randn(K, D, generator=torch.Generator().manual_seed(1234)) * 2  # same classes for every split
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(n[0], n[1] + 1, (C,), generator=g)  # [C] clients of different sizes
    N = int(counts.max())
    x, y = torch.zeros(C, N, D), torch.full((C, N), -1)
    v = torch.zeros(C, N, views, D) if views else None
    shift = torch.randn(C, D, generator=g) * 0.3  # a little feature shift per client
    for c in range(C):
        labels = torch.randint(0, K, (int(counts[c]),), generator=g)
        base = centres[labels] + shift[c]
        x[c, : len(labels)] = base + spread * torch.randn(len(labels), D, generator=g)
        y[c, : len(labels)] = labels
        if v is not None:
            v[c, : len(labels)] = base[:, None] + spread * torch.randn(len(labels), views, D, generator=g)
    return ClientData(x, y, counts, K, v)


def plain_loop(
    algo, cfg: dict, train, test, device="cpu", server=None, loss=None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One configuration trained client by client: the engine's round loop over the plain client backend
    (`featcache.training.plain.Plain`). Returns the test accuracy of every evaluation round [R_eval, C] (every round
    at eval_every=1) and the trained parameters name -> [C, ...] (after the last round's download).

    `server` replaces the algorithm's server side (after_local, upload, aggregate, download) with the user's
    equations: server(x, clients, n, memory, cfg) -> the next global model, from x (name -> tensor, the model the
    round started from), clients (one name -> tensor per participant, as trained), n (their training rows), memory
    (a dict the loop keeps from round to round, empty at first) and cfg (the configuration's settings); every client
    then holds it (buffers: the n-weighted mean). `loss` replaces the local loss: loss(params, x, y, start) -> a
    scalar, from the client's parameters, a minibatch and the model it started the round from."""
    return _trained(algo, cfg, train, test, device, Plain(loss), server)[1:]


def _user_server(algo, server, state, counts, cfg: dict):
    """`algo` with its server side the user's `server` (`plain_loop`) on configuration 0's participants: every
    client takes the model it returns."""
    proxy, memory = copy.copy(algo), dict[str, object]()
    x = {k: v[0, 0].clone() for k, v in state.params.items()}  # the model every client starts the round from

    def aggregate(uploads, weights, state, now):
        ids = [c for c in range(now.C) if bool(now.part[0, c])]
        clients = [{k: v[0, c].clone() for k, v in state.params.items()} for c in ids]
        new = server({k: v.clone() for k, v in x.items()}, clients, [int(counts[c]) for c in ids], memory, dict(cfg))
        return new, {k: weighted_mean(v, weights) for k, v in state.buffers.items()}  # [1, ...]

    def download(state, models, now):
        new, stats = models
        state.params.update({k: now.expand(v.detach()[None].to(state.params[k].dtype)) for k, v in new.items()})
        state.buffers.update({k: now.expand(v) for k, v in stats.items()})
        if algo.uses_global:
            remember_global(state, buffers=True)
        x.update({k: v[0, 0].clone() for k, v in state.params.items()})

    proxy.after_local, proxy.upload = lambda state, now: None, lambda state, now: {}
    proxy.aggregate, proxy.download = aggregate, download
    return proxy


def _setup(algo, rounds: int, train, test, settings: dict):
    """(algorithm instance, train, test, configuration) of an assert_* check: `algo` a registered name, a plug-in
    spec, a FedAvg subclass or an instance; default data `synthetic_clients` with two cached views; uneven clients,
    75 % participation and a short last batch."""
    if isinstance(algo, type):
        algo = create(register(algo).name)
    elif isinstance(algo, str):
        algo = create(algo)
    if train is None or test is None:
        train, test = synthetic_clients(seed=0, views=2), synthetic_clients(seed=1, views=2)
    cfg = resolve(
        algo, {"rounds": rounds, "batch_size": 16, "drop_last": False, "participation": 0.75, "proj_dim": 8} | settings
    ) | {"seed": 0}
    return algo, train, test, cfg


def assert_matches_plain_loop(
    algo, rounds: int = 3, train: ClientData | None = None, test: ClientData | None = None, **settings
) -> dict[str, float]:
    """Train `algo` (a registered name, a plug-in spec `file.py:Class` / `module:Class`, a FedAvg subclass or an
    instance) with the engine and with `plain_loop` on the same data (default: `synthetic_clients` with two cached
    views, uneven clients, 75 % participation, a short last batch) and assert that both give the same test accuracy
    every round (to 1e-6) and the same trained parameters (float32 tolerance). `settings` override the algorithm's
    defaults. Returns the largest parameter difference per name."""
    algo, train, test, cfg = _setup(algo, rounds, train, test, settings)
    name, acc, params = _trained(algo, cfg, train, test)
    ref_acc, ref_params = plain_loop(algo, cfg, train, test)
    return _assert_same(name, "the plain loop", acc, params, ref_acc, ref_params, False)


def _trained(
    algo, cfg: dict, train, test, device="cpu", clients=None, server=None
) -> tuple[str, torch.Tensor, dict[str, torch.Tensor]]:
    """(name, test accuracy [R_eval, C], parameters name -> [C, ...]) of one engine run over `clients` (default:
    vectorized), its server side `server`'s where given (`plain_loop`)."""
    eng = Engine(algo, [cfg], train, test, device, clients=clients)
    if server is not None:
        eng.algo = _user_server(eng.algo, server, eng.state, eng.train.counts, cfg)
    acc = eng.run(logs=False)["acc"][:, 0]  # [R_eval, C]
    return eng.algo.name, acc, {k: v[0].clone() for k, v in eng.state.params.items()}


def _assert_same(name: str, ref: str, acc, params, ref_acc, ref_params, exact: bool) -> dict[str, float]:
    """Equal per-round accuracy (to 1e-6, or bit for bit) and parameters (float32 tolerance, or bit for bit)."""
    tol: dict = {"rtol": 0, "atol": 0} if exact else {}
    torch.testing.assert_close(
        acc,
        ref_acc,
        rtol=0,
        atol=0 if exact else 1e-6,
        msg=lambda m: f"{name}: per-round test accuracy differs from {ref}: {m}",
    )
    assert set(params) == set(ref_params), f"{name}: parameter names differ from {ref}'s"
    for k, v in params.items():
        torch.testing.assert_close(
            v, ref_params[k], **tol, msg=lambda m: f"{name}: parameter {k} differs from {ref}: {m}"
        )
    return {k: float((v - ref_params[k]).abs().max()) for k, v in params.items()}


def assert_reduces_to(
    algo,
    reference,
    rounds: int = 3,
    train: ClientData | None = None,
    test: ClientData | None = None,
    exact: bool = False,
    **settings,
) -> dict[str, float]:
    """Train `algo` (as in `assert_matches_plain_loop`) at `settings`, the values under which its equations reduce to
    `reference`'s (a registered name, plug-in spec, class or instance), and `reference` with the same engine and
    model settings (every setting both declare) on the same data and seed; assert the same per-round test accuracy
    (to 1e-6) and trained parameters (float32 tolerance; bit for bit with `exact`). Returns the largest parameter
    difference per name. `assert_reduces_to("fedavgm", "fedavg", server_momentum=0.0)`: FedAvgM without momentum at
    server_lr=1 is FedAvg."""
    algo, train, test, cfg = _setup(algo, rounds, train, test, settings)
    ref_algo = create(register(reference).name) if isinstance(reference, type) else reference
    ref_algo = create(ref_algo) if isinstance(ref_algo, str) else ref_algo
    shared = {k: v for k, v in cfg.items() if k != "seed" and k in resolve(ref_algo)}
    ref_cfg = resolve(ref_algo, shared) | {"seed": cfg["seed"]}
    name, acc, params = _trained(algo, cfg, train, test)
    ref, ref_acc, ref_params = _trained(ref_algo, ref_cfg, train, test)
    return _assert_same(f"{name} at {settings}", ref, acc, params, ref_acc, ref_params, exact)


def assert_matches_equations(
    algo,
    server=None,
    loss=None,
    rounds: int = 3,
    train: ClientData | None = None,
    test: ClientData | None = None,
    **settings,
) -> dict[str, float]:
    """Train `algo` (as in `assert_matches_plain_loop`) with the engine and with `plain_loop` whose server step is
    `server` and/or whose local loss is `loss`, plain functions written from the algorithm's equations (their
    signatures: `plain_loop`); assert the same per-round test accuracy (to 1e-6) and trained parameters (float32
    tolerance). Returns the largest parameter difference per name. What `server` does not replace (or `loss`) is the
    algorithm's own hook, checked against itself only."""
    if server is None and loss is None:
        raise ValueError("assert_matches_equations needs server=..., loss=... or both: the equations to check")
    algo, train, test, cfg = _setup(algo, rounds, train, test, settings)
    name, acc, params = _trained(algo, cfg, train, test)
    ref_acc, ref_params = plain_loop(algo, cfg, train, test, server=server, loss=loss)
    return _assert_same(name, "the loop written from its equations", acc, params, ref_acc, ref_params, False)


@contextmanager
def masked_optimizers():
    """Inside: the CPU trains on the masked whole-stack optimizers (a captured step's), not the fused ones."""
    saved = dict(optim.BY_DEVICE)
    optim.BY_DEVICE["cpu"] = optim.MASKED
    try:
        yield
    finally:
        optim.BY_DEVICE.clear()
        optim.BY_DEVICE.update(saved)


def assert_capturable(
    algo, rounds: int = 3, train: ClientData | None = None, test: ClientData | None = None, **settings
) -> bool:
    """Train `algo` (as in `assert_matches_plain_loop`) as two configurations (other rate, other seed) with captured
    steps in "replay" mode and with eager steps, both on the masked optimizers, and assert equal accuracies, losses,
    parameters and buffers, bit for bit. Fails when a hook's step depends on something the capture froze. Returns
    False, comparing nothing, for an algorithm that opts out (`capturable = False`: its steps always run eagerly)."""
    algo, train, test, cfg = _setup(algo, rounds, train, test, settings)
    if not algo.capturable:
        return False
    cfgs = [cfg, cfg | {"seed": 1, "lr": cfg["lr"] * 2}]
    runs = {}
    with masked_optimizers():
        for mode in ("replay", "off"):
            engine = Engine(algo, cfgs, train, test, capture=mode)
            out = engine.run()
            runs[mode] = (
                {"accuracy": out["acc"], "training loss": out["train_loss"]}
                | {f"parameter {k}": v for k, v in engine.state.params.items()}
                | {f"buffer {k}": v for k, v in engine.state.buffers.items()}
            )
    for k, v in runs["off"].items():
        torch.testing.assert_close(
            runs["replay"][k],
            v,
            rtol=0,
            atol=0,
            equal_nan=True,
            msg=lambda m: f"{algo.name}: {k} of the captured steps differs from eager: {m}",
        )
    return True


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while active (about one kernel launch each on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def write_client_groups(f, header: dict, clients, write_blocks) -> int:
    """The clients of a cache in a layout with a group per client (formats 2 and 3), into the open h5py file `f`:
    `clients/000`... with each split's labels, source indices and domains and the validation rows, as both formats
    lay them out; `write_blocks(g, name, blocks)` writes a split's feature (or view) blocks under `name`
    ("train/features"...) of the client's group `g`, as its format does. Returns the images written."""
    images = 0
    for c, client in enumerate(clients):
        g = f.create_group(f"clients/{c:03d}")
        g.attrs["domain"] = client.domain
        for split in ("train", "test"):
            s = getattr(client, split)
            g[f"{split}/labels"] = np.asarray(s.labels, np.int64)
            g[f"{split}/source_index"] = np.asarray(s.source_index, np.int64)
            g[f"{split}/domain"] = np.full(len(s.labels), header["domains"].index(client.domain), np.int16)
            for group, blocks in (("features", s.features), ("views", s.views)):
                if blocks is not None:
                    write_blocks(g, f"{split}/{group}", blocks)
            images += len(s.labels)
        g["train/val_index"] = np.asarray(client.val_index, np.int64)
    return images


def write_format2(path, header: dict, backbones: list[dict], clients) -> str:
    """A cache in the format-2 layout (each backbone's features as a dataset of its own and again inside `concat`,
    checksums computed by re-reading the file), from the arguments `featcache.cache.write` takes; for the migration
    tests and bench/extract.py's figure 5."""

    def write_blocks(g, name: str, blocks) -> None:
        for b, block in zip(backbones, blocks):
            g.create_dataset(f"{name}/{b['key']}", data=np.asarray(block, np.float32), track_times=False)
        shape = (*blocks[0].shape[:-1], sum(x.shape[-1] for x in blocks))
        cat = g.create_dataset(f"{name}/concat", shape, "f4", track_times=False)
        for r in range(0, shape[0], 4096):  # concat assembled in slices of 4096 rows, as format 2's writer did
            rows = [np.asarray(x[r : r + 4096], np.float32) for x in blocks]  # each [k, ..., D_b]
            cat[r : r + 4096] = np.concatenate(rows, -1)

    with h5.create_h5(path) as f:
        h5.write_attrs(
            f,
            header | {"featcache_format": 2, "featcache_version": "0.1.0", "backbones": [b["key"] for b in backbones]},
        )
        for b in backbones:
            h5.write_attrs(f.create_group(f"backbones/{b['key']}"), {k: v for k, v in b.items() if k != "key"})
        f.attrs["images"] = write_client_groups(f, header, clients, write_blocks)
        h5.seal(f)
        f.attrs["meta_sha256"] = h5.meta_sha256(f, bind_data=False)  # format 2's metadata checksum
    return str(path)
