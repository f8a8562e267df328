"""What a training run reports and logs.

Summaries (the result JSON): the accuracy papers report, the unweighted mean over clients as mean(std) over seeds
(the convention of Tan et al., "Federated Learning from Pre-Trained Models: A Contrastive Learning Approach", NeurIPS
2022; std is the sample std, ddof=1, and 0 with one seed); fairness across clients (its Tables 12–13); the global
model's accuracy on the union of all clients' test splits; the per-round curves.

Logs (beside the result): `metrics_csv` renders every evaluation round as long-format rows
`round,seed,client,split,loss,accuracy,global_accuracy`; `write_tensorboard` logs the per-seed curves as TensorBoard
scalars. Accuracies are in %, everywhere.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np

from ..errors import UserError

CSV_COLUMNS = ("round", "seed", "client", "split", "loss", "accuracy", "global_accuracy")
TENSORBOARD_MISSING = "--tensorboard needs TensorBoard: pip install 'featcache[tensorboard]'"


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


def _r4(values) -> list[float]:
    return [round(float(v), 4) for v in values]


def summarize(
    acc: np.ndarray, eval_rounds: list[int], global_acc: np.ndarray | None = None, train_loss: np.ndarray | None = None
) -> dict:
    """acc [R_eval, S, C] in [0, 1] -> the result numbers, all in %, named plainly.

    final: accuracy after the last round. best_round: for each seed, the evaluation round with the highest
    client-mean accuracy (an optimistic number some papers report; shown beside final, never instead of it).
    global_acc [R_eval, S] in [0, 1] (None: the algorithm has no global model, and its keys are null): the server's
    model on the union of all test rows. train_loss [R_eval, S, C] (NaN for clients that sat a round out): the mean
    local training loss, averaged over the participating clients and then over seeds per round."""
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
        "per_seed": _r4(per_seed),
        "per_client": _r4(final.mean(0)),
        "per_client_per_seed": [_r4(row) for row in final],
        "best_round_mean_acc": round(best_mean, 4),
        "best_round_std_acc": round(best_std, 4),
        "best_round": [int(eval_rounds[i]) for i in best_idx],
        "fairness": {k: [round(x, 4) for x in mean_std([f[k] for f in fair])] for k in fair[0]},
        "curve": {
            "rounds": list(eval_rounds),
            "mean_acc": _r4(curve.mean(1)),
            "global_acc": None if global_acc is None else _r4(100 * np.asarray(global_acc).mean(1)),
            "train_loss": None if train_loss is None else _r4(np.nanmean(train_loss, 2).mean(1)),
        },
    } | summarize_global(global_acc)


def summarize_global(global_acc: np.ndarray | None) -> dict:
    """global_acc [R_eval, S] in [0, 1] -> global_mean_acc, global_std_acc (over seeds, after the last round) and
    global_per_seed, in %; all three None when the algorithm has no global model."""
    if global_acc is None:
        return {"global_mean_acc": None, "global_std_acc": None, "global_per_seed": None}
    final = 100 * np.asarray(global_acc, dtype=np.float64)[-1]  # [S]
    mean, std = mean_std(final)
    return {"global_mean_acc": round(mean, 4), "global_std_acc": round(std, 4), "global_per_seed": _r4(final)}


# -- logs -------------------------------------------------------------------------------------------------------
def _number(v: float, digits: int) -> str:
    """A CSV cell: empty for NaN (a value that does not exist), else the number rounded (inf stays inf)."""
    return "" if np.isnan(v) else repr(round(float(v), digits))


def metrics_csv(raw: dict, seeds: list[int]) -> str:
    """Every evaluation round of an engine run (`Engine.run`'s output, H = seeds) as CSV text: one `train` and one
    `test` row per (round, seed, client). train: the client's mean local training loss of that round (empty when it
    sat the round out) and its accuracy on its own training rows; test: the cross-entropy of `predict`'s scores and
    the accuracy on its own test rows. global_accuracy: the global model's accuracy on all test rows (the same on
    every row of a round and seed; empty without a global model). Same run, same text."""
    arrays = {k: raw[k].double().numpy() for k in ("train_loss", "train_acc", "test_loss", "test_acc")}
    glob = raw["global_acc"]
    glob = None if glob is None else 100 * glob.double().numpy()  # [R, S]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    R, S, C = arrays["test_acc"].shape
    for r in range(R):
        for s in range(S):
            g = "" if glob is None else _number(glob[r, s], 4)
            for c in range(C):
                for split in ("train", "test"):
                    loss, acc = arrays[f"{split}_loss"][r, s, c], 100 * arrays[f"{split}_acc"][r, s, c]
                    writer.writerow([raw["eval_rounds"][r], seeds[s], c, split, _number(loss, 6), _number(acc, 4), g])
    return out.getvalue()


def tensorboard_writer():
    """torch's SummaryWriter class, or one UserError line when TensorBoard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional: only --tensorboard needs it
    except ImportError:
        raise UserError(TENSORBOARD_MISSING) from None
    return SummaryWriter


def write_tensorboard(folder: str | Path, raw: dict, seeds: list[int]) -> None:
    """Per seed, a TensorBoard run `folder/seed-<seed>` with the scalars test/accuracy (client mean, %), train/loss
    (mean over the participating clients) and global/accuracy (%, when the algorithm has one), stepped by round."""
    writer_cls = tensorboard_writer()
    test = 100 * raw["test_acc"].double().mean(-1).numpy()  # [R, S]
    loss = np.nanmean(raw["train_loss"].double().numpy(), -1)  # [R, S]
    glob = None if raw["global_acc"] is None else 100 * raw["global_acc"].double().numpy()  # [R, S]
    for s, seed in enumerate(seeds):
        writer = writer_cls(log_dir=str(Path(folder) / f"seed-{seed}"))
        try:
            for r, step in enumerate(raw["eval_rounds"]):
                writer.add_scalar("test/accuracy", test[r, s], step)
                writer.add_scalar("train/loss", loss[r, s], step)
                if glob is not None:
                    writer.add_scalar("global/accuracy", glob[r, s], step)
        finally:
            writer.close()
