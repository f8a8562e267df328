"""Capture of a local step (steps.py): on CUDA, a step is recorded once as a CUDA graph and replayed for every later
step of the same kind, so a round's hundreds of small kernels cost one launch per step instead of one each.

A captured step reads and writes only *static* tensors, the same memory at every replay: the optimizer's parameters
and moments (one optimizer per run, `load`ed each round), the runner's BN buffers and loss accumulators, and the
`Static` slots below, into which the runner copies each step's batch indices and each epoch's context before the
replay. One graph is kept per key (which parameters train, the batch width, the context's structure), so FedPFT's
phases or a short last batch each get their own (at most MAX_GRAPHS kinds; later kinds run eagerly).

Capturing runs the step a few times first (CUDA's warm-up, which lazily creates cuBLAS handles and workspaces).
Those runs must not train: the runner hands `capture` a `disarm` context in which no model takes part (the
participation slot is cleared), so every update is masked out, and restores it before the first replay. Where
capture is impossible (an op that synchronises or copies from pageable host memory), the key falls back to running
the same step function eagerly, and `failures` says why.

Modes: "cuda" records CUDA graphs; "replay" (for tests on the CPU) follows the same protocol with a Python call in
place of the graph: static slots, disarmed warm-up runs and one step function per key, so a tensor the runner forgets
to copy into its slot, or a warm-up that changes a model, shows up as a difference from the eager run.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import UserError, first_line

MODES = ("off", "replay", "cuda")
WARMUP = 2  # eager runs before capture (PyTorch's CUDA-graph recipe uses a few, on a side stream)
MAX_GRAPHS = 16  # kinds of step captured per engine; beyond, a context whose shapes change every round (a plug-in
# keeping a growing history in ctx) would capture a new graph each round: the runner runs further kinds eagerly


def resolve_mode(capture: str | None, device: torch.device) -> str:
    """`None`/"auto": the environment's FEATCACHE_CAPTURE if set (e.g. "off", to run a GPU's steps eagerly from the
    command line), else "cuda" on a CUDA device and "off" elsewhere."""
    if capture in (None, "auto"):
        capture = os.environ.get("FEATCACHE_CAPTURE", "auto")
    if capture == "auto":
        return "cuda" if device.type == "cuda" else "off"
    if capture not in MODES:
        raise UserError(f"capture (or FEATCACHE_CAPTURE) must be one of {', '.join(MODES)} or auto, not {capture!r}")
    if capture == "cuda" and device.type != "cuda":
        raise UserError("capture=cuda needs a CUDA device: use --device cuda, or unset FEATCACHE_CAPTURE")
    return capture


def _compact(t: torch.Tensor) -> torch.Tensor:
    """The distinct elements of t: every broadcast (stride-0) axis narrowed to length 1."""
    for d, s in enumerate(t.stride()):
        if s == 0 and t.shape[d] > 1:
            t = t.narrow(d, 0, 1)
    return t


def signature(tree) -> tuple:
    """What a captured step bakes in about a (nested) context: its structure, each tensor's shape, dtype and
    broadcast axes, and every non-tensor leaf's value."""
    leaves, spec = tree_flatten(tree)
    sig = tuple(
        (tuple(v.shape), v.dtype, v.device, tuple(s == 0 for s in v.stride())) if torch.is_tensor(v) else ("py", v)
        for v in leaves
    )
    return (str(spec), sig)


class Static:
    """A static copy of a (nested) tree of tensors: `load(tree)` copies new values in, `tree` is what the captured
    step reads. Broadcast tensors stay broadcast (an expanded [H, C, C, K, d] context costs its [H, K, d]); a view of
    memory that stays put for the run (`fixed`: data pointers of the training data) is used as it is, not copied."""

    def __init__(self, tree, fixed: frozenset = frozenset()):
        leaves, self.spec = tree_flatten(tree)
        self.fixed = fixed
        self.leaves = [
            v
            if not torch.is_tensor(v) or self._fixed(v)
            else torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=v.device)
            for v in leaves
        ]
        self.tree = tree_unflatten(self.leaves, self.spec)
        self.load(tree)

    def _fixed(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.fixed

    def load(self, tree) -> None:
        for slot, v in zip(self.leaves, tree_flatten(tree)[0]):
            if torch.is_tensor(slot) and v is not slot and not self._fixed(slot):
                _compact(slot).copy_(_compact(v))


@contextmanager
def disarmed(part: torch.Tensor):
    """No model takes part while inside (part [H, C] bool cleared, then restored): a step run here changes nothing."""
    saved = part.clone()
    part.zero_()
    try:
        yield
    finally:
        part.copy_(saved)


class Graphs:
    """The captured step functions of one engine, by key, on the engine's device."""

    def __init__(self, mode: str, device: torch.device | None = None):
        self.mode, self.device = mode, device
        self.steps: dict = {}  # key -> callable running the step
        self.failures: dict = {}  # why steps run eagerly: key -> one line
        self.pool = None  # one memory pool shared by all graphs (they never run at the same time)

    def __contains__(self, key) -> bool:
        return key in self.steps

    def admits(self, key) -> bool:
        """Whether `key` has, or may get, a captured step: not once MAX_GRAPHS kinds are captured (a new kind then
        runs eagerly, with nothing kept for it; `failures` says so once)."""
        if key in self.steps or len(self.steps) < MAX_GRAPHS:
            return True
        self.failures.setdefault("more", f"more than {MAX_GRAPHS} kinds of step: the others run eagerly")
        return False

    def capture(self, key, fn, disarm: AbstractContextManager) -> None:
        """Record `fn` (no arguments; reads and writes static tensors only) for `key`; inside `disarm` it must
        change nothing."""
        with disarm, self._on_device():
            try:
                self.steps[key] = self._cuda(fn) if self.mode == "cuda" else self._replay(fn)
            except Exception as e:  # capture is impossible for this step: run it eagerly
                if self.mode != "cuda":
                    raise
                torch.cuda.synchronize()
                cause = e.__context__ or e  # capture_end's own error hides the op that invalidated the capture
                self.steps[key], self.failures[key] = fn, f"{type(cause).__name__}: {first_line(cause)}"

    def run(self, key) -> None:
        with self._on_device():
            self.steps[key]()

    def _on_device(self):
        """Streams and graphs belong to the current CUDA device: make it the engine's (cuda:1 included)."""
        return torch.cuda.device(self.device) if self.mode == "cuda" else nullcontext()

    @staticmethod
    def _replay(fn):
        for _ in range(WARMUP):
            fn()
        return fn

    def _cuda(self, fn):
        caller = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn()
        caller.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                fn()
        finally:
            torch.cuda.set_stream(caller)  # a failed capture_end skips torch.cuda.graph's own restore
        self.pool = graph.pool()
        return graph.replay
