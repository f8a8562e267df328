"""Server optimizers: FedAvgM (Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", arXiv:1909.06335, 2019) and FedAdagrad, FedYogi, FedAdam (Reddi et al., "Adaptive
Federated Optimization", ICLR 2021, Algorithm 2).

Clients train as in FedAvg; the server takes Δ_t = mean_k x_k − x_t over the round's participants S (their mean minus
the model x_t the round started from) as a pseudo-gradient and steps its own optimizer on it:

    FedAvgM:    m_t = β m_{t−1} + Δ_t                              x_{t+1} = x_t + η m_t
    FedAdagrad: m_t = β1 m_{t−1} + (1 − β1) Δ_t,   v_t = v_{t−1} + Δ_t²
    FedYogi:    m_t as FedAdagrad's,   v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)
    FedAdam:    m_t as FedAdagrad's,   v_t = β2 v_{t−1} + (1 − β2) Δ_t²
                the three adaptive ones: x_{t+1} = x_t + η m_t / (√v_t + τ)

Algorithm 2 as written (`server_rule=reddi`, the default): the uniform mean 1/|S| Σ_{k∈S} x_k, m_{−1} = 0 and
v_{−1} = τ² (its bound v_{−1} ≥ τ²). `server_rule=flower` follows flwr's strategies of the same names (flwr 1.42
server/strategy/fedadam.py, fedyogi.py, fedadagrad.py): FedAvg's mean Σ n_k x_k / Σ n_k (n_k a client's rows),
v_{−1} = 0, and FedAdam's rate bias-corrected, η √(1 − β2^(t+2)) / (1 − β1^(t+2)) in round t = 0, 1, ... (flwr's
server_round + 1); flwr's FedAdagrad fixes β1 = 0 (give server_beta1=0). FedAvgM takes FedAvg's mean (Hsu et al.)
and is flwr's FedAvgM (server_momentum, server_learning_rate): with β = 0 and η = 1 there is no server step and
x_{t+1} is FedAvg's mean itself, as in flwr.
Defaults: β = 0.9 (Hsu et al.); β1 = 0.9, β2 = 0.99, τ = 1e-3 (Reddi et al. §5); η = 1 for FedAvgM, 1e-2 for
FedYogi and FedAdam and 0.1 for FedAdagrad, whose v only grows (flwr's defaults): an adaptive step moves each
coordinate by about η per round, so tune η, as Reddi et al. tune it per task.

BN running statistics (bn=True) are statistics, not parameters: the server takes their mean. x_t, m and
v live in the server's state ([H, ...] per configuration), so a checkpoint carries them. Every setting is a float of
its own per configuration (a grid batches server_lr, β, τ on the configuration axis).

Any algorithm whose server is FedAvg's (upload, aggregate and download FedAvg's own: fedprox, moon, ...) takes a
server optimizer by name, `--algo fedprox+fedadam` (`with_server(FedProx, FedAdam)`).
Global model: the server's x_{t+1}, which every client downloads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from dataclasses import dataclass

import torch

from ..errors import UserError
from ..training.config import Setting
from .base import FedAvg, bcast, remember_global
from .registry import COMPOSERS, register

SERVER_HOOKS = ("upload", "aggregate", "download")  # FedAvg's own in an algorithm that takes a server optimizer


class ServerOptimizer(FedAvg):
    """FedAvg's clients with a server that steps an optimizer on Δ_t (module docstring); a subclass writes `step`."""

    fedavg_server = False  # the server hands clients x_{t+1}, not the mean
    memory: tuple[str, ...] = ("momentum",)  # the server's per-parameter state besides x_t, each name -> [H, ...]

    def init_state(self, state, rnd):
        super().init_state(state, rnd)
        if not self.uses_global:  # FedAvg's init_state keeps x_0 already where local_loss reads it
            remember_global(state)  # x_0: state.server["global"]
        x = state.server["global"]
        for name in self.memory:  # the shared parameters' (FedBN's BatchNorm layers stay on the clients)
            state.server[name] = {k: torch.zeros_like(v) for k, v in x.items() if self.shared(k)}  # [H, ...]

    def step(self, x: dict, mean: dict, server: dict, rnd) -> tuple[dict, dict]:
        """(x_{t+1}, memory) from x_t, FedAvg's mean (Δ_t = mean − x_t) and the server's state, each
        name -> [H, ...]."""
        raise NotImplementedError

    def client_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """The weights of the server's mean (FedAvg's n_k, 0 for absent clients: [H, C] or [H, P])."""
        return weights

    def aggregate(self, uploads, weights, state, rnd):
        mean = super().aggregate(uploads, self.client_weights(weights), state, rnd)  # name -> [H, ...]
        x = {k: v for k, v in state.server["global"].items() if self.shared(k)}  # x_t [H, ...], shared parameters
        new, memory = self.step(x, {k: mean[k] for k in x}, state.server, rnd)
        return {"model": mean | new} | memory  # BN statistics: the mean

    def download(self, state, server, rnd):
        super().download(state, server["model"], rnd)
        for name in self.memory:
            state.server[name] = server[name]
        if not self.uses_global:  # FedAvg's download keeps x_{t+1} already
            remember_global(state)


