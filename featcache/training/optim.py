"""Adam and SGD(momentum) over stacked parameters [H, C, ...], one independent optimizer per model.

Semantics are torch.optim.Adam (Kingma & Ba, ICLR 2015, Algorithm 1) and torch.optim.SGD, L2 weight decay added to
the gradient. Learning rate, weight decay and momentum are per configuration ([H], the run's `HParams`); `groups`
maps a parameter name to its `Group` (declared by name prefix: pFedGate's gating layer has its own rate), `scale`
multiplies a parameter's rate (FedPFT's FTM), `frozen` names skip the step, and only the models `active` [H, C]
marks step: the others keep parameters, moments and step counts as they were. One optimizer serves a whole run;
`load` starts each round.

Two families compute the same update. `Adam` and `SGD` call torch's fused kernels once per configuration and
parameter (one memory pass per tensor: the CPU's choice); `MaskedAdam` and `MaskedSGD` are whole-stack arithmetic
with a fixed number of kernels per parameter whatever H and C, no host data and no read-back (what a launch-bound
GPU and a CUDA graph need). `optimizer_for` picks. The fused family takes the hyperparameters and the stepping
models as host values (`HParams.host`, `step`'s `host`), so neither reads a device tensor back during a step.
`clip_grad_norms` is torch.nn.utils.clip_grad_norm_ per model and per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Group:
    """One parameter group of the local optimizer: the settings holding its learning rate and weight decay, the
    shared (batched=False) setting its learning rate is multiplied by (None: 1), and the norm its gradient is clipped
    to per model (None: not clipped). An algorithm declares its groups by name prefix, `groups = {"": Group(),
    "gate": Group(lr="lr_gate"), "ftm.": Group(lr_scale="ftm_lr_scale")}`; a parameter belongs to its longest
    matching prefix."""

    lr: str = "lr"
    weight_decay: str = "weight_decay"
    max_norm: float | None = None
    lr_scale: str | None = None


def prefix_of(groups: dict[str, Group], name: str) -> str | None:
    """The prefix in `groups` that parameter `name` belongs to: the longest one it starts with (None: none)."""
    return max((p for p in groups if name.startswith(p)), key=len, default=None)


def group_of(groups: dict[str, Group], name: str) -> Group:
    """The Group of parameter `name` under the declaration `groups` (prefix -> Group)."""
    prefix = prefix_of(groups, name)
    return Group() if prefix is None else groups[prefix]


def clip_sets(groups: dict[str, Group], names) -> list[tuple[float, list[str]]]:
    """(max_norm, member names) of every clipped group of the declaration `groups` (prefix -> Group)."""
    members = {p: [k for k in names if prefix_of(groups, k) == p] for p, g in groups.items() if g.max_norm}
    return [(norm, ks) for p, ks in members.items() if ks and (norm := groups[p].max_norm)]


def clip_grad_norms(grads: Params, sets: list[tuple[float, list[str]]], frozen=()) -> Params:
    """torch.nn.utils.clip_grad_norm_ per model and per group of `sets` (`clip_sets`; grads name -> [H, C, ...]; a
    frozen name takes no part): each model's gradients of a group are scaled by min(1, max_norm / (‖g‖ + 1e-6)),
    ‖g‖ the 2-norm of their per-tensor 2-norms. Whole-stack arithmetic: no host read, capturable."""
    out = dict(grads)
    for max_norm, members in sets:
        names = [k for k in members if k not in frozen]
        if not names:
            continue
        norms = torch.stack([torch.linalg.vector_norm(grads[k].flatten(2), dim=-1) for k in names])  # [P, H, C]
        coef = (max_norm / (torch.linalg.vector_norm(norms, dim=0) + 1e-6)).clamp(max=1.0)  # [H, C]
        for k in names:
            out[k] = grads[k] * coef.view(*coef.shape, *[1] * (grads[k].dim() - 2))  # [H, C, ...]
    return out


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.mT.is_contiguous()


def flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous view of t's memory (t itself or its last-two-dims transpose); same layout in, same order out."""
    return t if t.is_contiguous() else t.mT


