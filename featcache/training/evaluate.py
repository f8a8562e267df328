"""Evaluation of a run's models: per model, accuracy and loss on its client's own rows; per configuration, the
accuracy of the server's global model (the algorithm's `global_model` hook, None where the server holds none) on
the union of all clients' rows. `rnd` is the `Round` after which the models are evaluated (their context).

Where the algorithm's `predict` is personal (`personal_predict`), a client that took part in no round since the
last evaluation keeps that evaluation's figures: only the others are scored again, gathered into cohorts of at
most as many models as a round trains at once."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from ..cache import ClientData
from .cohort import Cohort, select
from .guards import Diverged, check_scores
from .models import expand_hc, map_models


@dataclass(frozen=True)
class Rows:
    """Labels, validity and counts of the rows of some clients: [C, N], [C, N], [C] for every client (a split's
    own), or [H, P, N], [H, P, N], [H, P] for a cohort's."""

    labels: torch.Tensor
    mask: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, data: ClientData, cohort: Cohort | None = None) -> "Rows":
        take = (lambda t: t) if cohort is None else cohort.take_clients
        return cls(take(data.labels), take(data.mask), take(data.counts))


_BUCKETS: dict[int, tuple] = {}  # id(counts) -> (a weak reference to counts [C], its `row_buckets`)


def row_buckets(counts: torch.Tensor, waste: float = 0.2) -> list[tuple[torch.Tensor | None, int]]:
    """The clients of `counts` [C] in groups scored together, (ids [C_b] or None for all, rows n_b): by count, most
    first, a group taking clients while none of its padding exceeds `waste` of a client's scored rows, so scoring
    costs about the real rows, not C times the largest client's (one group, None, where the clients are that even).
    Read from the host once per split."""
    ref, buckets = _BUCKETS.get(id(counts), (None, None))
    if ref is None or ref() is not counts:
        n = counts.tolist()
        order = sorted(range(len(n)), key=lambda c: -n[c])
        groups: list[list[int]] = []
        for c in order:
            if groups and n[c] >= (1 - waste) * n[groups[-1][0]]:
                groups[-1].append(c)
            else:
                groups.append([c])
        whole = len(groups) == 1 or sum(n) >= (1 - waste) * len(n) * max(n, default=0)
        buckets = (
            [(None, max(n, default=0))]
            if whole
            else [(torch.tensor(g, device=counts.device), max(n[g[0]], 1)) for g in groups]
        )
        _BUCKETS[id(counts)] = (weakref.ref(counts), buckets)
        weakref.finalize(counts, _BUCKETS.pop, id(counts), None)
    return buckets


@torch.no_grad()
def scores(algo, state, data: ClientData, rnd, model=None, first: bool = False) -> torch.Tensor:
    """Every model's scores on its client's rows of `data`: [H, C, N, K] (rows past a client's count mean nothing),
    scored in `row_buckets` of clients of similar sizes. `model` = (params, buffers) name -> [H, ...] scores the
    server's global model instead, broadcast to every client, with the algorithm's `predict_global`. Their shape is
    checked every time, their values at the `first` evaluation (`guards.check_scores`)."""
    ctx = algo.context(state, rnd)
    if model is None:
        params, buffers, fn = state.params, state.buffers, algo.predict
    else:
        params, buffers = ({k: expand_hc(v, rnd.C) for k, v in d.items()} for d in model)  # [H, C, ...]
        fn = algo.predict_global
    predict = lambda p, b, c, x: fn(p, b, x, c)
    name = getattr(fn, "__name__", "predict")
    out: torch.Tensor | None = None
    for ids, n in row_buckets(data.counts):
        x, rows = (t[:, :n] if ids is None else t[ids, :n] for t in (data.features, data.mask))  # [C_b, n, ...]
        models = [tree_map(lambda t: t if ids is None else select(t, ids), d) for d in (params, buffers, ctx)]
        models[2] = models[2] | {"rows": rows.expand(rnd.H, *rows.shape)}  # [H, C_b, n] bool: the real rows
        got = map_models(predict, tuple(models), (x,))  # [H, C_b, n, K]
        check_scores(algo, name, got, data, False)
        if ids is None:
            out = got
            break
        if out is None:
            out = got.new_zeros(*got.shape[:1], rnd.C, data.features.shape[1], got.shape[-1])  # [H, C, N, K]
        out[:, ids, :n] = got
    assert out is not None  # row_buckets gives at least one group
    check_scores(algo, name, out, data, first)
    return out


