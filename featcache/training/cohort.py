"""The round's cohort: the clients that take part, gathered into a compact [H, P] batch for local training.

Local training costs in proportion to the models it trains, so a round trains only its participants: P models per
configuration, P = the participant count (the same for every configuration and round, `schedule.participants`).
Whole-run state stays [H, C]; `take` gathers a round's slice of it, `put` writes the trained slice back. A cohort
lists its clients in the run's step order (most local steps first), so the clients that still have a batch at any
step are a prefix of it (steps.py trains that prefix only). Where that order is the identity (clients of equal step
counts) and the cohort is every client, both are the identity (nothing copied).
"""

from __future__ import annotations

import torch

from .optim import copy_into, flat
from .schedule import participants


def cohort_size(C: int, rate: float, keeps_optimizer_state: bool = False) -> int:
    """P, the models per configuration one round trains: the round's participants, or every client (the others
    masked out) where each model's optimizer lives for the whole run (its moments stay in place, [H, C])."""
    return C if keeps_optimizer_state else participants(C, rate)


def slice_size(P: int, at_once: int | None, keeps_optimizer_state: bool = False) -> int:
    """The models per configuration one pass of local training holds: at most `at_once` of the P (all P where
    at_once is None, or where each model's optimizer lives for the whole run)."""
    return P if at_once is None or keeps_optimizer_state else min(P, at_once)


def sets_aside(algo, C: int, P: int) -> bool:
    """Whether the participants' shared tensors skip the [H, C] state and go to the server as trained: FedAvg's
    server (download replaces them for every client) with P < C participants, trained in one pass or in slices."""
    return P < C and algo.fedavg_server


def aside_names(algo, state, C: int, P: int) -> tuple[str, ...]:
    """The shared parameters and buffers of `state` that go to the server as trained (`sets_aside`; none
    otherwise): never written into the [H, C] state."""
    names = (*state.params, *state.buffers)
    return tuple(k for k in names if algo.shared(k)) if sets_aside(algo, C, P) else ()


def put_models(dst: torch.Tensor, at: torch.Tensor, src: torch.Tensor) -> None:
    """dst[h, at[h]] = src[h] for every configuration h (dst [H, P, ...], at [H, n], src [H, n, ...]): in one layout
    a memory copy per model (an indexed write over [H, n] goes element by element)."""
    for h in range(dst.shape[0]):
        if dst[h].is_contiguous() == src[h].is_contiguous():  # row-major or last two dims transposed, both
            flat(dst[h]).index_copy_(0, at[h], flat(src[h]))
        else:
            dst[h, at[h]] = src[h]


def models_like(t: torch.Tensor, P: int) -> torch.Tensor:
    """An empty [H, P, ...] stack of t's [H, S, ...] models, in t's layout (row-major or last-two-dims transposed)."""
    shape = (t.shape[0], P, *t.shape[2:])
    if t.dim() > 3 and not t.is_contiguous() and t.mT.is_contiguous():
        return t.new_empty(*shape[:-2], shape[-1], shape[-2]).mT
    return t.new_empty(shape)


