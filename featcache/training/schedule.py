"""The minibatch plan: which rows each model trains on, in which order, and which clients take part.

Minibatch order comes from a counter-based hash of (seed, round, epoch, client, row), so it needs no Python loop
over clients, and a client sees the same batches whether it trains alone, in a plain loop, or inside a grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import ClientData
from ..errors import UserError

_MASK63 = (1 << 63) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping multiply, logical shifts)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def hash_keys(
    seeds: torch.Tensor, *ids: int, shape: tuple[int, ...], clients: torch.Tensor | None = None
) -> torch.Tensor:
    """Pseudo-random int64 keys [H, *shape] from (seed_h, ids..., position); same inputs, same keys, anywhere (on the
    device of `seeds`: integer arithmetic only, so CPU and GPU give the same bits). `clients` [H, P] replaces the
    first axis's positions by those client ids: the keys of those clients only, [H, P, *shape[1:]]."""
    x = seeds.long().reshape(-1, *([1] * len(shape)))
    for i in ids:
        x = _mix(x * 1_000_003 + i)
    for d, n in enumerate(shape):  # each axis position enters separately: client c, row n
        if d == 0 and clients is not None:
            coord = clients.reshape(*clients.shape, *([1] * (len(shape) - 1)))  # [H, P, 1...]
        else:
            coord = torch.arange(n, device=x.device).reshape(*([1] * (d + 1)), n, *([1] * (len(shape) - d - 1)))
        x = _mix(x * 1_000_003 + coord)
    return x & _MASK63


def batch_order(
    seeds: torch.Tensor, rnd: int, epoch: int, counts: torch.Tensor, n_max: int, clients: torch.Tensor | None = None
) -> torch.Tensor:
    """Per model, a random permutation of its client's valid rows, padding rows last: [H, C, Nmax] int64, on the
    device of `seeds` (`counts` [C] on the same device); no host synchronisation. `clients` [H, P]: the orders of
    those clients only, [H, P, Nmax] (the same as theirs among all C)."""
    keys = hash_keys(seeds, rnd, epoch, shape=(len(counts), n_max), clients=clients)  # [H, C or P, Nmax]
    counts = counts if clients is None else counts[clients]  # [C] or [H, P]
    valid = torch.arange(n_max, device=keys.device) < counts[..., None]  # [C or H, P, Nmax]
    keys = torch.where(valid, keys >> 1, torch.full_like(keys, _MASK63))  # [H, C, Nmax]
    return torch.argsort(keys, dim=-1, stable=True)


def participants(C: int, rate: float) -> int:
    """How many of C clients take part in a round at participation `rate` (at least one)."""
    return C if rate >= 1 else max(1, round(rate * C))


def participation(seeds: torch.Tensor, rnd: int, C: int, rate: float) -> torch.Tensor:
    """[H, C] bool: which clients take part in this round, `participants(C, rate)` per configuration."""
    if rate >= 1:
        return torch.ones(len(seeds), C, dtype=torch.bool)
    k = participants(C, rate)
    keys = hash_keys(seeds, rnd, 1 << 20, shape=(C,))  # [H, C]
    ranks = torch.argsort(torch.argsort(keys, dim=-1), dim=-1)
    return ranks < k


def took_part(seeds: torch.Tensor, start: int, end: int, C: int, rate: float) -> list:
    """[H][C] host bools: the clients that took part in any of rounds start..end (0-based, inclusive), from the
    seeded draws (so a resumed run knows them too)."""
    part = torch.zeros(len(seeds), C, dtype=torch.bool)
    for r in range(start, end + 1):
        part |= participation(seeds, r, C, rate)
    return part.tolist()


def evaluates(rnd: int, cfg) -> bool:
    """Whether round `rnd` (0-based) ends with an evaluation: every `eval_every` rounds and after the last."""
    return (rnd + 1) % cfg["eval_every"] == 0 or rnd == cfg["rounds"] - 1