@torch.no_grad()
def cohort_scores(algo, models: tuple, data: ClientData, cohort: Cohort) -> torch.Tensor:
    """The scores [H, P, N, K] of the cohort's models, `models` = (params, buffers, context) gathered by
    `cohort.take_tree` ([H, P, ...] each), on their clients' rows of `data`."""
    params, buffers, ctx = models
    ctx = ctx | {"rows": cohort.take_clients(data.mask)}  # [H, P, N] bool
    out = map_models(
        lambda p, b, c, x: algo.predict(p, b, x, c), (params, buffers, ctx, cohort.take_clients(data.features))
    )
    check_scores(algo, "predict", out, data, False)
    return out


def stale_cohorts(stale: list, width: int, device: torch.device) -> list[Cohort] | None:
    """The clients to score again, `stale` [H][C] host bools, as cohorts of at most `width` models per
    configuration (a configuration with fewer repeats its first; none: client 0); None where one configuration's
    stale clients are all C (then every model is scored, in place)."""
    rows = [[c for c, s in enumerate(row) if s] or [0] for row in stale]
    S, C = max(map(len, rows)), len(stale[0])
    if S == C:
        return None
    rows = [row + row[:1] * (S - len(row)) for row in rows]  # [H][S]: a repeat scores a client twice, the same
    return [Cohort(stale, min(width, S - i), device, [row[i : i + width] for row in rows]) for i in range(0, S, width)]


def evaluate(algo, state, data: ClientData, rnd) -> torch.Tensor:
    """Per-model accuracy on each client's own data: [H, C]."""
    return accuracy_loss(scores(algo, state, data, rnd), data)[0]


def evaluate_global(
    algo, state, data: ClientData, rnd, client_hits: torch.Tensor | None = None, first: bool = False
) -> torch.Tensor | None:
    """The server's global model's accuracy on the union of all clients' rows of `data`: [H] (one correct count
    over every row of every client / all rows), or None when the algorithm has no global model. `client_hits`
    [H, C, N], the clients' own hits on `data`, is that count already where every client holds the global model
    (`algo.clients_hold_global`): then nothing is evaluated twice. `first` as for `scores`."""
    model = algo.global_model(state, rnd)
    if model is None:
        return None
    if client_hits is None or not algo.clients_hold_global:
        client_hits = hits(scores(algo, state, data, rnd, model, first), data)  # [H, C, N]
    return client_hits.sum((1, 2)) / data.counts.sum().clamp(min=1)


def record(
    algo,
    state,
    train: ClientData,
    test: ClientData,
    rnd,
    round_loss: torch.Tensor,
    logs: bool = True,
    first: bool = False,
    last: dict | None = None,
    stale: list | None = None,
    width: int = 1,
) -> dict:
    """What an evaluation round records, on the host: test_acc, test_loss, train_acc, train_loss [H, C] and
    global_acc [H] (None without a global model); only test_acc without `logs`. `first`: the run's first evaluation,
    where the scores' values are checked too. `last`: the previous evaluation's record, and `stale` [H][C] host
    bools the clients whose models may have changed since: the others keep their figures from `last` (where
    `algo.personal_predict`), the stale ones are scored in cohorts of at most `width` models."""
    if last is not None and stale is not None:
        cohorts = stale_cohorts(stale, width, test.features.device)
        if cohorts is not None:
            return _rescore(algo, state, train, test, rnd, round_loss, logs, last, cohorts)
    test_scores = scores(algo, state, test, rnd, first=first)  # [H, C, N, K]
    test_hits = hits(test_scores, test)  # [H, C, N]
    test_acc, test_loss = accuracy_loss(test_scores, test, test_hits)  # [H, C] each
    both = torch.stack([test_acc, test_loss.isnan().to(test_acc.dtype)]).cpu()  # [2, H, C]: one read
    if bool(both[1].any()):  # NaN scores on some row: the model diverged (`Engine.evaluate` names the cause)
        bad = both[1].any(1).nonzero().flatten().tolist()
        raise Diverged(f"{algo.name}: the scores became NaN/Inf in round {rnd.round + 1}", bad)
    test_acc = both[0].clone()  # its own storage, as a record has always held it (a checkpoint keeps layouts)
    if not logs:
        return {"test_acc": test_acc}
    train_acc, _ = accuracy_loss(scores(algo, state, train, rnd), train)  # [H, C]
    glob = evaluate_global(algo, state, test, rnd, test_hits, first)  # [H] or None
    return {
        "test_acc": test_acc,
        "test_loss": test_loss.cpu(),
        "train_acc": train_acc.cpu(),
        "train_loss": round_loss,
        "global_acc": None if glob is None else glob.cpu(),
    }