@register
class FedAvgM(ServerOptimizer):
    name = "fedavgm"
    paper = "Hsu, Qi and Brown, Measuring the Effects of Non-Identical Data Distribution, arXiv:1909.06335 (FedAvgM)"
    uploads = "all head parameters"
    settings = {
        "server_lr": Setting(1.0, "η, the server's learning rate on the mean client delta", lo=0, lo_open=True),
        "server_momentum": Setting(
            0.9, "β, the server's momentum (0 with server_lr=1: FedAvg)", lo=0, hi=1, hi_open=True
        ),
    }

    def step(self, x, mean, server, rnd):
        beta, lr = rnd.hp["server_momentum"], rnd.hp["server_lr"]  # [H]
        plain = (beta == 0) & (lr == 1)  # [H] no server step: x_{t+1} is the mean itself, as flwr skips it
        m, new = {}, {}
        for k, x_k in x.items():  # [H, ...]
            m[k] = bcast(beta, x_k) * server["momentum"][k] + (mean[k] - x_k)
            new[k] = torch.where(bcast(plain, x_k), mean[k], x_k + bcast(lr, x_k) * m[k])
        return new, {"momentum": m}


def adagrad(v: torch.Tensor, d2: torch.Tensor, beta2: torch.Tensor) -> torch.Tensor:
    return v + d2


def yogi(v: torch.Tensor, d2: torch.Tensor, beta2: torch.Tensor) -> torch.Tensor:
    return v - (1 - beta2) * d2 * torch.sign(v - d2)


def adam(v: torch.Tensor, d2: torch.Tensor, beta2: torch.Tensor) -> torch.Tensor:
    return beta2 * v + (1 - beta2) * d2


@dataclass(frozen=True)
class Rule:
    """Where Algorithm 2 and flwr's strategies differ (module docstring)."""

    uniform: bool  # Δ_t from the participants' uniform mean (else FedAvg's n_k-weighted one)
    v_from_tau2: bool  # v_{−1} = τ² (else 0)
    bias_corrected: bool  # FedAdam's rate η √(1 − β2^(t+2)) / (1 − β1^(t+2)) (else η)


RULES = {"reddi": Rule(True, True, False), "flower": Rule(False, False, True)}