def _strides(shape: tuple, transposed: bool) -> tuple:
    """The strides of a dense tensor of `shape`, row-major, or with its last two dims swapped in memory."""
    dims = (*shape[:-2], shape[-1], shape[-2]) if transposed else tuple(shape)
    out, size = [], 1
    for d in reversed(dims):
        out.append(size)
        size *= d
    out.reverse()
    return (*out[:-2], out[-1], out[-2]) if transposed else tuple(out)


def _relayout(t: torch.Tensor, layout: torch.Tensor, chunk: int = 2**26) -> torch.Tensor:
    """t's values in layout's dense memory layout (row-major or last-two-dims transposed), written into t's own
    memory (t [H, C, ...] and layout [H, n, ...], n <= C, each model's entry dense, t owning its memory alone):
    models are moved through a temporary of about `chunk` bytes rather than a second tensor of t's size."""
    stride = _strides(t.shape, t.dim() > 2 and not layout.is_contiguous())
    if t.stride() == stride:
        return t
    out = t.as_strided(t.shape, stride, t.storage_offset())
    src, dst = t.flatten(0, 1), out.flatten(0, 1)  # [H*C, ...] views: each model's entry is the same memory in both
    step = max(1, chunk // (src[0].numel() * src.element_size()))
    for i in range(0, src.shape[0], step):
        dst[i : i + step].copy_(src[i : i + step].clone())
    return out


def _host(v) -> list:
    """A host list from a list or a tensor (a tensor is read back)."""
    return v.tolist() if torch.is_tensor(v) else list(v)


def _adopt(opt, params: Params) -> None:
    """Set opt.params (the engine's tensors, updated in place) and its zeroed per-element state opt.<state_name>."""
    # The engine's own parameter tensors are updated in place (an algorithm clones whatever it keeps from an earlier
    # round); views and broadcast tensors are copied first.
    opt.params = {k: v.detach() if v._base is None and _dense(v) else v.detach().clone() for k, v in params.items()}
    for name in opt.state_names:
        setattr(opt, name, {k: torch.zeros_like(v) for k, v in opt.params.items()})


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def copy_into(dst: Params, src: Params) -> Params:
    """Copy src's values into dst's tensors in place (same names; views and broadcasts welcome); returns a new dict
    of dst's tensors."""
    for k, v in src.items():
        p = dst[k]
        if (v.data_ptr(), v.stride(), v.shape) != (p.data_ptr(), p.stride(), p.shape):  # not p itself
            p.copy_(v.clone() if _same_memory(v, p) else v)  # a view of p itself is read before p is written
    return dict(dst)


class _Run:
    """One optimizer for a whole run: `load` starts a round; `state_dict` / `load_state_dict` carry it over."""

    params: Params  # name -> [H, C, ...] the parameters, updated in place
    state_names: tuple[str, ...] = ()  # per-element state, shaped like the parameters
    carried: tuple[str, ...] = ()  # what goes from one step to the next: `state_dict`'s names

    def _restart(self) -> None:
        """Step counts back to zero (a new round of an optimizer that keeps no state)."""
        raise NotImplementedError

    def load(self, params: Params, keep: bool = False) -> Params:
        """Start a round from `params` (name -> [H, C, ...], views and broadcasts welcome): copied into this
        optimizer's own tensors in place (their layout kept), moments and step counts zeroed, as a freshly built
        optimizer would hold them, or with `keep` left as the last round left them (an optimizer kept alive: pFedGate).
        Returns the parameters to train (this optimizer's tensors, which a captured CUDA graph keeps reading)."""
        copy_into(self.params, params)
        if keep:
            return dict(self.params)
        for name in self.state_names:
            for t in getattr(self, name).values():
                t.zero_()
        self._restart()
        return dict(self.params)

    def state_dict(self) -> dict:
        """What this optimizer carries from one step to the next (`carried`), as the live tensors (not copies): its
        parameters, per-element state (`state_names`) and step counts (device `t`, host `count`: each family keeps
        its own). Their memory layout is part of it: a fused step gives parameter and moments the gradient's layout
        once (`_align`), and a kernel rounds differently on another layout."""
        return {name: getattr(self, name) for name in self.carried}

    def load_state_dict(self, saved: dict) -> None:
        """Go on from `state_dict`'s values: their tensors are adopted as they are, layout included (before any step
        is captured: a captured step keeps reading the tensors of the moment of capture)."""
        for name in self.carried:
            setattr(self, name, dict(saved[name]))


class _Stacked(_Run):
    """Shared bookkeeping: which (h, c) models step now, their per-model hyperparameters, their state layout."""

    count: dict[str, list[list[int]]]  # name -> host [H][C] steps taken per model

    def __init__(self, params: Params, hp, scale=None, groups=None):
        groups, self.scale = groups or {}, scale or {}
        of = {k: groups.get(k, Group()) for k in params}
        self.lr = {k: hp.host[g.lr] for k, g in of.items()}  # name -> [H] host floats
        self.wd = {k: hp.host[g.weight_decay] for k, g in of.items()}  # name -> [H] host floats
        _adopt(self, params)
        self._restart()

    def _restart(self) -> None:
        H, C = next(iter(self.params.values())).shape[:2]
        # host [H][C]: steps taken per model, mirrored on the host so grouping models never reads the device
        self.count = {k: [[0] * C for _ in range(H)] for k in self.params}

    def _align(self, k: str, g: torch.Tensor) -> torch.Tensor:
        """Bring parameter k and its state into the gradient's layout (once); returns the gradient to use."""
        # a linear weight's gradient arrives transposed ([d_in, d_out] in memory); the fused kernels take raw memory,
        # so parameter and moments adopt that layout once rather than the gradient being copied every step
        # (rearranged within their own memory, not copied anew: the old layout's tensors are not read again)
        g = g if _dense(g) else g.contiguous()
        p = self.params[k]
        self.params[k] = _relayout(p, g)
        if self.params[k] is not p:
            fresh = not any(map(any, self.count[k]))  # no step taken yet: the state is zeros, no values to move
            for held in (getattr(self, name) for name in self.state_names):
                t = held[k]  # zeros read in any layout are zeros: its memory taken as it is
                held[k] = (
                    t.as_strided(t.shape, self.params[k].stride(), t.storage_offset()) if fresh else _relayout(t, g)
                )
        return g

    def uniform(self, k: str, h: int, n: int) -> bool:
        """Whether the first n client models of configuration h have taken the same number of steps of parameter k."""
        past = self.count[k][h][:n]  # [n] host ints
        return all(c == past[0] for c in past)

    def groups(self, grads: Params, active, frozen, host):
        """Yield (h, name, models, views, grad) per configuration and parameter: `grad` is the parameter's gradient
        in its layout, `views(t)` lists the contiguous views of t's [H, C, ...] entries this call updates (one slab
        [n, ...] when models is None). The gradients and `active` [H, n] cover the first n models."""
        act = _host(active if host is None else host)  # [H][n] host bools
        n = len(act[0])
        grads = {k: self._align(k, g) for k, g in grads.items() if k not in frozen}
        for h, row in enumerate(act):
            models = [c for c, a in enumerate(row) if a]
            if not models:
                continue
            for k, g in grads.items():
                if len(models) == n and self.uniform(k, h, n):  # the usual case: n models, one kernel call
                    yield h, k, None, lambda t: [flat(t[h, :n])], g
                else:
                    yield h, k, models, lambda t: [flat(t[h, c]) for c in models], g
                for c in models:
                    self.count[k][h][c] += 1


class Adam(_Stacked):
    state_names = ("m", "v")
    carried = ("params", "m", "v", "t", "count")
    m: Params
    v: Params
    t: Params  # name -> [H, C] the kernel's step counts

    def __init__(self, params: Params, hp, scale=None, groups=None, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, hp, scale, groups)
        self.betas, self.eps = betas, eps

    def _restart(self) -> None:
        super()._restart()
        self.t = {k: torch.zeros(v.shape[:2], device=v.device) for k, v in self.params.items()}  # [H, C] the kernel's

    def step(self, grads: Params, active, frozen=(), host=None) -> Params:
        for h, k, models, views, grad in self.groups(grads, active, frozen, host):
            steps = [self.t[k][h, 0]] if models is None else [self.t[k][h, c] for c in models]  # 0-d views
            adam(
                views(self.params[k]),
                views(grad),
                views(self.m[k]),
                views(self.v[k]),
                [],
                steps,
                fused=True,
                amsgrad=False,
                lr=self.lr[k][h] * self.scale.get(k, 1.0),
                beta1=self.betas[0],
                beta2=self.betas[1],
                weight_decay=self.wd[k][h],
                eps=self.eps,
                maximize=False,
            )  # counts the steps it is given
            if models is None:  # one slab stepped on model 0's count: the others keep the same count
                self.t[k][h, 1 : grad.shape[1]] = self.t[k][h, 0]
        return dict(self.params)


class SGD(_Stacked):
    state_names = ("buf",)
    carried = ("params", "buf", "count")
    buf: Params

    def __init__(self, params: Params, hp, scale=None, groups=None):
        super().__init__(params, hp, scale, groups)
        self.mom = hp.host.get("momentum")  # [H] host floats or None

    def step(self, grads: Params, active, frozen=(), host=None) -> Params:
        for h, k, models, views, grad in self.groups(grads, active, frozen, host):
            mom = self.mom[h] if self.mom else 0.0
            p, g, b = views(self.params[k]), views(grad), views(self.buf[k])
            counts = self.count[k][h]  # host step counts before this step (groups() counts after the yield)
            started = [counts[0] > 0] if models is None else [counts[c] > 0 for c in models]
            for is_first in (True, False):  # the kernel's first step copies the gradient into the momentum buffer
                idx = [i for i, s in enumerate(started) if s != is_first]
                if idx:
                    bufs = [None if is_first else b[i] for i in idx] if mom else []  # None: the first step's
                    sgd(
                        [p[i] for i in idx],
                        [g[i] for i in idx],
                        bufs,
                        fused=True,
                        weight_decay=self.wd[k][h],
                        momentum=mom,
                        lr=self.lr[k][h] * self.scale.get(k, 1.0),
                        dampening=0.0,
                        nesterov=False,
                        maximize=False,
                    )
                    for i, new in zip(idx, bufs if mom and is_first else ()):  # sgd made fresh first-step buffers
                        b[i].copy_(new)
        return dict(self.params)


def _device(v, device, dtype=torch.float32) -> torch.Tensor:
    """v (a list or a tensor) as a tensor on `device`; a tensor already there is used as it is."""
    return torch.as_tensor(v, dtype=dtype, device=device)


def _per_config(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A per-configuration tensor [H] shaped to broadcast against a parameter stack: [H, 1, 1...]."""
    return v.view(-1, *[1] * (p.dim() - 1))


class _Masked(_Run):
    """Shared bookkeeping of the whole-stack optimizers: device hyperparameters [H], device step counts [H, C] per
    parameter (`t`), the parameters and their state in their own memory (gradients of any layout are taken as they
    come: elementwise arithmetic mixes layouts, and a captured step must find the parameters where it left them)."""

    t: Params  # name -> [H, C] steps taken per model

    def __init__(self, params: Params, hp, scale=None, groups=None):
        _adopt(self, params)
        first = next(iter(self.params.values()))
        self.device, (H, C) = first.device, first.shape[:2]
        scale, groups = scale or {}, groups or {}
        of = {k: groups.get(k, Group()) for k in self.params}
        self.lr = {k: _per_config(hp[of[k].lr] * scale.get(k, 1.0), p) for k, p in self.params.items()}  # [H, 1...]
        self.wd = {k: _per_config(hp[of[k].weight_decay], p) for k, p in self.params.items()}  # [H, 1...]
        self.t = {k: torch.zeros(H, C, device=self.device) for k in self.params}  # [H, C] steps taken per model

    def _restart(self) -> None:
        for t in self.t.values():
            t.zero_()  # in place: a captured step keeps reading the same tensors

    def _stepping(self, grads: Params, active, frozen):
        """Yield (k, p, g, on, now) per trained parameter, over the first n models that `active` [H, n] covers: p
        [H, n, ...] the parameter, g its gradient with L2 weight decay added, on [H, n, 1...] the models that step,
        now [H, n, 1...] their step count including this one."""
        act = _device(active, self.device, torch.bool)  # [H, n]; a no-op for a device bool tensor
        n = act.shape[1]
        for k, g in grads.items():
            if k in frozen:
                continue
            p, t = self.params[k][:, :n], self.t[k][:, :n]
            shape = (*act.shape, *[1] * (p.dim() - 2))
            t.add_(act)  # [H, C]
            yield k, p, torch.addcmul(g, p, self.wd[k]), act.view(shape), t.view(shape)  # g: [H, C, ...]


class MaskedAdam(_Masked):
    """torch.optim.Adam per model, as whole-stack arithmetic (see the module docstring). Same constructor and step
    as `Adam`; `active` may be a device bool tensor [H, C] (pass one: a host list costs a copy per step)."""

    state_names = ("m", "v")
    carried = ("params", "m", "v", "t")
    m: Params
    v: Params

    def __init__(self, params: Params, hp, scale=None, groups=None, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, hp, scale, groups)
        self.betas, self.eps = betas, eps

    def step(self, grads: Params, active, frozen=(), host=None) -> Params:
        b1, b2 = self.betas
        for k, p, g, on, now in self._stepping(grads, active, frozen):
            m, v = self.m[k][:, : p.shape[1]], self.v[k][:, : p.shape[1]]  # [H, n, ...]
            torch.where(on, torch.lerp(m, g, 1 - b1), m, out=m)
            torch.where(on, torch.lerp(v, g.square_(), 1 - b2), v, out=v)  # b2·v + (1 − b2)·g²
            now = now.double()  # bias corrections in float64, as torch's kernels: in float32 1 − 0.999^t cancels
            step = (self.lr[k] / (1 - b1**now)).float()  # [H, C, 1...] (inf where a model never stepped: masked)
            denom = (v.sqrt() / (1 - b2**now).sqrt_().float()).add_(self.eps)  # [H, C, ...]
            torch.where(on, torch.addcmul(p, m / denom, step, value=-1), p, out=p)  # [H, C, ...]
        return dict(self.params)


class MaskedSGD(_Masked):
    """torch.optim.SGD (momentum, dampening 0) per model, as whole-stack arithmetic. Same constructor and step as
    `SGD`; `momentum` None keeps no buffer; a configuration with momentum 0 leaves its buffer at zero, as SGD does."""

    state_names = ("buf",)
    carried = ("params", "buf", "t")
    buf: Params

    def __init__(self, params: Params, hp, scale=None, groups=None):
        super().__init__(params, hp, scale, groups)
        mom = hp.get("momentum")  # [H] or None
        self.momentum = None if mom is None else (mom, mom != 0)  # [H] each: and the configurations keeping a buffer

    def step(self, grads: Params, active, frozen=(), host=None) -> Params:
        for k, p, g, on, _ in self._stepping(grads, active, frozen):
            if self.momentum is not None:  # structural (fixed at construction), not a value read
                buf, mom, moving = self.buf[k][:, : p.shape[1]], *(_per_config(t, p) for t in self.momentum)
                g = torch.addcmul(g, buf, mom)  # [H, C, ...] mom·buf + g; a first step's buffer is still zero: g
                torch.where(on & moving, g, buf, out=buf)
            torch.where(on, torch.addcmul(p, g, self.lr[k], value=-1), p, out=p)  # [H, C, ...]
        return dict(self.params)


OPTIMIZERS: dict[str, type[_Stacked]] = {"adam": Adam, "sgd": SGD}  # fused kernels per configuration: the CPU's choice
MASKED = {"adam": MaskedAdam, "sgd": MaskedSGD}  # whole-stack arithmetic: the GPU's choice
BY_DEVICE = {"cuda": MASKED}  # device type -> registry; any other device uses OPTIMIZERS


def optimizer_for(name: str, device, masked: bool = False) -> type:
    """The optimizer class for `name` on `device`. Rule: masked on CUDA (a GPU step is launch-bound: a fixed number
    of kernels, no host data, capturable by a CUDA graph) and wherever steps are captured (`masked`); fused on every
    other device (the CPU pays per memory pass, not per launch, and the fused kernels make one pass per tensor)."""
    return (MASKED if masked else BY_DEVICE.get(torch.device(device).type, OPTIMIZERS))[name]