def _rescore(
    algo,
    state,
    train: ClientData,
    test: ClientData,
    rnd,
    round_loss: torch.Tensor,
    logs: bool,
    last: dict,
    cohorts: list[Cohort],
) -> dict:
    """`record` with only the `cohorts`' models scored again, the other clients' figures kept from `last`."""
    keys = ("test_acc", "test_loss", "train_acc") if logs else ("test_acc",)
    out = {k: last[k].clone() for k in keys}  # [H, C] on the host
    ctx = algo.context(state, rnd)
    for cohort in cohorts:
        at = (torch.arange(len(cohort.host))[:, None], torch.tensor(cohort.host))  # [H, 1], [H, P] host indices
        models = tuple(cohort.take_tree(t) for t in (state.params, state.buffers, ctx))  # gathered once, both splits
        figures = dict(
            zip(
                ("test_acc", "test_loss"),
                accuracy_loss(cohort_scores(algo, models, test, cohort), Rows.of(test, cohort)),
            )
        )  # [H, P] each
        if logs:
            figures["train_acc"] = accuracy_loss(cohort_scores(algo, models, train, cohort), Rows.of(train, cohort))[
                0
            ]  # [H, P]
        for k in keys:
            out[k][at] = figures[k].cpu()
    if not logs:
        return out
    glob = evaluate_global(algo, state, test, rnd)  # [H] or None
    return out | {"train_loss": round_loss, "global_acc": None if glob is None else glob.cpu()}


def live_metrics(seeds: torch.Tensor, test_acc: torch.Tensor, round_loss: torch.Tensor) -> dict:
    """What an evaluation round tells a watcher, per configuration (host floats): the seed, the client-mean test
    accuracy in % and the mean local training loss over the clients that took part (test_acc, round_loss [H, C])."""
    return {
        "seeds": seeds.tolist(),
        "test_acc": (100 * test_acc.double().mean(1)).tolist(),
        "train_loss": round_loss.double().nanmean(1).tolist(),
    }


def hits(scores: torch.Tensor, data: ClientData | Rows) -> torch.Tensor:
    """[H, C, N] bool: the valid rows whose top score is their label (scores [H, C, N, K])."""
    return (scores.argmax(-1) == data.labels) & data.mask


def accuracy_loss(
    scores: torch.Tensor, data: ClientData | Rows, hit: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accuracy and mean cross-entropy of the scores over each client's valid rows: ([H, C], [H, C]); `hit` [H, C, N]
    the scores' `hits` when already known. A score of -inf for a row's label (a class the model rules out) gives
    that row an infinite loss."""
    n = data.counts.clamp(min=1)  # [C]
    labels = data.labels.clamp(min=0).expand(*scores.shape[:-1])  # [H, C, N]
    ce = scores.logsumexp(-1) - scores.gather(-1, labels[..., None]).squeeze(-1)  # [H, C, N]
    loss = torch.where(data.mask, ce, 0.0).sum(-1) / n  # [H, C]
    return (hits(scores, data) if hit is None else hit).sum(-1) / n, loss
