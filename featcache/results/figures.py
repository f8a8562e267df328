"""The PNG figures: report's accuracy curves and per-client bars, plot's learned features per client.

matplotlib is imported inside the functions that draw (`pyplot`): it takes about half a second to import, which
`featcache report` without --out and every other command do not pay. Each PNG carries the command that wrote it in
its Software text, so that command may replace it and never replaces anyone else's file.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..atomic import write_atomic
from .tables import Series, labels, per_client, series, title

if TYPE_CHECKING:
    from .features import Features
    from .load import Run

REPORT_MARK = "featcache report"  # in report.md's first line and its PNGs' Software text: files report may replace
PLOT_MARK = "featcache plot"  # the plot PNG's Software text: marks a file plot may overwrite


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig, mark: str, dpi: int = 120) -> bytes:
    """The PNG bytes of `fig` (then closed), its Software text `mark`: which command wrote it, and may replace it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": mark})
    pyplot().close(fig)
    return buf.getvalue()


def png_mark(path: Path) -> str | None:
    """The Software text of the PNG at `path` (see `png`); None for a file that is not a PNG PIL can read."""
    try:
        from PIL import Image

        with Image.open(path) as im:
            return getattr(im, "text", {}).get("Software")
    except Exception:  # unreadable, or not an image PIL can open: someone else's file
        return None


def _finish(fig, path: Path | None) -> bytes:
    """Lay out `fig`, return its PNG bytes, and write them to `path` (atomically) when one is given."""
    fig.tight_layout()
    data = png(fig, REPORT_MARK)
    if path is not None:
        write_atomic(path, data)
    return data


def _draw(ax, s: Series, colour, label: str, style: str = "-") -> bool:
    """One curve, with its ±1 std band when known; whether a band was drawn."""
    ax.plot(s.rounds, s.mean, style, color=colour, label=label, marker="o" if len(s.rounds) == 1 else None)
    if s.std is not None:
        ax.fill_between(s.rounds, s.mean - s.std, s.mean + s.std, color=colour, alpha=0.2, linewidth=0)
    return s.std is not None


def curves_png(runs: list[Run], path: str | Path | None = None) -> bytes:
    """Test accuracy per evaluation round (solid: mean over clients; dashed: the global model, where the results have
    one), and the mean local training loss beside it where the results record it; shaded ±1 std over seeds where the
    metrics.csv sidecar holds the per-seed values. PNG bytes, also written atomically to `path` when given."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    results = [run.result for run in runs]
    curves = [series(run) for run in runs]
    with_loss = any("loss" in c for c in curves)
    fig, axes = plt.subplots(1, 2 if with_loss else 1, figsize=(11 if with_loss else 6.5, 4.4), squeeze=False)
    acc_ax, banded, colours = axes[0][0], 0, plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (c, label) in enumerate(zip(curves, labels(results))):
        colour = colours[i % len(colours)]
        banded += _draw(acc_ax, c["accuracy"], colour, label)
        if "global" in c:
            banded += _draw(acc_ax, c["global"], colour, f"{label} (global model)", "--")
        if "loss" in c:
            banded += _draw(axes[0][1], c["loss"], colour, label)
    acc_ax.set_ylabel("test accuracy (%)")
    if with_loss:
        axes[0][1].set_ylabel("mean local training loss (the algorithm's objective)")
        axes[0][1].set_title("train loss, mean over participating clients", fontsize=9)
    with_global = any("global" in c for c in curves)
    acc_ax.set_title("solid: mean over clients (own test rows); dashed: global model (all test rows)" if with_global
                     else "mean over clients, each on its own test rows", fontsize=9)
    for ax in axes[0]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        ax.set_xlabel("communication round (rounds)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    band = ("shaded: ±1 std over seeds (ddof=1, from metrics.csv)" if banded else
            "mean over seeds (no per-seed metrics.csv: no band)")
    fig.suptitle(f"{title(results)}\n{band}", fontsize=9)
    return _finish(fig, path)


def clients_png(runs: list[Run], path: str | Path | None = None) -> bytes:
    """Final test accuracy per client: one group of bars per run, one bar (colour) per client, error bars ±1 std over
    seeds. PNG bytes, also written atomically to `path` when given."""
    plt = pyplot()
    results = [run.result for run in runs]
    groups = [(label, per_client(r)) for r, label in zip(results, labels(results))]
    groups = [(label, g) for label, g in groups if g is not None]
    C = max((len(g[0]) for _, g in groups), default=0)
    fig, ax = plt.subplots(figsize=(max(7.5, 2.2 + 0.28 * C * max(len(groups), 1)), 4.6))
    width = 0.8 / max(C, 1)
    cmap = plt.get_cmap("tab10" if C <= 10 else "tab20")
    for gi, (_, (mean, std)) in enumerate(groups):
        for c in range(len(mean)):
            ax.bar(gi + (c - (C - 1) / 2) * width, mean[c], width, color=cmap(c % cmap.N),
                   yerr=None if std is None else std[c], capsize=2, error_kw={"linewidth": 0.8},
                   label=f"client {c}" if gi == 0 else None)
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
    ax.set_xlabel("run (one bar per client)")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_ylim(0, 105)
    ax.grid(axis="y", alpha=0.3)
    if groups:
        ax.legend(fontsize=7, ncol=1 + (C - 1) // 20, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(f"{title(results)}\nerror bars: ±1 std over seeds (ddof=1)", fontsize=9)
    return _finish(fig, path)


def _colours(K: int):
    cmap = pyplot().get_cmap("tab10" if K <= 10 else "tab20" if K <= 20 else "turbo")
    return [cmap(k if K <= 20 else k / max(K - 1, 1)) for k in range(K)]


def figure_png(xy: np.ndarray, feats: Features, keep: np.ndarray, axes_labels: list[str], heading: str,
               domains: list) -> bytes:
    """One panel per client: that client's points coloured by class over every client's points in grey."""
    plt = pyplot()

    client, label = feats.client[keep], feats.label[keep]  # [P], [P]
    C, K = feats.clients, len(feats.classes)
    cols = math.ceil(math.sqrt(C))
    rows = math.ceil(C / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols, 2.9 * rows + 0.9), sharex=True, sharey=True,
                             squeeze=False)
    colours = np.asarray(_colours(K))  # [K, 4]
    for c, ax in enumerate(axes.flat):
        if c >= C:
            ax.set_visible(False)
            continue
        mine = client == c  # [P]
        ax.scatter(xy[~mine, 0], xy[~mine, 1], s=3, color="0.85", linewidths=0, rasterized=True)
        ax.scatter(xy[mine, 0], xy[mine, 1], s=9, c=colours[label[mine]], linewidths=0)
        ax.set_title(f"client {c}" + (f" ({domains[c]})" if c < len(domains) and domains[c] else ""), fontsize=8)
        if c % cols == 0:
            ax.set_ylabel(axes_labels[1], fontsize=8)
        if c + cols >= C:
            ax.set_xlabel(axes_labels[0], fontsize=8)
        ax.tick_params(labelsize=7)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colours[k], label=str(name))
               for k, name in enumerate(feats.classes)][:20]
    handles.append(plt.Line2D([], [], marker="o", linestyle="", color="0.85", label="other clients"))
    fig.legend(handles=handles, title="class" + (f" (first 20 of {K})" if K > 20 else ""), loc="center right",
               fontsize=7, title_fontsize=8)
    fig.suptitle(heading, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    return png(fig, PLOT_MARK, dpi=110)
