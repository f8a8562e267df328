"""Adam and SGD(momentum) over stacked parameters [H, C, ...], one independent optimizer per model.

Learning rate, weight decay and momentum are per-config tensors [H] (a grid trains many of them at once); `scale`
multiplies the learning rate per parameter name (FedPFT's own rate for its FTM); `frozen` names are left untouched
for a step (a phase that trains only some parameters). `active` [H, C] marks the models that have a batch in this
step: the others (clients with fewer steps, non-participants) keep parameters, moments and step counts exactly as
they were. Semantics are torch.optim.Adam / torch.optim.SGD (L2 weight decay added to the gradient).

Speed: the arithmetic is torch's own fused kernels through torch.optim's public functional API (`adam`, `sgd` with
fused=True: one read and write of each tensor per step). A linear layer's
weight gradient arrives from autograd as a transposed view ([d_in, d_out] in memory); instead of copying it every
step, a parameter and its moments adopt the memory layout of their gradient at the first step (the forward
`x @ W.T` is then a plain contiguous matmul as well). The kernels work on raw memory, so every tensor of one call
is handed over in the same layout. When all clients of a configuration step at the same step count (the usual
case) their C models go to the kernel as one slab [C, ...]. Parameters are updated in place (no copy per round);
`reuse` hands over a previous optimizer's moment buffers (zeroed), so a fresh optimizer each round does not allocate
and fault in new pages.

No host synchronisation: `active` and the hyperparameters are host values (nested lists [H][C] / lists [H], a CPU
tensor is accepted too), and the per-model step history that decides how models are grouped is mirrored on the host
(`count`), so a step never reads a device tensor back.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

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


def _host(v) -> list | None:
    """A host list from a list or a tensor (a tensor on a device is read once, at construction)."""
    return v.tolist() if torch.is_tensor(v) else (None if v is None else list(v))


class _Stacked:
    """Shared bookkeeping: which (h, c) models step now, their per-model hyperparameters, their state layout."""

    state_names: tuple[str, ...] = ()  # per-element state, shaped like the parameters

    def __init__(self, params: Params, lr, weight_decay, scale=None, reuse=None):
        self.lr, self.wd, self.scale = _host(lr), _host(weight_decay), scale or {}  # [H] host floats
        # The engine's own parameter tensors are updated in place (an algorithm clones whatever it keeps from an
        # earlier round); views and broadcast tensors are copied first.
        self.params = {k: v.detach() if v._base is None and _dense(v) else v.detach().clone() for k, v in params.items()}
        for name in self.state_names:  # zeroed moments, taken from `reuse` when it has one of the right shape
            old = getattr(reuse, name, None) or {}
            setattr(self, name, {k: old[k].zero_() if k in old and old[k].shape == v.shape else torch.zeros_like(v)
                                 for k, v in self.params.items()})
        H, C = next(iter(self.params.values())).shape[:2]
        self.count = {k: [[0] * C for _ in range(H)] for k in self.params}  # host [H][C]: steps taken per model

    def _align(self, k: str, g: torch.Tensor) -> torch.Tensor:
        """Bring parameter k and its state into the gradient's layout (once); returns the gradient to use."""
        g = g if _dense(g) else g.contiguous()
        self.params[k] = _like(self.params[k], g)
        for name in self.state_names:
            getattr(self, name)[k] = _like(getattr(self, name)[k], g)
        return g

    def uniform(self, k: str, h: int) -> bool:
        """Whether every client model of configuration h has taken the same number of steps of parameter k."""
        past = self.count[k][h]  # [C] host ints
        return all(n == past[0] for n in past)

    def groups(self, grads: Params, active, frozen):
        """Yield (h, name, models, views, grad) per configuration and parameter: `grad` is the parameter's gradient
        in its layout, `views(t)` lists the contiguous views of t's [H, C, ...] entries this call updates (one slab
        [C, ...] when models is None)."""
        act = _host(active)  # [H][C] host bools
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
                for c in models:
                    self.count[k][h][c] += 1


class Adam(_Stacked):
    state_names = ("m", "v")

    def __init__(self, params: Params, lr, weight_decay, betas=(0.9, 0.999), eps: float = 1e-8, scale=None,
                 reuse=None, **_):
        super().__init__(params, lr, weight_decay, scale, reuse)
        self.betas, self.eps = betas, eps
        self.t = {k: torch.zeros(v.shape[:2], device=v.device) for k, v in self.params.items()}  # [H, C] the kernel's

    def step(self, params: Params, grads: Params, active, frozen=()) -> Params:
        for h, k, models, views, grad in self.groups(grads, active, frozen):
            steps = [self.t[k][h, 0]] if models is None else [self.t[k][h, c] for c in models]  # 0-d views
            adam(views(self.params[k]), views(grad), views(self.m[k]), views(self.v[k]), [], steps, fused=True,
                 amsgrad=False, lr=self.lr[h] * self.scale.get(k, 1.0), beta1=self.betas[0], beta2=self.betas[1],
                 weight_decay=self.wd[h], eps=self.eps, maximize=False)  # counts the steps it is given
            if models is None:  # one slab stepped on model 0's count: the others keep the same count
                self.t[k][h, 1:] = self.t[k][h, 0]
        return dict(self.params)


class SGD(_Stacked):
    state_names = ("buf",)

    def __init__(self, params: Params, lr, weight_decay, momentum=None, scale=None, reuse=None, **_):
        super().__init__(params, lr, weight_decay, scale, reuse)
        self.mom = _host(momentum)  # [H] host floats or None

    def step(self, params: Params, grads: Params, active, frozen=()) -> Params:
        for h, k, models, views, grad in self.groups(grads, active, frozen):
            mom = self.mom[h] if self.mom else 0.0
            p, g, b = views(self.params[k]), views(grad), views(self.buf[k])
            counts = self.count[k][h]  # host step counts before this step (groups() counts after the yield)
            started = [counts[0] > 0] if models is None else [counts[c] > 0 for c in models]
            for is_first in (True, False):  # the kernel's first step copies the gradient into the momentum buffer
                idx = [i for i, s in enumerate(started) if s != is_first]
                if idx:
                    bufs = [None if is_first else b[i] for i in idx] if mom else []  # None: the first step's
                    sgd([p[i] for i in idx], [g[i] for i in idx], bufs, fused=True, weight_decay=self.wd[h],
                        momentum=mom, lr=self.lr[h] * self.scale.get(k, 1.0), dampening=0.0, nesterov=False,
                        maximize=False)
                    for i, new in zip(idx, bufs if mom and is_first else ()):  # sgd made fresh first-step buffers
                        b[i].copy_(new)
        return dict(self.params)


OPTIMIZERS = {"adam": Adam, "sgd": SGD}
