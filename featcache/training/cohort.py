"""The round's cohort: the clients that take part, gathered into a compact [H, P] batch for local training.

Local training costs in proportion to the models it trains, so a round trains only its participants: P models per
configuration, P = the participant count (the same for every configuration and round, `schedule.participants`).
Whole-run state stays [H, C]; `take` gathers a round's slice of it, `put` writes the trained slice back. At
participation 1.0 the cohort is every client and both are the identity (nothing copied).
"""

from __future__ import annotations

import torch

from .schedule import participants


def cohort_size(C: int, rate: float, keeps_optimizer_state: bool = False) -> int:
    """P, the models per configuration one round trains: the round's participants, or every client (the others
    masked out) where each model's optimizer lives for the whole run (its moments stay in place, [H, C])."""
    return C if keeps_optimizer_state else participants(C, rate)


class Cohort:
    """Which clients the [H, P] models of a round are: ids [H, P] (ascending per configuration), on the device and
    as host lists; `everyone` when P = C and the cohort is the whole [H, C] stack in order."""

    def __init__(self, part: list, P: int, device: torch.device):
        """part: [H][C] host bools, the round's participants (exactly P per configuration unless P = C)."""
        H, C = len(part), len(part[0])
        self.everyone = P == C
        self.host = [list(range(C))] * H if self.everyone else [[c for c, p in enumerate(row) if p] for row in part]
        if any(len(row) != P for row in self.host):
            raise ValueError(f"a cohort of {P} models per configuration got {[len(r) for r in self.host]} participants")
        self.ids = torch.tensor(self.host, device=device)  # [H, P] int64
        self.part = part if self.everyone else [[True] * P for _ in range(H)]  # [H][P] host: who trains
        self._h = torch.arange(H, device=device)[:, None]  # [H, 1]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """[H, C, ...] -> [H, P, ...], the cohort's models (t itself for everyone; a broadcast over clients stays a
        broadcast)."""
        if self.everyone:
            return t
        if t.stride(1) == 0:
            return t[:, :1].expand(t.shape[0], self.ids.shape[1], *t.shape[2:])
        return t[self._h, self.ids]

    def take_tree(self, tree: dict) -> dict:
        """`take` on every tensor of a (nested) dict of [H, C, ...] tensors."""
        return {k: self.take_tree(v) if isinstance(v, dict) else self.take(v) for k, v in tree.items()}

    def take_clients(self, t: torch.Tensor) -> torch.Tensor:
        """[C, ...] per-client data -> [H, P, ...] (t itself, [C, ...], for everyone)."""
        return t if self.everyone else t[self.ids]

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Write the cohort's src [H, P, ...] into dst [H, C, ...]; returns the result (src itself for everyone; dst
        updated in place where it owns its memory, else a copy)."""
        if self.everyone:
            return src
        if dst._base is not None or not dst.is_contiguous():
            dst = dst.clone()
        dst[self._h, self.ids] = src.to(dst.dtype)
        return dst

    def put_fill(self, src: torch.Tensor, C: int, fill) -> torch.Tensor:
        """[H, P] -> [H, C]: the cohort's values, `fill` for the clients outside it."""
        if self.everyone:
            return src
        return self.put(torch.full((src.shape[0], C), fill, dtype=src.dtype, device=src.device), src)
