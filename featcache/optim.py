"""Adam and SGD(momentum) over stacked parameters [H, C, ...], one independent optimizer per model.

Learning rate, weight decay and momentum are per-config tensors [H] (a grid trains many of them at once);
`active` [H, C] freezes models that have no batch in this step (clients with fewer steps, non-participants):
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
    def __init__(self, params: Params, lr, weight_decay, betas=(0.9, 0.999), eps: float = 1e-8, **_):
        self.lr, self.wd, self.betas, self.eps = lr, weight_decay, betas, eps
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}
        self.t = None  # [H, C] steps taken by each model

    def step(self, params: Params, grads: Params, active: torch.Tensor) -> Params:
        if self.t is None:
            self.t = torch.zeros(active.shape, dtype=torch.float32, device=active.device)
        self.t = self.t + active.float()
        b1, b2 = self.betas
        c1 = 1 - b1 ** self.t.clamp(min=1)  # [H, C]
        c2 = 1 - b2 ** self.t.clamp(min=1)
        out = {}
        for k, p in params.items():
            a = _b(active, p)
            g = grads[k] + _b(self.wd, p) * p
            m = b1 * self.m[k] + (1 - b1) * g
            v = b2 * self.v[k] + (1 - b2) * g * g
            new = p - _b(self.lr, p) * (m / _b(c1, p)) / ((v / _b(c2, p)).sqrt() + self.eps)
            self.m[k] = torch.where(a, m, self.m[k])
            self.v[k] = torch.where(a, v, self.v[k])
            out[k] = torch.where(a, new, p)
        return out


class SGD:
    def __init__(self, params: Params, lr, weight_decay, momentum=None, **_):
        self.lr, self.wd, self.mom = lr, weight_decay, momentum
        self.buf = {k: torch.zeros_like(v) for k, v in params.items()}
        self.started = None  # [H, C] whether the momentum buffer holds a gradient yet (torch: first step copies g)

    def step(self, params: Params, grads: Params, active: torch.Tensor) -> Params:
        if self.started is None:
            self.started = torch.zeros(active.shape, dtype=torch.bool, device=active.device)
        out = {}
        for k, p in params.items():
            a = _b(active, p)
            g = grads[k] + _b(self.wd, p) * p
            if self.mom is not None:
                buf = torch.where(_b(self.started, p), _b(self.mom, p) * self.buf[k] + g, g)
                self.buf[k] = torch.where(a, buf, self.buf[k])
                g = buf
            out[k] = torch.where(a, p - _b(self.lr, p) * g, p)
        self.started = self.started | active
        return out


OPTIMIZERS = {"adam": Adam, "sgd": SGD}
