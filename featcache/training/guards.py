"""Checks of what a run reads and what an algorithm's hooks return, each failure one UserError line that names the
cause: features of absurd size, clients without rows to score on, a hook's output of the wrong shape or not finite
(checked once, at the first step and the first evaluation: built-in hooks pass, a plug-in's may not), and the likely
cause of a loss that became NaN."""

from __future__ import annotations

import torch

from ..errors import UserError

# |feature| above this is no backbone's output (pooled activations stay in the tens): a damaged or foreign cache,
# and float32 products of such values overflow to inf within a step.
MAX_FEATURE = 1e6
# A float setting (other than lr) this much above its default, and above this size, is named as a NaN's likely cause.
HUGE_RATIO, HUGE_VALUE = 100.0, 100.0
# How to fix a client without rows to score on, by the split it lacks.
NO_TEST_ROWS = "re-extract with more images per client (fewer clients, a milder partition)"
NO_VAL_ROWS = "re-extract with a larger --val-fraction (the grid selects on each client's validation rows)"


def check_features(data, cache) -> None:
    """Refuse features that are not finite or reach |x| > MAX_FEATURE (one pass over the loaded tensor)."""
    for name, t in (("features", data.features), ("views", data.views)):
        if t is None or t.numel() == 0:
            continue
        low, high = torch.aminmax(t)  # no |t| copy of a large tensor
        top = max(-float(low), float(high)) if not bool(torch.isnan(high) | torch.isnan(low)) else float("nan")
        if top != top or top > MAX_FEATURE:  # NaN fails every comparison but this one
            size = "non-finite values" if top != top or top == float("inf") else f"values of magnitude {top:.3g}"
            raise UserError(
                f"cache {cache} holds {name} with {size} (a backbone's features stay far below "
                f"{MAX_FEATURE:g}): the cache is damaged or not from `featcache extract`; re-extract it"
            )


def check_rows(counts, split: str, cache, fix: str) -> None:
    """Refuse a split in which some client has no rows (its accuracy would be a meaningless 0.0 %)."""
    empty = [c for c, n in enumerate(counts) if int(n) == 0]
    if empty:
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise UserError(
            f"client {empty[0]:03d}{more} of cache {cache} has no {split} rows, so it cannot be scored: {fix}"
        )


def check_split(data, split: str, cache, fix: str) -> None:
    """A loaded split that models are scored on: features of sane size (`check_features`), rows in every client."""
    check_features(data, cache)
    check_rows(data.counts.tolist(), split, cache, fix)


def check_loss(algo, loss: torch.Tensor, models: torch.Size) -> None:
    """local_loss must give one scalar per model: the vmapped losses are `models` ([H, C]), nothing more."""
    if loss.shape != models:
        raise UserError(
            f"{algo.name}: local_loss returned a loss of shape {list(loss.shape[len(models) :])} per "
            "model, not a scalar: return the minibatch's mean loss (a 0-d tensor) and the new buffers"
        )


def check_scores(algo, hook: str, scores: torch.Tensor, data, first: bool) -> None:
    """scores [H, C, N, K'] of `hook` (predict, predict_global) must have K' = the cache's classes; on the `first`
    evaluation also a finite score on every valid row (NaN or all -inf makes argmax meaningless)."""
    K = data.num_classes
    if scores.dim() != 4 or scores.shape[-1] != K:
        got = list(scores.shape[3:]) if scores.dim() >= 3 else list(scores.shape)
        raise UserError(
            f"{algo.name}: {hook} returned scores of shape [N, {', '.join(map(str, got))}] per model, "
            f"not [N, {K}]: one score per class of the cache ({K} classes)"
        )
    if not first:
        return
    rows = data.mask.expand(*scores.shape[:-1])  # [H, C, N]
    nan = torch.isnan(scores).any(-1) & rows  # [H, C, N]
    blank = (scores == float("-inf")).all(-1) & rows  # [H, C, N]
    found = torch.stack([nan.any(), blank.any()]).tolist()  # one read
    if found[0] or found[1]:
        what = "NaN scores" if found[0] else "-inf for every class of a row"
        message = f"{algo.name}: {hook} returned {what} at the first evaluation: return finite scores [N, {K}] (logits)"
        if found[0]:  # a plug-in's bug, or models that diverged (the engine tells which: `Engine.evaluate`)
            raise Diverged(message, nan.flatten(1).any(1).nonzero().flatten().tolist())
        raise UserError(message)


class Diverged(UserError):
    """A loss that became NaN/Inf, with the models (indices on H) it did so for: a search fails their trials alone."""

    def __init__(self, message: str, models: list[int]):
        super().__init__(message)
        self.models = models

    def __reduce__(self):  # pickled whole (a Ray worker's error)
        return Diverged, (str(self), self.models)


def nan_cause(algo, cfgs: list[dict], bad_models: list[int], rnd: int, what: str = "loss") -> str:
    """The one line for a `what` (the loss, the scores) that became NaN/Inf in round `rnd` (0-based) for the
    configurations `bad_models`: a float setting far above its default is named as the likely cause, else the
    learning rate."""
    from .config import defaults

    base = defaults(algo)
    worst = None
    for h in bad_models:
        for k, v in cfgs[h].items():
            d = base.get(k)
            if k in ("lr", "seed") or not isinstance(v, float) or not isinstance(d, float):
                continue
            ratio = abs(v) / max(abs(d), 1e-12)
            if abs(v) > HUGE_VALUE and ratio > HUGE_RATIO and (worst is None or ratio > worst[0]):
                worst = (ratio, k, v, d)
    head = f"{algo.name}: {what} became NaN/Inf in round {rnd + 1}"
    if worst:
        _, k, v, d = worst
        return f"{head}: {k}={v:g} (default {d:g}) is the likely cause: lower --set {k}=..."
    return f"{head}: lower --set lr=... or check the cache with `featcache info`"