def trained_rows(counts, batch_size: int, drop_last: bool) -> list[int]:
    """Rows each client trains on per local epoch: drop_last drops a short last batch unless it is the client's only
    one (a client smaller than a batch trains on all its rows in one step, never on none)."""
    return [int(n) // batch_size * batch_size if drop_last and int(n) >= batch_size else int(n) for n in counts]


def trained_counts(counts: torch.Tensor, batch_size: int, drop_last: bool) -> torch.Tensor:
    """`trained_rows` of a [C] tensor of counts, on its device (no host read)."""
    if not drop_last:
        return counts
    return torch.where(counts >= batch_size, counts // batch_size * batch_size, counts)  # [C]


def client_steps(counts, batch_size: int, drop_last: bool) -> list[int]:
    """Minibatches each client takes per local epoch (the one place this is computed; see `Round.client_steps`)."""
    return [(n + batch_size - 1) // batch_size for n in trained_rows(counts, batch_size, drop_last)]


def one_step_note(algo, counts, batch_size: int, drop_last: bool, epochs: int, what: str = "") -> str:
    """One line naming the clients that take a single local step per round ("" when none, or when `algo` has no
    proximal term): that step starts at the global model, where a term pulling toward it (FedProx's μ, the `penalty`
    hook) has no gradient, so settings that change only that term train the same model. `what` names the rows
    counted (e.g. "validation fit")."""
    if not getattr(algo, "proximal", False):
        return ""  # FedAvg, FedPCL, ...: one step is plain SGD from the global model, nothing to warn about
    steps = client_steps(counts, batch_size, drop_last)
    one = [i for i, s in enumerate(steps) if s * epochs == 1]
    if not one:
        return ""
    rows = sorted({int(counts[i]) for i in one})
    sizes = f"{rows[0]}" if len(rows) == 1 else f"{rows[0]}-{rows[-1]}"
    who = f"client {one[0]}" if len(one) == 1 else f"{len(one)} of {len(steps)} clients"
    return (
        f"{who} take{'s' if len(one) == 1 else ''} one local step per round ({sizes} {what + ' ' if what else ''}rows, "
        f"batch_size={batch_size}, local_epochs=1): the step starts at the global model, so {algo.name}'s proximal "
        "term (mu) has no gradient and settings that change only it train the same model; a smaller --set "
        "batch_size or more local_epochs gives more steps"
    )


DROPPED_NOTE = 0.1  # drop_last leaving out this share of the training rows or more is said


def dropped_note(counts, batch_size: int, drop_last: bool, what: str = "training") -> str:
    """One line saying how many rows drop_last leaves out of every local epoch (each client's short last batch),
    when that is at least DROPPED_NOTE of them ("" otherwise)."""
    total = sum(int(n) for n in counts)
    dropped = total - sum(trained_rows(counts, batch_size, drop_last))
    if not total or dropped < DROPPED_NOTE * total:
        return ""
    return (
        f"drop_last leaves {dropped} of {total} {what} rows ({100 * dropped / total:.0f} %) out of every local epoch "
        f"(each client's short last batch at batch_size={batch_size}); --set drop_last=false trains on all of them"
    )


@dataclass(frozen=True)
class Plan:
    """The run's minibatch plan, fixed for the run: steps per local epoch and, per step, its rows' validity."""

    batch_size: int
    steps: int  # minibatches per local epoch (the largest client's; smaller clients sit the rest out)
    client_steps: torch.Tensor  # [C] minibatches each client takes per local epoch
    order: list  # host [C]: the clients by their steps, most first (ties by id), the order cohorts list them in
    has_batch: list  # host [steps][C] bool: which clients still have a batch at each step
    valid: list  # [C, B_s] bool per step: the rows of a step that are real samples

    def rows(self, order: torch.Tensor, step: int) -> torch.Tensor:
        """The rows of step `step` from a batch order [H, C, N]: [H, C, B_s]."""
        B = self.batch_size
        return order[..., step * B : (step + 1) * B]


def plan_steps(data: ClientData, batch_size: int, drop_last: bool) -> Plan:
    """The plan of `data` (read from the host once, before training). Refuses clients that would never train."""
    B, device = batch_size, data.features.device
    counts = data.counts.tolist()  # once, before training
    n_eff = trained_rows(counts, B, drop_last)
    empty = sum(n == 0 for n in n_eff)
    if empty:
        raise UserError(f"{empty} client(s) have no training rows and would never train: extract with fewer clients")
    per_client = client_steps(counts, B, drop_last)
    steps, N = max(per_client), data.features.shape[1]
    n_eff_t = torch.tensor(n_eff, device=device)  # [C]
    valid = [(s * B + torch.arange(min(B, N - s * B), device=device)) < n_eff_t[:, None] for s in range(steps)]
    order = sorted(range(len(per_client)), key=lambda c: -per_client[c])
    has_batch = [[s * B < n for n in n_eff] for s in range(steps)]
    return Plan(B, steps, torch.tensor(per_client, device=device), order, has_batch, valid)
