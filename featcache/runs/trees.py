"""The one codec between a tree (nested dicts and lists of tensors, numbers, strings, None: an engine's
`state_dict`, a `State`'s groups) and named tensors for safetensors. A leaf is named by its path, keys and indices
joined with "/" (`params/proj0.weight`).

Two ways to write a tree's tensors, over the same walk:

- `flatten` (a saved state, states.py): each tensor, and each number, a contiguous CPU copy of its own under its
  name; `unflatten` gives one group's nested dicts back.
- `pack` (a checkpoint, checkpoint.py): the tensors with the memory layout they have: each block of memory they
  view is one span, and a skeleton (JSON) says where each tensor lies in its span; `unpack` rebuilds the tree in
  those layouts. A resumed run then computes on the layouts the uninterrupted one had: a matmul or a reduction
  rounds differently on another, and a fresh copy would make the first step after a resume differ in its last bits.
"""

from __future__ import annotations

from typing import Callable

import torch

ALIGN = 64  # bytes: a restored tensor keeps its address modulo this (vector kernels peel unaligned heads)
VALUES = (bool, int, float, str, type(None))  # what a skeleton holds as it is


class Unsupported(TypeError):
    """A leaf the codec cannot write; `name` is its path and `kind` its type's name (the caller words the refusal)."""

    def __init__(self, name: str, kind: str):
        super().__init__(f"{name} is a {kind}")
        self.name, self.kind = name, kind


def _join(name: str, key) -> str:
    return f"{name}/{key}" if name else str(key)


def walk(tree, leaf: Callable, name: str = "", lists: bool = True):
    """The skeleton of `tree`: a dict as {"dict": [[key, ...]]}, a list or tuple as {"list": [...], "tuple": bool}
    (where `lists`; else it is a leaf), each leaf as `leaf(name, x)` returns it, `name` its path."""
    if isinstance(tree, dict):
        return {"dict": [[k, walk(v, leaf, _join(name, k), lists)] for k, v in tree.items()]}
    if lists and isinstance(tree, (list, tuple)):
        return {
            "list": [walk(v, leaf, _join(name, i), lists) for i, v in enumerate(tree)],
            "tuple": isinstance(tree, tuple),
        }
    return leaf(name, tree)


def build(skeleton: dict, leaf: Callable):
    """The tree a `walk` skeleton describes, each leaf entry turned back by `leaf(entry)`."""
    if "dict" in skeleton:
        return {k: build(v, leaf) for k, v in skeleton["dict"]}
    if "list" in skeleton:
        items = [build(v, leaf) for v in skeleton["list"]]
        return tuple(items) if skeleton["tuple"] else items
    return leaf(skeleton)


# -- a saved state: contiguous copies by name -------------------------------------------------------------------
def flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """{"a": {"b": t}} -> {"prefix/a/b": t}: every tensor a contiguous CPU copy of its own (safetensors refuses
    views and shared storage), numbers 0-d tensors; nested dicts only (anything else: `Unsupported`)."""
    out = {}

    def leaf(name: str, x):
        if not isinstance(x, (torch.Tensor, int, float, bool)):
            raise Unsupported(name, type(x).__name__)
        out[name] = torch.as_tensor(x).detach().cpu().contiguous().clone()

    walk(tree, leaf, prefix, lists=False)
    return out


def unflatten(tensors: dict[str, torch.Tensor], group: str) -> dict:
    """The nested dict under the first name part `group` of `flatten`ed tensors (a saved state's "params", ...)."""
    out: dict = {}
    for name, t in tensors.items():
        head, *path = name.split("/")
        if head != group:
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = t
    return out


