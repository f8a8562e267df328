"""Evaluation of a run's models: per model, accuracy and loss on its client's own rows; per configuration, the
accuracy of the server's global model (the algorithm's `global_model` hook, None where the server holds none) on
the union of all clients' rows. `rnd` is the `Round` after which the models are evaluated (their context)."""

from __future__ import annotations

import torch

from ..cache import ClientData
from .models import expand_hc, map_models


@torch.no_grad()
def scores(algo, state, data: ClientData, rnd, model=None) -> torch.Tensor:
    """Every model's scores on its client's rows of `data`: [H, C, N, K]. `model` = (params, buffers) name -> [H, ...]
    scores the server's global model instead, broadcast to every client, with the algorithm's `predict_global`."""
    ctx = algo.context(state, rnd) | {"rows": data.mask.expand(rnd.H, *data.mask.shape)}  # rows [H, C, N] bool
    if model is None:
        params, buffers, fn = state.params, state.buffers, algo.predict
    else:
        params, buffers = ({k: expand_hc(v, rnd.C) for k, v in d.items()} for d in model)  # [H, C, ...]
        fn = algo.predict_global
    predict = lambda p, b, c, x: fn(p, b, x, c)
    return map_models(predict, (params, buffers, ctx), (data.features,))  # [H, C, N, K]


def evaluate(algo, state, data: ClientData, rnd) -> torch.Tensor:
    """Per-model accuracy on each client's own data: [H, C]."""
    return accuracy_loss(scores(algo, state, data, rnd), data)[0]


def evaluate_global(algo, state, data: ClientData, rnd) -> torch.Tensor | None:
    """The server's global model's accuracy on the union of all clients' rows of `data`: [H] (one correct count
    over every row of every client / all rows), or None when the algorithm has no global model."""
    model = algo.global_model(state, rnd)
    if model is None:
        return None
    hit = hits(scores(algo, state, data, rnd, model), data)  # [H, C, N]
    return hit.sum((1, 2)) / data.counts.sum().clamp(min=1)


def record(algo, state, train: ClientData, test: ClientData, rnd, round_loss: torch.Tensor, logs: bool = True) -> dict:
    """What an evaluation round records, on the host: test_acc, test_loss, train_acc, train_loss [H, C] and
    global_acc [H] (None without a global model); only test_acc without `logs`."""
    test_acc, test_loss = accuracy_loss(scores(algo, state, test, rnd), test)  # [H, C] each
    if not logs:
        return {"test_acc": test_acc.cpu()}
    train_acc, _ = accuracy_loss(scores(algo, state, train, rnd), train)  # [H, C]
    glob = evaluate_global(algo, state, test, rnd)  # [H] or None
    return {"test_acc": test_acc.cpu(), "test_loss": test_loss.cpu(), "train_acc": train_acc.cpu(),
            "train_loss": round_loss, "global_acc": None if glob is None else glob.cpu()}


def hits(scores: torch.Tensor, data: ClientData) -> torch.Tensor:
    """[H, C, N] bool: the valid rows whose top score is their label (scores [H, C, N, K])."""
    return (scores.argmax(-1) == data.labels) & data.mask


def accuracy_loss(scores: torch.Tensor, data: ClientData) -> tuple[torch.Tensor, torch.Tensor]:
    """Accuracy and mean cross-entropy of the scores over each client's valid rows: ([H, C], [H, C]). A score of
    -inf for a row's label (a class the model rules out) gives that row an infinite loss."""
    n = data.counts.clamp(min=1)  # [C]
    labels = data.labels.clamp(min=0).expand(*scores.shape[:-1])  # [H, C, N]
    ce = scores.logsumexp(-1) - scores.gather(-1, labels[..., None]).squeeze(-1)  # [H, C, N]
    loss = torch.where(data.mask, ce, 0.0).sum(-1) / n  # [H, C]
    return hits(scores, data).sum(-1) / n, loss
