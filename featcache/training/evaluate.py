"""Evaluation of a run's models: per model, accuracy and loss on its client's own rows; per configuration, the
accuracy of the server's global model (the algorithm's `global_model` hook, None where the server holds none) on
the union of all clients' rows. `rnd` is the `Round` after which the models are evaluated (their context)."""

from __future__ import annotations

import torch

from ..cache import ClientData
from .guards import check_scores
from .models import expand_hc, map_models


@torch.no_grad()
def scores(algo, state, data: ClientData, rnd, model=None, first: bool = False) -> torch.Tensor:
    """Every model's scores on its client's rows of `data`: [H, C, N, K]. `model` = (params, buffers) name -> [H, ...]
    scores the server's global model instead, broadcast to every client, with the algorithm's `predict_global`.
    Their shape is checked every time, their values at the `first` evaluation (`guards.check_scores`)."""
    ctx = algo.context(state, rnd) | {"rows": data.mask.expand(rnd.H, *data.mask.shape)}  # rows [H, C, N] bool
    if model is None:
        params, buffers, fn = state.params, state.buffers, algo.predict
    else:
        params, buffers = ({k: expand_hc(v, rnd.C) for k, v in d.items()} for d in model)  # [H, C, ...]
        fn = algo.predict_global
    predict = lambda p, b, c, x: fn(p, b, x, c)
    out = map_models(predict, (params, buffers, ctx), (data.features,))  # [H, C, N, K]
    check_scores(algo, getattr(fn, "__name__", "predict"), out, data, first)
    return out


def evaluate(algo, state, data: ClientData, rnd) -> torch.Tensor:
    """Per-model accuracy on each client's own data: [H, C]."""
    return accuracy_loss(scores(algo, state, data, rnd), data)[0]


def evaluate_global(algo, state, data: ClientData, rnd, client_hits: torch.Tensor | None = None,
                    first: bool = False) -> torch.Tensor | None:
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


def record(algo, state, train: ClientData, test: ClientData, rnd, round_loss: torch.Tensor, logs: bool = True,
           first: bool = False) -> dict:
    """What an evaluation round records, on the host: test_acc, test_loss, train_acc, train_loss [H, C] and
    global_acc [H] (None without a global model); only test_acc without `logs`. `first`: the run's first evaluation,
    where the scores' values are checked too."""
    test_scores = scores(algo, state, test, rnd, first=first)  # [H, C, N, K]
    test_hits = hits(test_scores, test)  # [H, C, N]
    test_acc, test_loss = accuracy_loss(test_scores, test, test_hits)  # [H, C] each
    if not logs:
        return {"test_acc": test_acc.cpu()}
    train_acc, _ = accuracy_loss(scores(algo, state, train, rnd), train)  # [H, C]
    glob = evaluate_global(algo, state, test, rnd, test_hits, first)  # [H] or None
    return {"test_acc": test_acc.cpu(), "test_loss": test_loss.cpu(), "train_acc": train_acc.cpu(),
            "train_loss": round_loss, "global_acc": None if glob is None else glob.cpu()}


def hits(scores: torch.Tensor, data: ClientData) -> torch.Tensor:
    """[H, C, N] bool: the valid rows whose top score is their label (scores [H, C, N, K])."""
    return (scores.argmax(-1) == data.labels) & data.mask


def accuracy_loss(scores: torch.Tensor, data: ClientData, hit: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accuracy and mean cross-entropy of the scores over each client's valid rows: ([H, C], [H, C]); `hit` [H, C, N]
    the scores' `hits` when already known. A score of -inf for a row's label (a class the model rules out) gives
    that row an infinite loss."""
    n = data.counts.clamp(min=1)  # [C]
    labels = data.labels.clamp(min=0).expand(*scores.shape[:-1])  # [H, C, N]
    ce = scores.logsumexp(-1) - scores.gather(-1, labels[..., None]).squeeze(-1)  # [H, C, N]
    loss = torch.where(data.mask, ce, 0.0).sum(-1) / n  # [H, C]
    return (hits(scores, data) if hit is None else hit).sum(-1) / n, loss
