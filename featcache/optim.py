"""Adam and SGD(momentum) over stacked parameters [H, C, ...], one independent optimizer per model.

Learning rate, weight decay and momentum are per-config tensors [H] (a grid trains many of them at once); `scale`
multiplies the learning rate per parameter name (FedPFT's own rate for its FTM); `frozen` names are left untouched
for a step (a phase that trains only some parameters). `active` [H, C] marks the models that have a batch in this
step: the others (clients with fewer steps, non-participants) keep parameters, moments and step counts exactly as
they were. Semantics are torch.optim.Adam / torch.optim.SGD (L2 weight decay added to the gradient); the arithmetic
is torch's own fused kernels, called on per-model views, one call per (configuration, parameter): a step reads and
writes each parameter once instead of once per elementwise operation, which is what bounds a grid's speed.
"""

from __future__ import annotations

import torch

Params = dict[str, torch.Tensor]


class _Stacked:
    """Shared bookkeeping: which (h, c) models step now, and their per-model hyperparameters."""

    def __init__(self, params: Params, lr, weight_decay, scale=None):
        self.lr, self.wd, self.scale = lr.tolist(), weight_decay.tolist(), scale or {}
        self.params = {k: v.detach().clone() for k, v in params.items()}  # updated in place by the kernels

    def groups(self, grads: Params, active: torch.Tensor, frozen):
        """Yield (h, name, [param views], [grad views], [(h, c)]) for the active models of each configuration."""
        act = active.cpu().tolist()
        for h, row in enumerate(act):
            models = [c for c, a in enumerate(row) if a]
            if not models:
                continue
            for k, p in self.params.items():
                if k in frozen:
                    continue
                yield h, k, [p[h, c] for c in models], [grads[k][h, c].contiguous() for c in models], models


class Adam(_Stacked):
    def __init__(self, params: Params, lr, weight_decay, betas=(0.9, 0.999), eps: float = 1e-8, scale=None, **_):
        super().__init__(params, lr, weight_decay, scale)
        self.betas, self.eps = betas, eps
        self.m = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.t = {k: torch.zeros(v.shape[:2], device=v.device) for k, v in self.params.items()}  # [H, C] steps

    def step(self, params: Params, grads: Params, active: torch.Tensor, frozen=()) -> Params:
        for h, k, ps, gs, models in self.groups(grads, active, frozen):
            self.t[k][h, models] += 1  # the kernel expects the caller to count the step, as torch.optim.Adam does
            torch._fused_adam_(
                ps, gs, [self.m[k][h, c] for c in models], [self.v[k][h, c] for c in models], [],
                [self.t[k][h, c] for c in models], amsgrad=False, lr=self.lr[h] * self.scale.get(k, 1.0),
                beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.wd[h], eps=self.eps, maximize=False)
        return dict(self.params)


class SGD(_Stacked):
    def __init__(self, params: Params, lr, weight_decay, momentum=None, scale=None, **_):
        super().__init__(params, lr, weight_decay, scale)
        self.mom = momentum.tolist() if momentum is not None else None
        self.buf = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.started = {k: torch.zeros(v.shape[:2], dtype=torch.bool) for k, v in self.params.items()}

    def step(self, params: Params, grads: Params, active: torch.Tensor, frozen=()) -> Params:
        for h, k, ps, gs, models in self.groups(grads, active, frozen):
            mom = self.mom[h] if self.mom else 0.0
            first = [c for c in models if not self.started[k][h, c]]
            for subset, is_first in ((first, True), ([c for c in models if c not in first], False)):
                if not subset:
                    continue
                idx = [models.index(c) for c in subset]
                torch._fused_sgd_(
                    [ps[i] for i in idx], [gs[i] for i in idx],
                    [self.buf[k][h, c] for c in subset] if mom else [],
                    weight_decay=self.wd[h], momentum=mom, lr=self.lr[h] * self.scale.get(k, 1.0), dampening=0.0,
                    nesterov=False, maximize=False, is_first_step=is_first)
            for c in models:
                self.started[k][h, c] = True
        return dict(self.params)


OPTIMIZERS = {"adam": Adam, "sgd": SGD}
