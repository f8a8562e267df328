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


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<")


def run_styles(n: int) -> list[dict]:
    """A look per run: distinct colours (tab10 up to 10 runs, tab20 up to 20), a marker each, and lines that thin
    from the first run to the last, so a run drawn over an equal one (FedProx over FedAvg) leaves it visible."""
    cmap = pyplot().get_cmap("tab10" if n <= 10 else "tab20")
    return [
        {"color": cmap(i % cmap.N), "marker": MARKERS[i % len(MARKERS)], "linewidth": 2.8 - 1.6 * i / max(n - 1, 1)}
        for i in range(n)
    ]


def _draw(ax, s: Series, style: dict, label: str, i: int, n: int, dashes: str = "-") -> bool:
    """One curve with its run's style, markers staggered between runs so equal curves still show every run's, and
    its ±1 std band when known; whether a band was drawn."""
    every = max(1, len(s.rounds) // 8)
    ax.plot(s.rounds, s.mean, dashes, label=label, markersize=4, markevery=(i * every // max(n, 1), every), **style)
    if s.std is not None:
        ax.fill_between(s.rounds, s.mean - s.std, s.mean + s.std, color=style["color"], alpha=0.15, linewidth=0)
    return s.std is not None


def wrapped_title(results: list[dict], extra: str, fig) -> str:
    """The report's title wrapped to the width of `fig` (at font size 8), then `extra` (what the marks mean): lines
    break between the title's parts, and inside a part only when it is longer than a line."""
    import textwrap

    width, lines = int(fig.get_figwidth() * 13), []
    for part in title(results).split("; "):
        pieces = textwrap.wrap(part, width, break_on_hyphens=False) or [part]
        if lines and len(lines[-1]) + 2 + len(pieces[0]) <= width:
            lines[-1] += f"; {pieces.pop(0)}"
        lines += pieces
    return "\n".join(lines + [extra])


def curves_png(runs: list[Run], path: str | Path | None = None) -> bytes:
    """Test accuracy per evaluation round (solid: mean over clients; dashed: the global model, where the results have
    one) and, where the results record it, the mean local training loss in a panel per algorithm (objectives differ in
    scale and meaning: FedPCL's is unbounded below); shaded ±1 std over seeds where the metrics.csv sidecar holds the
    per-seed values. The legend sits under the accuracy panel. PNG bytes, also written atomically to `path`."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    results = [run.result for run in runs]
    curves = [series(run) for run in runs]
    names = labels(results)
    styles = run_styles(len(runs))
    algos = list(dict.fromkeys(r["algo"] for r, c in zip(results, curves) if "loss" in c))
    rows = max(1, len(algos))
    fig = plt.figure(figsize=(12 if algos else 7, max(4.8, 1.9 * rows) + 0.25 * len(runs)))
    grid = fig.add_gridspec(rows, 2 if algos else 1, width_ratios=[1.6, 1] if algos else None)
    acc_ax = fig.add_subplot(grid[:, 0])
    loss_ax = {a: fig.add_subplot(grid[k, 1]) for k, a in enumerate(algos)}
    banded, n = 0, len(runs)
    for i, (r, c, label) in enumerate(zip(results, curves, names)):
        banded += _draw(acc_ax, c["accuracy"], styles[i], label, i, n)
        if "global" in c:
            banded += _draw(acc_ax, c["global"], styles[i], f"{label} (global model)", i, n, "--")
        if "loss" in c:
            banded += _draw(loss_ax[r["algo"]], c["loss"], styles[i], label, i, n)
    acc_ax.set_ylabel("test accuracy (%)")
    with_global = any("global" in c for c in curves)
    acc_ax.set_title(
        "solid: mean over clients (own test rows); dashed: global model (all test rows)"
        if with_global
        else "mean over clients, each on its own test rows",
        fontsize=9,
    )
    for algo, ax in loss_ax.items():
        note = objective_of(algo)
        ax.set_title(
            f"{algo}: mean local training loss" + (" (unbounded below: not a fit measure)" if note else ""), fontsize=8
        )
        ax.tick_params(labelsize=7)
    for ax in [acc_ax, *loss_ax.values()]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        ax.grid(alpha=0.3)
    acc_ax.set_xlabel("communication round (rounds)")
    if algos:
        list(loss_ax.values())[-1].set_xlabel("communication round (rounds)")
    entries = len(acc_ax.get_legend_handles_labels()[1])
    acc_ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=min(3, 1 + (entries - 1) // 3))
    band = (
        "shaded: ±1 std over seeds (ddof=1, from metrics.csv)"
        if banded
        else "mean over seeds (no per-seed metrics.csv: no band)"
    )
    fig.suptitle(wrapped_title(results, band, fig), fontsize=8)
    return _finish(fig, path)


def objective_of(algo: str) -> str:
    """The algorithm's declared `objective` note ("" for one this featcache does not know)."""
    from ..algorithms import list_algorithms

    return getattr(list_algorithms().get(algo), "objective", "")


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
            ax.bar(
                gi + (c - (C - 1) / 2) * width,
                mean[c],
                width,
                color=cmap(c % cmap.N),
                yerr=None if std is None else std[c],
                capsize=2,
                error_kw={"linewidth": 0.8},
                label=f"client {c}" if gi == 0 else None,
            )
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
    ax.set_xlabel("run (one bar per client)")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_ylim(*zoom([g for _, g in groups]))
    ax.grid(axis="y", alpha=0.3)
    if groups:
        ax.legend(fontsize=7, ncol=1 + (C - 1) // 20, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(
        wrapped_title(results, "error bars: ±1 std over seeds (ddof=1); the y axis spans the data", fig), fontsize=8
    )
    return _finish(fig, path)


def zoom(groups: list[tuple]) -> tuple[float, float]:
    """y limits that span the bars' tops and error bars (groups: (mean [C], std [C] or None)) with a margin, within
    0-100 %: an 85-98 % spread fills the axis instead of its top eighth."""
    tops = [v for mean, std in groups for v in (mean if std is None else np.concatenate([mean - std, mean + std]))]
    if not tops:
        return 0.0, 105.0
    lo, hi = float(min(tops)), float(max(tops))
    pad = max(1.0, 0.1 * (hi - lo))
    return max(0.0, lo - pad), min(100.0 if hi <= 100 else 105.0, hi + pad)


def _colours(K: int):
    cmap = pyplot().get_cmap("tab10" if K <= 10 else "tab20" if K <= 20 else "turbo")
    return [cmap(k if K <= 20 else k / max(K - 1, 1)) for k in range(K)]


def figure_png(
    xy: np.ndarray, feats: Features, keep: np.ndarray, axes_labels: list[str], heading: str, domains: list
) -> bytes:
    """One panel per client: that client's points coloured by class over every client's points in grey."""
    plt = pyplot()

    client, label = feats.client[keep], feats.label[keep]  # [P], [P]
    C, K = feats.clients, len(feats.classes)
    cols = math.ceil(math.sqrt(C))
    rows = math.ceil(C / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.1 * cols, 2.9 * rows + 0.9), sharex=True, sharey=True, squeeze=False
    )
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
    handles = [
        plt.Line2D([], [], marker="o", linestyle="", color=colours[k], label=str(name))
        for k, name in enumerate(feats.classes)
    ][:20]
    handles.append(plt.Line2D([], [], marker="o", linestyle="", color="0.85", label="other clients"))
    fig.legend(
        handles=handles,
        title="class" + (f" (first 20 of {K})" if K > 20 else ""),
        loc="center right",
        fontsize=7,
        title_fontsize=8,
    )
    fig.suptitle(heading, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    return png(fig, PLOT_MARK, dpi=110)