def reorder(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [H, C, ...] with its clients taken in `index` [C'] order, in t's layout where each model's entry is dense
    (row-major or last-two-dims transposed): one row gather over the models' flat memory."""
    transposed = t.dim() > 3 and not t.is_contiguous() and t.mT.is_contiguous()
    flat = t.mT if transposed else t.contiguous()
    out = flat.reshape(*flat.shape[:2], -1).index_select(1, index).view(flat.shape[0], len(index), *flat.shape[2:])
    return out.mT if transposed else out


def select(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [H, C, ...] at clients `index` [C'], the same for every configuration: a broadcast over clients stays one,
    anything else is one row gather (`reorder`)."""
    if t.stride(1) == 0:
        return t[:, :1].expand(t.shape[0], len(index), *t.shape[2:])
    return reorder(t, index)


class Cohort:
    """Which clients the [H, P] models of a round are: ids [H, P] (per configuration in the run's step `order`), on
    the device and as host lists; `full` when P = C (every client, those sitting the round out masked), `everyone`
    when it is moreover the whole [H, C] stack in order."""

    def __init__(
        self,
        part: list,
        P: int,
        device: torch.device,
        host: list | None = None,
        real: int | None = None,
        order: list[int] | None = None,
    ):
        """part: [H][C] host bools, the round's participants (exactly P per configuration unless P = C); `order` the
        clients in step order (`Plan.order`; default: by id); `host` [H][P] the clients of a slice of them instead
        (`slices`), of which the first `real` train and are written back (default: all P)."""
        H, C = len(part), len(part[0])
        order = list(range(C)) if order is None else order
        self.full = P == C
        self.everyone = self.full and order == sorted(order)
        if host is None:
            host = [order] * H if self.full else [[c for c in order if row[c]] for row in part]
        self.host = host
        if any(len(row) != P for row in self.host):
            raise ValueError(f"a cohort of {P} models per configuration got {[len(r) for r in self.host]} participants")
        self.ids = torch.tensor(self.host, device=device)  # [H, P] int64
        self._order = self.ids[0] if self.full and not self.everyone else None  # [C]: one order for every row
        self.real = P if real is None else real  # the models written back (a last slice is padded to its width)
        self.part = (
            part
            if self.everyone
            else [[part[h][c] and j < self.real for j, c in enumerate(row)] for h, row in enumerate(self.host)]
        )  # [H][P] host: who trains (in a full cohort, the round's participants)
        self._h = torch.arange(H, device=device)[:, None]  # [H, 1]

    @classmethod
    def slices(cls, part: list, P: int, at_once: int, device: torch.device, order=None) -> list["Cohort"]:
        """The round's cohort of P per configuration (clients in step `order`) as consecutive slices of `at_once`
        models each (one cohort when at_once >= P): the models one pass of local training holds. A last, shorter
        slice is padded with models of the first that sit it out and are not written back."""
        whole = cls(part, P, device, order=order)
        if at_once >= P:
            return [whole]
        return [
            cls(
                part,
                at_once,
                device,
                [row[i : i + at_once] + row[: max(0, i + at_once - P)] for row in whole.host],
                min(at_once, P - i),
            )
            for i in range(0, P, at_once)
        ]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """[H, C, ...] -> [H, P, ...], the cohort's models (t itself for everyone; a broadcast over clients stays a
        broadcast)."""
        if self.everyone:
            return t
        if t.stride(1) == 0 or self._order is not None:  # a broadcast, or one order for every configuration
            return select(t, self.ids[0])
        return t[self._h, self.ids]

    def take_into(self, dst: dict, src: dict, chunk: int = 2**26) -> dict:
        """`take` of every [H, C, ...] tensor of src written into dst's [H, P, ...] tensors of the same names (the
        optimizer's own), a slice of about `chunk` bytes at a time rather than through a temporary of the cohort's
        size; returns a new dict of dst's tensors."""
        for k, t in src.items():
            out = dst[k]
            if self.everyone or t.stride(1) == 0 or self._order is not None:  # t itself, a broadcast, one order
                copy_into({k: out}, {k: self.take(t)})
                continue
            step = max(1, chunk // (out[0, 0].numel() * out.element_size()))
            for i in range(0, out.shape[1], step):
                out[:, i : i + step] = t[self._h, self.ids[:, i : i + step]]
        return dict(dst)

    def take_tree(self, tree: dict) -> dict:
        """`take` on every tensor of a (nested) dict of [H, C, ...] tensors."""
        return {k: self.take_tree(v) if isinstance(v, dict) else self.take(v) for k, v in tree.items()}

    def take_clients(self, t: torch.Tensor) -> torch.Tensor:
        """[C, ...] per-client data -> [H, P, ...] (t itself, [C, ...], for everyone)."""
        return t if self.everyone else t[self.ids]

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Write the cohort's src [H, P, ...] into dst [H, C, ...]; returns the result (src itself for everyone, a new
        tensor in client-id order for any other full cohort; dst updated in place where it owns its memory, else a
        copy)."""
        if self.everyone:
            return src
        if self._order is not None:  # every configuration's clients in the one step order: all of dst replaced
            return reorder(src, self._order.argsort()).to(dst.dtype)
        if dst._base is not None or not dst.is_contiguous():
            dst = dst.clone()
        n = self.real
        dst[self._h, self.ids[:, :n]] = src[:, :n].to(dst.dtype)
        return dst
