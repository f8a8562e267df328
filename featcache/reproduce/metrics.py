"""What a pipeline column can show: one table, metric name -> how it reads its value from a run and what it needs
from the run beyond `featcache.train`'s result.

A metric is written `kind` or `kind:arg` in a [columns] entry. A *run* (what `run.run_job` returns) is train()'s
result restricted to the keys the metrics read (`RESULT_KEYS`), plus `client_domains` (from the cache) and the
outputs the job's metrics need: a `Need` names one output and computes it, from the trained state (`state=True`:
only right after training, `train(..., keep_state=True)`) or from the job and its cache alone. Adding a metric is one
entry in `METRICS`.

Values: (mean, std) over seeds (std: sample std, ddof=1), an int count, or None ("n/a": no counterpart in this data,
or no server model).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
import torch

from ..algorithms import create
from ..extraction.backbones import create_backbone
from ..runs.metrics import mean_std
from ..results.tables import fmt
from .analyses import backbone_similarity, probe_match

Value = tuple[float, float] | int | None  # mean(std), a count, or None (no counterpart in this data)


@dataclass(frozen=True)
class Need:
    """One output of a run that train()'s result does not hold: `compute(trained, job, info, result)` -> JSON value
    (`trained`: a train.Trained, or None when `state` is False; `info`: the extraction, run._extract)."""

    name: str  # the job's need and the run's key
    compute: Callable
    state: bool = False  # read off the trained state: computed only right after training
    always: bool = False  # cheap: computed for every job (a column that adds it never retrains)


def _show(value: Value) -> str:
    if value is None:
        return "n/a"
    return f"{value:,}" if isinstance(value, int) else fmt(*value)


@dataclass(frozen=True)
class Metric:
    text: str  # what our column shows (the "Our columns" line), followed by the metric's arg
    read: Callable[[dict, str, int | None], Value]  # (run, arg, picked backbone position) -> value
    reads: tuple[str, ...] = ()  # the keys of train()'s result it reads
    need: Need | None = None
    per_domain: bool = False  # arg = 'a|b|c': clients of the first of these domains the data has
    picks_backbone: bool = False  # one backbone's share (the row's backbones = [k]) of an all-backbone run
    show: Callable[[Value], str] = _show
    args: tuple[str, ...] | None = ()  # the allowed ARG of `metric:ARG`: () none, None any (required), else these
    result: bool = True  # a trained outcome; False: fixed by the architecture (no ranking of methods to compare)


# -- what the needs compute ---------------------------------------------------------------------------------------
def _probe(trained, job, info, result) -> dict:
    """FedPFT Table 1 (Wu et al., FedPFT, App. A): origin / probe / match accuracy per seed, client mean, in %."""
    accs = probe_match(trained.algo, trained.state, trained.train, trained.test)  # kind -> [S, C]
    return {k: (100 * v.mean(1)).tolist() for k, v in accs.items()}


def _similarity(trained, job, info, result) -> list:
    """FedPCL Figure 3 (Tan et al., NeurIPS 2022): per seed, client and backbone, [S, C, B]."""
    return backbone_similarity(trained.algo, trained.state, trained.train, info["dims"]).tolist()


def _trainable(trained, job, info, result) -> int:
    """Parameters one client trains (the head on top of the frozen backbones)."""
    d_in = sum(info["dims"][i] for i in job.chosen(len(info["dims"])))
    params, _ = create(job.algo, result["config"]).init(
        result["config"], d_in, info["classes"], torch.Generator().manual_seed(0)
    )
    return int(sum(p.numel() for p in params.values()))


def _fixed(trained, job, info, result) -> int:
    """Frozen backbone parameters of the backbones the job trains on."""
    spec = job.extract_kwargs
    return sum(_backbone_params(spec["backbone"][i], spec.get("image_size")) for i in job.chosen(len(info["dims"])))


@lru_cache(maxsize=None)
def _backbone_params(spec: str, image_size: int | None) -> int:
    return int(sum(p.numel() for p in create_backbone(spec, image_size=image_size).model.parameters()))


# -- how metrics read a run ---------------------------------------------------------------------------------------
def domain_clients(run: dict, names: str) -> tuple[str | None, list[int]]:
    """The first domain of 'a|b|c' that the run's clients hold, and those clients."""
    for name in names.split("|"):
        clients = [i for i, d in enumerate(run["client_domains"]) if d == name]
        if clients:
            return name, clients
    return None, []


