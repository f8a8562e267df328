"""The one round loop. Every algorithm runs here; algorithms only supply hooks (see algorithms/base.py).

Models carry two leading axes [H, C]: H configurations (hyperparameter settings x seeds) and C clients. One round:

    broadcast context -> local epochs (all H*C models in one vmapped step per minibatch) -> after_local
    -> upload -> aggregate over clients of each configuration -> download -> evaluate

Minibatch order comes from a counter-based hash of (seed, round, epoch, client, row), so it needs no Python loop
over clients, and a client sees the same batches whether it trains alone, in a plain loop, or inside a grid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.func import vmap

from .cache import ClientData
from .devices import resolve_device
from .errors import UserError
from .optim import OPTIMIZERS

Params = dict[str, torch.Tensor]

ENGINE_DEFAULTS = {
    "rounds": 50,
    "local_epochs": 1,
    "batch_size": 32,
    "drop_last": True,
    "optimizer": "adam",
    "lr": 1e-3,
    "weight_decay": 1e-4,
    "momentum": 0.9,
    "participation": 1.0,
    "eval_every": 1,
    "seed": 0,
}
ENGINE_STRUCTURAL = ("participation",)  # floats the engine reads once per run, not per model


def structural_keys(cfg: dict, algo) -> list[str]:
    """Settings that must be equal inside one batched run (shapes, options, per-run floats); every other float is a
    per-configuration tensor [H]."""
    return [k for k, v in cfg.items()
            if not isinstance(v, float) or k in algo.structural or k in ENGINE_STRUCTURAL]


@dataclass
class State:
    """Everything that evolves over rounds; tensors lead with [H, C] (models) except `server` ([H, ...])."""

    params: Params  # updated in place by the optimizer during local training: clone what you keep across rounds
    buffers: Params
    client: dict = field(default_factory=dict)  # per-model algorithm state, e.g. local prototypes [H, C, K, d]
    server: dict = field(default_factory=dict)  # per-config server state, e.g. global prototypes [H, K, d]
    hp: dict = field(default_factory=dict)  # per-config hyperparameters as tensors [H]


def map_models(fn, model_args: tuple, client_args: tuple = (), shared_args: tuple = ()):
    """Apply a per-client function to every model: model_args lead with [H, C], client_args with [C] (data shared
    by all configurations, never copied H times), shared_args are passed unchanged."""
    n_m, n_c, n_s = len(model_args), len(client_args), len(shared_args)
    inner = vmap(fn, in_dims=(0,) * (n_m + n_c) + (None,) * n_s)
    outer = vmap(inner, in_dims=(0,) * n_m + (None,) * (n_c + n_s))
    return outer(*model_args, *client_args, *shared_args)


def expand_hc(t: torch.Tensor, C: int) -> torch.Tensor:
    """[H, ...] -> [H, C, ...] (a view)."""
    return t[:, None].expand(t.shape[0], C, *t.shape[1:])


_MASK63 = (1 << 63) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping multiply, logical shifts)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def hash_keys(seeds: torch.Tensor, *ids: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Pseudo-random int64 keys [H, *shape] from (seed_h, ids..., position); same inputs, same keys, anywhere."""
    x = seeds.long().reshape(-1, *([1] * len(shape)))
    for i in ids:
        x = _mix(x * 1_000_003 + i)
    for d, n in enumerate(shape):  # each axis position enters separately: client c, row n
        coord = torch.arange(n).reshape(*([1] * (d + 1)), n, *([1] * (len(shape) - d - 1)))
        x = _mix(x * 1_000_003 + coord)
    return x & _MASK63


def batch_order(seeds: torch.Tensor, rnd: int, epoch: int, counts: torch.Tensor, n_max: int) -> torch.Tensor:
    """Per model, a random permutation of its client's valid rows, padding rows last: [H, C, Nmax] int64."""
    keys = hash_keys(seeds, rnd, epoch, shape=(len(counts), n_max))  # [H, C, Nmax]
    valid = torch.arange(n_max) < counts[:, None]  # [C, Nmax]
    keys = torch.where(valid, keys >> 1, torch.full_like(keys, _MASK63))
    return torch.argsort(keys, dim=-1, stable=True)


def participation(seeds: torch.Tensor, rnd: int, C: int, rate: float) -> torch.Tensor:
    """[H, C] bool: which clients take part in this round (at least one per configuration)."""
    if rate >= 1:
        return torch.ones(len(seeds), C, dtype=torch.bool)
    k = max(1, round(rate * C))
    keys = hash_keys(seeds, rnd, 1 << 20, shape=(C,))  # [H, C]
    ranks = torch.argsort(torch.argsort(keys, dim=-1), dim=-1)
    return ranks < k


