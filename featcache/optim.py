"""Adam and SGD(momentum) over stacked parameters [H, C, ...], one independent optimizer per model.

Learning rate, weight decay and momentum are per-config tensors [H] (a grid trains many of them at once);
`scale` multiplies the learning rate per parameter name (FedPFT's own rate for its FTM); `frozen` names are left
untouched for a step (a phase that trains only some parameters). `active` [H, C] freezes models that have no batch in this step (clients with fewer steps, non-participants):
their parameters and moments stay exactly as they were, as if the step never happened for them. Semantics
match torch.optim.Adam / torch.optim.SGD (L2 weight decay added to the gradient).
"""

from __future__ import annotations

import torch

Params = dict[str, torch.Tensor]


def _b(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a [H] or [H, C] tensor against [H, C, ...]."""
    return t.reshape(*t.shape, *([1] * (like.dim() - t.dim())))


class Adam:
    def __init__(self, params: Params, lr, weight_decay, betas=(0.9, 0.999), eps: float = 1e-8, scale=None, **_):
        self.lr, self.wd, self.betas, self.eps, self.scale = lr, weight_decay, betas, eps, scale or {}
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}
        self.t = None  # [H, C] steps taken by each model

    def step(self, params: Params, grads: Params, active: torch.Tensor, frozen=()) -> Params:
        if self.t is None:
            self.t = {k: torch.zeros(active.shape, device=active.device) for k in params}  # [H, C] steps per tensor
        b1, b2 = self.betas
        out = dict(params)
        for k, p in params.items():
            if k in frozen:
                continue
            self.t[k] = self.t[k] + active.float()
            c1 = 1 - b1 ** self.t[k].clamp(min=1)  # [H, C]
            c2 = 1 - b2 ** self.t[k].clamp(min=1)
            a = _b(active.float(), p)  # 1 = step, 0 = leave untouched (every update below is scaled by it)
            g = grads[k].add(p * _b(self.wd, p))
            self.m[k] = self.m[k].lerp(g, (1 - b1) * a)
            self.v[k] = self.v[k] + a * (1 - b2) * (g * g - self.v[k])
            step = (self.m[k] / _b(c1, p)) / ((self.v[k] / _b(c2, p)).sqrt_().add_(self.eps))
            out[k] = p - (a * self.scale.get(k, 1.0) * _b(self.lr, p)) * step
        return out


class SGD:
    def __init__(self, params: Params, lr, weight_decay, momentum=None, scale=None, **_):
        self.lr, self.wd, self.mom, self.scale = lr, weight_decay, momentum, scale or {}
        self.buf = {k: torch.zeros_like(v) for k, v in params.items()}
        self.started = None  # per tensor [H, C]: the momentum buffer holds a gradient yet (torch: first step copies g)

    def step(self, params: Params, grads: Params, active: torch.Tensor, frozen=()) -> Params:
        if self.started is None:
            self.started = {k: torch.zeros(active.shape, dtype=torch.bool, device=active.device) for k in params}
        out = dict(params)
        for k, p in params.items():
            if k in frozen:
                continue
            a = _b(active, p)
            g = grads[k] + _b(self.wd, p) * p
            if self.mom is not None:
                buf = torch.where(_b(self.started[k], p), _b(self.mom, p) * self.buf[k] + g, g)
                self.buf[k] = torch.where(a, buf, self.buf[k])
                g = buf
            out[k] = torch.where(a, p - self.scale.get(k, 1.0) * _b(self.lr, p) * g, p)
            self.started[k] = self.started[k] | active
        return out


OPTIMIZERS = {"adam": Adam, "sgd": SGD}