def _domain(run: dict, names: str, pick: int | None) -> Value:
    _, clients = domain_clients(run, names)
    if not clients:
        return None
    return mean_std(np.asarray(run["per_client_per_seed"])[:, clients].mean(1))  # [S, C] -> [S]


def _protosim(run: dict, names: str, pick: int | None) -> Value:
    """Per seed: the `pick`-th backbone's prototype similarity, mean over the domain's clients."""
    _, clients = domain_clients(run, names)
    if not clients:
        return None
    return mean_std(np.asarray(run["similarity"])[:, clients, pick].mean(1))  # [S, C, B] -> [S]


def _global(run: dict, arg: str, pick: int | None) -> Value:
    """The server's aggregated model on the union of the clients' test splits; None without a server model."""
    mean, std = run.get("global_mean_acc"), run.get("global_std_acc")
    return None if mean is None or std is None else (mean, std)


METRICS = {
    "acc": Metric(
        "final-round accuracy", lambda r, arg, pick: (r["mean_acc"], r["std_acc"]), reads=("mean_acc", "std_acc")
    ),
    "best": Metric(
        "best-round accuracy",
        lambda r, arg, pick: (r["best_round_mean_acc"], r["best_round_std_acc"]),
        reads=("best_round_mean_acc", "best_round_std_acc"),
    ),
    "global": Metric("global model on all clients' test data", _global, reads=("global_mean_acc", "global_std_acc")),
    "params": Metric(
        "floats uploaded per round",
        lambda r, arg, pick: int(r["params_uploaded_per_round"]),
        reads=("params_uploaded_per_round",),
        result=False,
    ),
    "trainable": Metric(
        "trainable head parameters",
        lambda r, arg, pick: int(r["trainable_params"]),
        need=Need("trainable_params", _trainable, always=True),
        result=False,
    ),
    "fixed": Metric(
        "frozen backbone parameters",
        lambda r, arg, pick: int(r["fixed"]),
        need=Need("fixed", _fixed),
        show=lambda v: f"{v / 1e6:.1f}M",
        result=False,
    ),
    "domain": Metric("domain", _domain, reads=("per_client_per_seed",), per_domain=True, args=None),
    "fair": Metric(
        "fairness",
        lambda r, arg, pick: tuple(r["fairness"][arg]),
        reads=("fairness",),
        args=("average", "worst_10", "worst_20", "worst_40", "best_10", "variance", "std"),
    ),
    "probe": Metric(
        "probe_match",
        lambda r, arg, pick: mean_std(r["probe"][arg]),
        need=Need("probe", _probe, True),
        args=("origin", "probe", "match"),
    ),
    "protosim": Metric(
        "prototype similarity",
        _protosim,
        need=Need("similarity", _similarity, True),
        per_domain=True,
        picks_backbone=True,
        args=None,
    ),
}
NEEDS = {m.need.name: m.need for m in METRICS.values() if m.need}  # need name -> Need
RESULT_KEYS = ("algo", "config", "seeds", *dict.fromkeys(k for m in METRICS.values() for k in m.reads))


def metric_problem(metric: str) -> str | None:
    """What is wrong with a pipeline's `metric` (`kind` or `kind:ARG`), or None."""
    kind, colon, arg = metric.partition(":")
    if kind not in METRICS:
        return f"unknown metric {metric!r}; known: {', '.join(METRICS)}"
    allowed = METRICS[kind].args
    if allowed == () and colon:
        return f"metric {kind} takes no argument (got {metric!r})"
    if allowed is None and not arg:
        return f"metric {kind} needs an argument: {kind}:NAME"
    if allowed and arg not in allowed:
        return f"metric {metric!r}: the argument must be one of {', '.join(allowed)}"
    return None


def metric_value(run: dict, metric: str, pick: int | None = None) -> Value:
    """`pick`: the backbone a picks_backbone metric reads (its row's first backbone position)."""
    kind, _, arg = metric.partition(":")
    return METRICS[kind].read(run, arg, pick)


def fmt_value(value: Value, metric: str) -> str:
    return "n/a" if value is None else METRICS[metric.partition(":")[0]].show(value)