class Engine:
    """Trains H configurations x C clients of one algorithm on cached features."""

    def __init__(self, algo, cfgs: list[dict], train: ClientData, test: ClientData,
                 device: str | torch.device = "cpu"):
        self.algo, self.cfgs, self.device = algo, cfgs, resolve_device(device)
        structural = structural_keys(cfgs[0], algo)
        for c in cfgs[1:]:
            diff = [k for k in structural if c[k] != cfgs[0][k] and k != "seed"]
            if diff:
                raise UserError(f"configurations of one batched run must share {diff}: run them as separate buckets")
        self.cfg = algo.cfg = cfgs[0]
        self.train, self.test = train.to(self.device), test.to(self.device)
        self.H, self.C = len(cfgs), train.features.shape[0]
        self.seeds = torch.tensor([c["seed"] for c in cfgs])
        floats = [k for k in self.cfg if k not in structural]
        self.hp = {k: torch.tensor([c[k] for c in cfgs], dtype=torch.float32, device=self.device) for k in floats}
        self._opt = None  # the last round's optimizer, whose moment buffers the next round reuses

    # -- setup --------------------------------------------------------------------------------------------------
    def init_state(self) -> State:
        d_in, K = self.train.features.shape[-1], self.train.num_classes
        per_h = [self.algo.init(self.cfg, d_in, K, torch.Generator().manual_seed(int(s))) for s in self.seeds]
        stack = lambda dicts: {k: expand_hc(torch.stack([d[k] for d in dicts]), self.C).clone().to(self.device)
                               for k in dicts[0]}
        state = State(params=stack([p for p, _ in per_h]), buffers=stack([b for _, b in per_h]), hp=self.hp)
        self.algo.init_state(state, self)
        return state

    # -- one round ----------------------------------------------------------------------------------------------
    def local_train(self, state: State, rnd: int, active_clients: torch.Tensor) -> None:
        cfg, algo, data = self.cfg, self.algo, self.train
        B = cfg["batch_size"]
        n_eff = data.counts // B * B if cfg["drop_last"] else data.counts  # [C]
        if bool((n_eff == 0).any()):
            small = int((n_eff == 0).sum())
            raise UserError(f"{small} client(s) have fewer than batch_size={B} training rows and would never train "
                            "with drop_last: use --set drop_last=false or a smaller --set batch_size")
        steps = int(((n_eff + B - 1) // B).max())
        opt = OPTIMIZERS[cfg["optimizer"]](state.params, lr=self.hp["lr"], weight_decay=self.hp["weight_decay"],
                                            momentum=self.hp.get("momentum"),
                                            scale={k: algo.lr_scale(k) for k in state.params},
                                            reuse=self._opt)
        self._opt = opt
        loss_fn = vmap(vmap(algo.local_loss))  # [H, C] losses; summed, each model gets exactly its own gradient
        c_idx = torch.arange(self.C, device=self.device)[None, :, None]  # [1, C, 1]
        for epoch in range(algo.local_epochs()):
            frozen = {k for k in state.params if not algo.trainable(k, epoch)}
            order = batch_order(self.seeds, rnd, epoch, data.counts.cpu(), data.features.shape[1]).to(self.device)
            for s in range(steps):
                idx = order[..., s * B : (s + 1) * B]  # [H, C, B]
                valid = (s * B + torch.arange(idx.shape[-1], device=self.device)) < n_eff[:, None]  # [C, B]
                valid = valid.expand_as(idx)  # [H, C, B]
                active = valid.any(-1) & active_clients  # [H, C]
                x = data.features[c_idx, idx]  # [H, C, B, D]
                y = data.labels[c_idx, idx]  # [H, C, B]
                extra = {"views": data.views[c_idx, idx]} if data.views is not None else {}  # [H, C, B, V, D]
                ctx = algo.context(state, self) | extra
                params = {k: v.detach().requires_grad_(True) for k, v in state.params.items()}
                loss, new_buffers = loss_fn(params, state.buffers, x, y, valid, ctx)
                grads = dict(zip(params, torch.autograd.grad(loss.sum(), list(params.values()), allow_unused=True)))
                grads = {k: torch.zeros_like(params[k]) if g is None else g for k, g in grads.items()}
                if not torch.isfinite(loss[active]).all():
                    raise UserError(f"{algo.name}: loss became NaN/Inf in round {rnd + 1}: lower --set lr=... "
                                    "or check the cache with `featcache info`")
                with torch.no_grad():
                    state.params = opt.step(state.params, grads, active, frozen)
                for k, v in new_buffers.items():
                    state.buffers[k] = torch.where(active.reshape(*active.shape, *[1] * (v.dim() - 2)), v,
                                                   state.buffers[k])

    def evaluate(self, state: State, data: ClientData) -> torch.Tensor:
        """Per-model accuracy on each client's own data: [H, C]."""
        ctx = self.algo.context(state, self)
        predict = lambda p, b, c, x: self.algo.predict(p, b, x, c)
        scores = map_models(predict, (state.params, state.buffers, ctx), (data.features,))  # [H, C, N, K]
        hit = (scores.argmax(-1) == data.labels) & data.mask  # [H, C, N]
        return hit.sum(-1) / data.counts.clamp(min=1)

    def run(self, progress=None) -> dict:
        """Train all rounds; returns per-round accuracies [R_eval, H, C], upload sizes and timings."""
        self.round = -1
        state = self.init_state()
        accs, rounds, upload_floats, times = [], [], [], []
        R = self.cfg["rounds"]
        for rnd in range(R):
            self.round = rnd
            t0 = time.perf_counter()
            part = participation(self.seeds, rnd, self.C, self.cfg["participation"]).to(self.device)  # [H, C]
            self.local_train(state, rnd, part)
            self.algo.after_local(state, self)
            uploads = self.algo.upload(state, self)  # name -> [H, C, ...]
            weights = self.train.counts[None].float() * part  # [H, C]
            server = self.algo.aggregate(uploads, weights, state, self)
            self.algo.download(state, server, part, self)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            upload_floats.append(sum(v[0, 0].numel() for v in uploads.values()))
            if (rnd + 1) % self.cfg["eval_every"] == 0 or rnd == R - 1:
                accs.append(self.evaluate(state, self.test).cpu())
                rounds.append(rnd + 1)
            if progress:
                progress(rnd + 1, R)
        self.state = state
        return {"acc": torch.stack(accs), "eval_rounds": rounds, "upload_floats": upload_floats, "round_seconds": times}
