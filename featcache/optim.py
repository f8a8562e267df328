"""Adam and SGD(momentum) over stacked parameters [H, C, ...], one independent optimizer per model.

Learning rate, weight decay and momentum are per-config tensors [H] (a grid trains many of them at once); `scale`
multiplies the learning rate per parameter name (FedPFT's own rate for its FTM); `frozen` names are left untouched
for a step (a phase that trains only some parameters). `active` [H, C] marks the models that have a batch in this
step: the others (clients with fewer steps, non-participants) keep parameters, moments and step counts exactly as
they were. Semantics are torch.optim.Adam / torch.optim.SGD (L2 weight decay added to the gradient).

Speed: the arithmetic is torch's own fused kernels (one read and write of each tensor per step). A linear layer's
weight gradient arrives from autograd as a transposed view ([d_in, d_out] in memory); instead of copying it every
step, a parameter and its moments adopt the memory layout of their gradient at the first step (the forward
`x @ W.T` is then a plain contiguous matmul as well). The kernels work on raw memory, so every tensor of one call
is handed over in the same layout. When all clients of a configuration step at the same step count (the usual
case) their C models go to the kernel as one slab [C, ...]. Parameters are updated in place (no copy per round);
`reuse` hands over a previous optimizer's moment buffers (zeroed), so a fresh optimizer each round does not allocate
and fault in new pages.
"""

from __future__ import annotations

import torch

Params = dict[str, torch.Tensor]


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.mT.is_contiguous()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous view of t's memory (t itself or its last-two-dims transpose); same layout in, same order out."""
    return t if t.is_contiguous() else t.mT


def _like(t: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """t's values in layout's memory layout (t itself when it already has it)."""
    return t if t.stride() == layout.stride() else torch.empty_strided(t.shape, layout.stride(),
                                                                        dtype=t.dtype, device=t.device).copy_(t)


class _Stacked:
    """Shared bookkeeping: which (h, c) models step now, their per-model hyperparameters, their state layout."""

    state_names: tuple[str, ...] = ()  # per-element state, shaped like the parameters
    history = ""  # per-model state [H, C] that must be equal across a slab (Adam's step counts, SGD's started flags)

    def __init__(self, params: Params, lr, weight_decay, scale=None, reuse=None):
        self.lr, self.wd, self.scale = lr.tolist(), weight_decay.tolist(), scale or {}
        # The engine's own parameter tensors are updated in place (an algorithm clones whatever it keeps from an
        # earlier round); views and broadcast tensors are copied first.
        self.params = {k: v.detach() if v._base is None and _dense(v) else v.detach().clone() for k, v in params.items()}
        for name in self.state_names:  # zeroed moments, taken from `reuse` when it has one of the right shape
            old = getattr(reuse, name, None) or {}
            setattr(self, name, {k: old[k].zero_() if k in old and old[k].shape == v.shape else torch.zeros_like(v)
                                 for k, v in self.params.items()})

    def _align(self, k: str, g: torch.Tensor) -> torch.Tensor:
        """Bring parameter k and its state into the gradient's layout (once); returns the gradient to use."""
        g = g if _dense(g) else g.contiguous()
        self.params[k] = _like(self.params[k], g)
        for name in self.state_names:
            getattr(self, name)[k] = _like(getattr(self, name)[k], g)
        return g

    def uniform(self, k: str, h: int) -> bool:
        """Whether every client model of configuration h has the same optimizer history for parameter k."""
        past = getattr(self, self.history)[k][h]  # [C]
        return bool((past == past[0]).all())

    def groups(self, grads: Params, active: torch.Tensor, frozen):
        """Yield (h, name, models, views, grad) per configuration and parameter: `grad` is the parameter's gradient
        in its layout, `views(t)` lists the contiguous views of t's [H, C, ...] entries this call updates (one slab
        [C, ...] when models is None)."""
        act = active.cpu().tolist()
        grads = {k: self._align(k, g) for k, g in grads.items() if k not in frozen}
        for h, row in enumerate(act):
            models = [c for c, a in enumerate(row) if a]
            if not models:
                continue
            for k, g in grads.items():
                if len(models) == len(row) and self.uniform(k, h):
                    yield h, k, None, lambda t: [_flat(t[h])], g
                else:
                    yield h, k, models, lambda t: [_flat(t[h, c]) for c in models], g


class Adam(_Stacked):
    state_names, history = ("m", "v"), "t"

    def __init__(self, params: Params, lr, weight_decay, betas=(0.9, 0.999), eps: float = 1e-8, scale=None,
                 reuse=None, **_):
        super().__init__(params, lr, weight_decay, scale, reuse)
        self.betas, self.eps = betas, eps
        self.t = {k: torch.zeros(v.shape[:2], device=v.device) for k, v in self.params.items()}  # [H, C] steps

    def step(self, params: Params, grads: Params, active: torch.Tensor, frozen=()) -> Params:
        for h, k, models, views, grad in self.groups(grads, active, frozen):
            self.t[k][h, slice(None) if models is None else models] += 1  # the caller counts, as torch.optim does
            steps = [self.t[k][h, 0]] if models is None else [self.t[k][h, c] for c in models]
            torch._fused_adam_(
                views(self.params[k]), views(grad), views(self.m[k]), views(self.v[k]), [], steps,
                amsgrad=False, lr=self.lr[h] * self.scale.get(k, 1.0), beta1=self.betas[0], beta2=self.betas[1],
                weight_decay=self.wd[h], eps=self.eps, maximize=False)
        return dict(self.params)


class SGD(_Stacked):
    state_names, history = ("buf",), "started"

    def __init__(self, params: Params, lr, weight_decay, momentum=None, scale=None, reuse=None, **_):
        super().__init__(params, lr, weight_decay, scale, reuse)
        self.mom = momentum.tolist() if momentum is not None else None
        self.started = {k: torch.zeros(v.shape[:2], dtype=torch.bool) for k, v in self.params.items()}

    def step(self, params: Params, grads: Params, active: torch.Tensor, frozen=()) -> Params:
        for h, k, models, views, grad in self.groups(grads, active, frozen):
            mom = self.mom[h] if self.mom else 0.0
            p, g, b = views(self.params[k]), views(grad), views(self.buf[k])
            started = [self.started[k][h, 0]] if models is None else [self.started[k][h, c] for c in models]
            for is_first in (True, False):  # the kernel's first step copies the gradient into the momentum buffer
                idx = [i for i, s in enumerate(started) if bool(s) != is_first]
                if idx:
                    torch._fused_sgd_(
                        [p[i] for i in idx], [g[i] for i in idx], [b[i] for i in idx] if mom else [],
                        weight_decay=self.wd[h], momentum=mom, lr=self.lr[h] * self.scale.get(k, 1.0),
                        dampening=0.0, nesterov=False, maximize=False, is_first_step=is_first)
            self.started[k][h, slice(None) if models is None else models] = True
        return dict(self.params)


OPTIMIZERS = {"adam": Adam, "sgd": SGD}
