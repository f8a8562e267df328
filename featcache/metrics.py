"""Accuracy summaries the papers report: unweighted mean over clients, mean(std) over seeds (FedPCL convention; std is
the sample std, ddof=1, and 0 with one seed),
fairness across clients (fedpcl.md Tables 12–13), and communication per client per round."""

from __future__ import annotations

import numpy as np


def mean_std(values) -> tuple[float, float]:
    """Mean and sample std (ddof=1, as pandas and most papers) over seeds, in the caller's units. With one seed the
    std is undefined; it is reported as 0 (tables then say "1 seed")."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def fairness(acc: np.ndarray) -> dict:
    """Per-client accuracies [C] (in %) -> average, worst 10/20/40 %, best 10 %, variance (Tables 12–13).

    "Worst q %" is the mean accuracy of the ceil(q·C) lowest clients. `variance` and `std` are over all clients
    (population, ddof=0: the clients are the whole population, not a sample) in %²; the paper's
    "Variance" column (11.16 beside worst-10 % 16.73 and best-10 % 54.60) can only be a standard deviation in %, so
    `std` is reported too and is the number to compare with Tables 12–13."""
    a = np.sort(np.asarray(acc, dtype=np.float64))
    take = lambda q: max(1, int(np.ceil(q * len(a))))
    return {
        "average": float(a.mean()),
        "worst_10": float(a[: take(0.1)].mean()),
        "worst_20": float(a[: take(0.2)].mean()),
        "worst_40": float(a[: take(0.4)].mean()),
        "best_10": float(a[-take(0.1) :].mean()),
        "variance": float(a.var()),
        "std": float(a.std()),
    }


def summarize(acc: np.ndarray, eval_rounds: list[int]) -> dict:
    """acc [R_eval, S, C] in [0, 1] -> the result numbers, all in %, named plainly.

    final: accuracy after the last round. best_round: for each seed, the evaluation round with the highest
    client-mean accuracy (an optimistic number some papers report; shown beside final, never instead of it)."""
    pct = 100 * np.asarray(acc, dtype=np.float64)  # [R, S, C]
    final = pct[-1]  # [S, C]
    per_seed = final.mean(1)  # [S]
    curve = pct.mean(2)  # [R, S]
    best_idx = curve.argmax(0)  # [S]
    best = curve[best_idx, np.arange(curve.shape[1])]
    fair = [fairness(f) for f in final]
    mean, std = mean_std(per_seed)
    best_mean, best_std = mean_std(best)
    return {
        "mean_acc": round(mean, 4),
        "std_acc": round(std, 4),
        "per_seed": [round(float(v), 4) for v in per_seed],
        "per_client": [round(float(v), 4) for v in final.mean(0)],
        "per_client_per_seed": [[round(float(v), 4) for v in row] for row in final],
        "best_round_mean_acc": round(best_mean, 4),
        "best_round_std_acc": round(best_std, 4),
        "best_round": [int(eval_rounds[i]) for i in best_idx],
        "fairness": {k: [round(x, 4) for x in mean_std([f[k] for f in fair])] for k in fair[0]},
        "curve": {"rounds": list(eval_rounds), "mean_acc": [round(float(v), 4) for v in curve.mean(1)]},
    }