# -- a checkpoint: tensors in their layouts ---------------------------------------------------------------------
def pack(tree) -> tuple[dict, dict, dict]:
    """(skeleton, spans, pads) of `tree`, its tensors saved with the memory layout they have: each block of memory
    the tensors view is one span (`spans`: name -> the 1-d CPU copy of the elements they cover, named after the
    first tensor in it), and each tensor in the skeleton says where it lies in its span (shape, strides, offset),
    whether it is a view and which tensor object it is; `pads` (span name -> elements) put a restored span at the
    address offset (mod ALIGN) it had. So strides, broadcasts (stride 0), memory shared between tensors and
    alignment come back as they were: what a kernel's rounding can depend on. Leaves other than tensors, numbers,
    strings and None: `Unsupported`."""
    leaves: list = []  # (name, tensor, its skeleton entry, filled in below)
    seen: dict = {}  # id -> the entry of a tensor met before

    def leaf(name: str, x):
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:  # one entry per tensor object, wherever the tree holds it
                seen[id(x)] = {"object": len(leaves), "view": x._base is not None}  # (x.detach() is no view)
                leaves.append((name, x.detach(), seen[id(x)]))
            return seen[id(x)]
        if isinstance(x, VALUES):
            return {"value": x}
        raise Unsupported(name, type(x).__name__)

    skeleton = walk(tree, leaf)
    blocks: dict = {}  # (device, dtype, storage address) -> the leaves that view it
    for i, (_, t, _) in enumerate(leaves):
        blocks.setdefault((t.device, t.dtype, t.untyped_storage().data_ptr()) if t.numel() else i, []).append(i)
    spans, pads = {}, {}
    for members in blocks.values():
        name, first, _ = leaves[members[0]]
        if name in spans:  # two tensors at one path: a key holding "/"
            raise Unsupported(name, "path two tensors share")
        lo = min(leaves[i][1].storage_offset() for i in members)
        hi = max(_end(leaves[i][1]) for i in members)
        span = first.as_strided((hi - lo,), (1,), lo)
        spans[name] = span.to("cpu", copy=True)
        pads[name] = span.data_ptr() % ALIGN // first.element_size() if span.numel() else 0
        for i in members:
            t = leaves[i][1]
            leaves[i][2].update(
                tensor=name, shape=list(t.shape), stride=list(t.stride()), offset=t.storage_offset() - lo
            )
    return skeleton, spans, pads


def _end(t: torch.Tensor) -> int:
    """One past the last storage element `t` covers."""
    return int(t.storage_offset() + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0))


def unpack(skeleton: dict, spans: dict, pads: dict, device="cpu"):
    """The tree `pack` described, its tensors on `device` in the layouts they were packed with: one fresh block of
    memory per span, each tensor a view of it where it was a view (else a tensor of its own over that memory), one
    tensor object wherever the packed tree held one."""
    memory: dict = {}
    made: dict = {}

    def block(name: str) -> torch.Tensor:
        if name not in memory:
            span, pad = spans[name], pads[name]
            memory[name] = torch.empty(pad + span.numel(), dtype=span.dtype, device=device)
            memory[name][pad:].copy_(span)
        return memory[name]

    def leaf(s: dict):
        if "tensor" not in s:
            return s["value"]
        if s["object"] not in made:
            buf, at = block(s["tensor"]), pads[s["tensor"]] + s["offset"]
            made[s["object"]] = (
                buf.as_strided(s["shape"], s["stride"], at)
                if s["view"]
                else buf.new_empty(0).set_(buf.untyped_storage(), at, s["shape"], s["stride"])
            )
        return made[s["object"]]

    return build(skeleton, leaf)


def outline(tree):
    """The structure of a tree: dict keys, list lengths, each tensor's shape and dtype (a tuple), each value's
    type."""
    if isinstance(tree, torch.Tensor):
        return ("tensor", tuple(tree.shape), str(tree.dtype))
    if isinstance(tree, dict):
        return {k: outline(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [outline(v) for v in tree]
    return type(tree).__name__


def fits(ours, theirs) -> bool:
    """Whether the outline `theirs` has every entry of `ours` with the same structure, shapes and dtypes; entries
    may come on top (an algorithm's state that grows after round 1)."""
    if isinstance(ours, dict):
        return isinstance(theirs, dict) and all(k in theirs and fits(v, theirs[k]) for k, v in ours.items())
    if isinstance(ours, list):
        return isinstance(theirs, list) and len(ours) == len(theirs) and all(map(fits, ours, theirs))
    return ours == theirs