class Adaptive(ServerOptimizer):
    """Algorithm 2's server (FedAdagrad, FedYogi, FedAdam differ only in `second_moment`)."""

    memory = ("momentum", "v")
    settings = {
        "server_lr": Setting(1e-2, "η, the server's learning rate", lo=0, lo_open=True),
        "server_beta1": Setting(0.9, "β1, decay of the server's first moment", lo=0, hi=1, hi_open=True),
        "server_tau": Setting(1e-3, "τ, the adaptivity (added to √v); v starts at τ²", lo=0, lo_open=True),
        "server_rule": Setting(
            "reddi",
            "reddi: Algorithm 2 (uniform mean over the participants, v starts at τ²); flower: flwr's strategy "
            "(FedAvg's n_k-weighted mean, v starts at 0, FedAdam's η bias-corrected)",
            choices=tuple(RULES),
        ),
    }
    second_moment: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = staticmethod(adagrad)

    @property
    def rule(self) -> Rule:
        return RULES[self.cfg["server_rule"]]

    def client_weights(self, weights):
        return (weights > 0).to(weights.dtype) if self.rule.uniform else weights  # [H, C] or [H, P]

    def init_state(self, state, rnd):
        super().init_state(state, rnd)
        if self.rule.v_from_tau2:
            tau2 = rnd.hp["server_tau"] ** 2  # [H]
            state.server["v"] = {k: v + bcast(tau2, v) for k, v in state.server["v"].items()}  # [H, ...]

    def rate(self, rnd) -> torch.Tensor:
        """The server's rate η_t [H] in round rnd.round."""
        return rnd.hp["server_lr"]

    def step(self, x, mean, server, rnd):
        b1, lr, tau = rnd.hp["server_beta1"], self.rate(rnd), rnd.hp["server_tau"]  # [H]
        b2 = rnd.hp["server_beta2"] if "server_beta2" in rnd.hp else b1  # [H] (FedAdagrad has none)
        m, v, new = {}, {}, {}
        for k, x_k in x.items():  # [H, ...]
            d = mean[k] - x_k  # Δ_t
            m[k] = bcast(b1, d) * server["momentum"][k] + bcast(1 - b1, d) * d
            v[k] = self.second_moment(server["v"][k], d * d, bcast(b2, d))
            new[k] = x_k + bcast(lr, d) * m[k] / (v[k].sqrt() + bcast(tau, d))
        return new, {"momentum": m, "v": v}


BETA2 = Setting(0.99, "β2, decay of the server's second moment", lo=0, hi=1, hi_open=True)
REDDI = "Reddi et al., Adaptive Federated Optimization, ICLR 2021, Algorithm 2"


@register
class FedAdagrad(Adaptive):
    name = "fedadagrad"
    paper = f"{REDDI} (FedAdagrad)"
    uploads = "all head parameters"
    settings = {"server_lr": 0.1}  # v only grows: a larger rate than FedYogi's and FedAdam's (as in flwr)
    second_moment = staticmethod(adagrad)


@register
class FedYogi(Adaptive):
    name = "fedyogi"
    paper = f"{REDDI} (FedYogi)"
    uploads = "all head parameters"
    settings = {"server_beta2": BETA2}
    second_moment = staticmethod(yogi)


@register
class FedAdam(Adaptive):
    name = "fedadam"
    paper = f"{REDDI} (FedAdam)"
    uploads = "all head parameters"
    settings = {"server_beta2": BETA2}
    second_moment = staticmethod(adam)

    def rate(self, rnd):
        if not self.rule.bias_corrected:
            return rnd.hp["server_lr"]
        t = rnd.round + 2  # flwr's server_round + 1, server_round = 1, 2, ...
        b1, b2 = rnd.hp["server_beta1"], rnd.hp["server_beta2"]  # [H]
        return rnd.hp["server_lr"] * (1 - b2**t).sqrt() / (1 - b1**t)  # [H]


def with_server(algo: type[FedAvg], server: type[ServerOptimizer]) -> type[FedAvg]:
    """`algo`'s clients with `server`'s optimizer, as the class named "{algo.name}+{server.name}" (the registry makes
    it on first use of that name). Refuses an algorithm whose upload, aggregate or download is not FedAvg's."""
    changed = [h for h in SERVER_HOOKS if getattr(algo, h) is not getattr(FedAvg, h)]
    if changed:
        raise UserError(
            f"{algo.name} overrides {', '.join(changed)}: a server optimizer steps on FedAvg's mean, so it needs "
            "FedAvg's upload, aggregate and download"
        )
    body = {"name": f"{algo.name}+{server.name}", "paper": f"{algo.paper}; server: {server.paper}"}
    return type(f"{algo.__name__}With{server.__name__}", (server, algo), body | {"__module__": algo.__module__})


for _server in (FedAvgM, FedAdagrad, FedYogi, FedAdam):
    COMPOSERS[_server.name] = functools.partial(with_server, server=_server)
