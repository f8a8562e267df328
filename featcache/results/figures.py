"""The PNG figures: report's accuracy curves and per-client bars, plot's learned features per client.

matplotlib is imported inside the functions that draw (`pyplot`): it takes about half a second to import, which
`featcache report` without --out and every other command do not pay. Each PNG carries the command that wrote it in
its Software text, so that command may replace it and never replaces anyone else's file.
"""

from __future__ import annotations

import io
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..atomic import output_errors, write_atomic, write_together
from ..errors import UserError
from .load import is_number
from .tables import Series, client_domains, labels, per_client, series, title

if TYPE_CHECKING:
    from .features import Features
    from .load import Run
    from .sweep import Sweep

REPORT_MARK = "featcache report"  # in report.md's first line and its PNGs' Software text: files report may replace
REPORT_FILES = ("report.md", "curves.png", "clients.png", "sweep.png", "search.png")  # every name a report writes
PLOT_MARK = "featcache plot"  # the plot PNG's Software text: marks a file plot may overwrite


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig, mark: str, dpi: int = 120) -> bytes:
    """The PNG bytes of `fig` (then closed), its Software text `mark`: which command wrote it, and may replace it."""
    buf = io.BytesIO()  # tight: a title or a legend outside the axes is inside the picture, never cut
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": mark}, bbox_inches="tight", pad_inches=0.15)
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


def written_by_report(path: Path) -> bool:
    """Whether the file at `path` is one `featcache report` wrote (so a new report may replace it)."""
    if path.suffix != ".md":
        return png_mark(path) == REPORT_MARK
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip() == f"<!-- {REPORT_MARK} -->"
    except (OSError, UnicodeDecodeError):
        return False


def write_report(out: str | Path, files: dict[str, bytes | str]) -> None:
    """Write a report's `files` (name -> body) into `out` together. Only files a report wrote are replaced (a file of
    the same name someone else made is one line, nothing written), and one an earlier report left that this one does
    not write (a sweep's sweep.png under a report of one run) is removed: report.md no longer links it."""
    theirs = [n for n in files if (Path(out) / n).exists() and not written_by_report(Path(out) / n)]
    if theirs:
        raise UserError(
            f"--out {out}: {theirs[0]} exists and was not written by `featcache report`: pass another "
            "--out or move it (a report never overwrites a file it did not write)"
        )
    write_together([(Path(out) / name, body) for name, body in files.items()])
    with output_errors(out):
        for stale in (Path(out) / n for n in REPORT_FILES if n not in files):
            if not stale.is_symlink() and stale.is_file() and written_by_report(stale):
                stale.unlink(missing_ok=True)  # another report may have removed it first


def _finish(fig, path: Path | None, laid_out: bool = False) -> bytes:
    """Lay out `fig` (unless `laid_out`), return its PNG bytes, and write them to `path` (atomically) when one is
    given."""
    if not laid_out:
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


PERCENT = (0.0, 100.0)  # an accuracy band's limits: ±1 std never reaches past what an accuracy can be
SAME = 0.005  # percentage points: a global value this close to the personal one is drawn on top of it


def band(ax, x, mean, std, color, alpha: float = 0.15, clip: tuple | None = PERCENT) -> None:
    """The ±1 std band around `mean`, clipped to `clip` (None: not clipped, for losses)."""
    lo, hi = np.asarray(mean) - np.asarray(std), np.asarray(mean) + np.asarray(std)
    if clip is not None:
        lo, hi = np.clip(lo, *clip), np.clip(hi, *clip)
    ax.fill_between(x, lo, hi, color=color, alpha=alpha, linewidth=0)


def _draw(
    ax, s: Series, style: dict, label: str, i: int, n: int, dashes: str = "-", clip: tuple | None = PERCENT
) -> bool:
    """One curve with its run's style, markers staggered between runs so equal curves still show every run's, and
    its ±1 std band (clipped to `clip`) when known; whether a band was drawn. A dashed curve gets hollow markers, so
    it shows on a solid one it equals."""
    every = max(1, len(s.rounds) // 8)
    hollow = {"markerfacecolor": "white"} if dashes != "-" else {}
    ax.plot(
        s.rounds,
        s.mean,
        dashes,
        label=label,
        markersize=4,
        markevery=(i * every // max(n, 1), every),
        **style,
        **hollow,
    )
    if s.std is not None:
        band(ax, s.rounds, s.mean, s.std, style["color"], clip=clip)
    return s.std is not None


def same_note(personal, global_, where: list[str], unit: str, units: str = "") -> str:
    """Where the global model's accuracy equals the personal one (within SAME): ` = personal at every round` /
    ` = personal at round 1, 2` / ` = personal at 37 of 50 rounds` (`units`, default unit + s), or ''."""
    equal = np.abs(np.asarray(global_, dtype=np.float64) - np.asarray(personal, dtype=np.float64)) <= SAME
    if equal.all():
        return f" = personal at every {unit}: drawn on it"
    if not equal.any():
        return ""
    at = [w for w, e in zip(where, equal) if e]
    if len(at) <= 4:
        return f" = personal at {unit} {', '.join(at)}"
    return f" = personal at {len(at)} of {len(where)} {units or unit + 's'}"


def wrapped_title(heading: str, extra: str, fig) -> str:
    """`heading` wrapped to the width of `fig` (at font size 8), then `extra` (what the marks mean): lines break
    between the heading's parts (`; `), and inside a part only when it is longer than a line."""
    import textwrap

    width, lines = int(fig.get_figwidth() * 13), []
    for part in heading.split("; "):
        pieces = textwrap.wrap(part, width, break_on_hyphens=False) or [part]
        if lines and len(lines[-1]) + 2 + len(pieces[0]) <= width:
            lines[-1] += f"; {pieces.pop(0)}"
        lines += pieces
    return "\n".join(lines + [extra])


def curves_png(
    runs: list[Run], path: str | Path | None = None, names: list[str] | None = None, heading: str | None = None
) -> bytes:
    """Test accuracy per evaluation round (solid: mean over clients; dashed: the global model, where the results have
    one, its legend entry saying where it equals the solid curve) and, where the results record it, the mean local
    training loss in a panel per algorithm (objectives differ in scale and meaning: FedPCL's is unbounded below);
    shaded ±1 std over seeds where the metrics.csv sidecar holds the per-seed values, accuracy bands clipped to
    0-100 %. `names` label the runs (default: `labels`), `heading` titles the figure (default: `title`). The legend
    sits under the accuracy panel. PNG bytes, also written atomically to `path`."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    results = [run.result for run in runs]
    curves = [series(run) for run in runs]
    names = names or labels(results)
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
            where = [str(x) for x in c["global"].rounds]
            note = same_note(c["accuracy"].mean, c["global"].mean, where, "round")
            banded += _draw(acc_ax, c["global"], styles[i], f"{label} (global model{note})", i, n, "--")
        if "loss" in c:
            banded += _draw(loss_ax[r["algo"]], c["loss"], styles[i], label, i, n, clip=None)
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
    shade = (
        "shaded: ±1 std over seeds (ddof=1, from metrics.csv; accuracy clipped to 0-100 %)"
        if banded
        else "mean over seeds (no per-seed metrics.csv: no band)"
    )
    fig.suptitle(wrapped_title(heading or title(results), shade, fig), fontsize=8)
    handles, texts = acc_ax.get_legend_handles_labels()
    fig.tight_layout()  # the legend goes under the x label once the axes have their place
    bottom = acc_ax.xaxis.label.get_window_extent(fig.canvas.get_renderer()).y0
    under = acc_ax.transAxes.inverted().transform((0, bottom - 4))[1]
    ncol = min(3, 1 + (len(texts) - 1) // 3)
    wide = int(acc_ax.get_position().width * fig.get_figwidth() * 12 / ncol) - 6  # characters a column has
    texts = [textwrap.fill(t, max(wide, 12), break_on_hyphens=False) for t in texts]  # never wider than the axes
    acc_ax.legend(handles, texts, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, under), ncol=ncol)
    return _finish(fig, path, laid_out=True)


def objective_of(algo: str) -> str:
    """The algorithm's declared `objective` note ("" for one this featcache does not know)."""
    from ..algorithms import list_algorithms

    return getattr(list_algorithms().get(algo), "objective", "")


def client_names(runs: list[Run], C: int) -> list[str]:
    """`client 0: amazon` where every run that knows client 0's domain (`client_domains`) agrees on it and the
    clients are not all of one domain, else `client 0`."""
    known = [d for d in map(client_domains, runs) if d]
    names = []
    for c in range(C):
        domains = {d[c] for d in known if c < len(d) and d[c]}
        names.append(f"client {c}: {domains.pop()}" if len(domains) == 1 else f"client {c}")
    several = len({name.partition(": ")[2] for name in names}) > 1
    return names if several else [f"client {c}" for c in range(C)]


def clients_png(
    runs: list[Run], path: str | Path | None = None, names: list[str] | None = None, heading: str | None = None
) -> bytes:
    """Final test accuracy per client: one group of bars per run, one bar (colour) per client, named by its domain
    where known (`client_names`; where runs disagree on a client's domain, on each bar), error bars ±1 std over seeds
    clipped to 0-100 %. `names` and `heading` as for
    `curves_png`. PNG bytes, also written atomically to `path` when given."""
    plt = pyplot()
    results = [run.result for run in runs]
    drawn = [(run, label, per_client(run.result)) for run, label in zip(runs, names or labels(results))]
    drawn = [(run, label, g) for run, label, g in drawn if g is not None]
    groups = [(label, g) for _, label, g in drawn]
    C = max((len(g[0]) for _, g in groups), default=0)
    fig, ax = plt.subplots(figsize=(max(7.5, 2.2 + 0.28 * C * max(len(groups), 1)), 4.6))
    width = 0.8 / max(C, 1)
    cmap = plt.get_cmap("tab10" if C <= 10 else "tab20")
    legend = client_names(runs, C)
    domains = [client_domains(run) or [] for run, _, _ in drawn]
    on_bars = any(len({ds[c] for ds in domains if c < len(ds) and ds[c]}) > 1 for c in range(C))  # runs disagree
    legend = [f"client {c}" for c in range(C)] if on_bars else legend  # each bar then says its domain
    named = set()  # a client is named at its first bar (a group of fewer clients comes first)
    for gi, (_, (mean, std)) in enumerate(groups):
        for c in range(len(mean)):
            x = gi + (c - (C - 1) / 2) * width
            ax.bar(
                x,
                mean[c],
                width,
                color=cmap(c % cmap.N),
                yerr=None if std is None else [[min(std[c], mean[c])], [min(std[c], 100.0 - mean[c])]],
                capsize=2,
                error_kw={"linewidth": 0.8},
                label=None if c in named else legend[c],
            )
            named.add(c)
            if on_bars and c < len(domains[gi]) and domains[gi][c]:  # runs disagree on a client's domain: each bar
                ax.text(x, 0.02, domains[gi][c], transform=ax.get_xaxis_transform(), rotation=90, fontsize=6,
                        ha="center", va="bottom")  # fmt: skip
    long = len(groups) > 4 or any(len(label) > 24 for label, _ in groups)
    ax.set_xticks(
        range(len(groups)),
        [label for label, _ in groups],
        fontsize=8,
        rotation=25 if long else 0,
        ha="right" if long else "center",
    )
    ax.set_xlabel("run (one bar per client)")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_ylim(*zoom([g for _, g in groups]))
    ax.grid(axis="y", alpha=0.3)
    if groups:
        ax.legend(fontsize=7, ncol=1 + (C - 1) // 20, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(
        wrapped_title(
            heading or title(results),
            "error bars: ±1 std over seeds (ddof=1, within 0-100 %); the y axis spans the data"
            + ("; on a bar: its client's domain in that run" if on_bars else ""),
            fig,
        ),
        fontsize=8,
    )
    return _finish(fig, path)


def sweep_png(s: Sweep, path: str | Path | None = None) -> bytes:
    """Final test accuracy against the swept parameter (`sweep.Sweep`): per line, the personal accuracy (solid: each
    client's model on its own test rows, averaged) and the global model's (dashed, hollow markers, its legend entry
    saying where it equals the solid line), each with a ±1 std band over seeds clipped to 0-100 %. A numeric
    parameter spanning a factor of 10 or more (α 0.1-10) is drawn on a log axis; a categorical one (partition,
    held-out domain) as points with error bars, each line's side by side, nothing drawn between categories. The
    legend sits right of the axes, its labels wrapped. PNG bytes, also written atomically to `path`."""
    from .sweep import PARAMETERS, order_key, sweep_title, text

    plt = pyplot()
    param = PARAMETERS[s.x]
    shown = [p for p in s.points if p.x is not None]
    numeric = param.numeric and all(is_number(p.x) for p in shown)
    values = sorted({text(p.x) for p in shown}, key=order_key)
    at = {v: (float(v) if numeric else float(i)) for i, v in enumerate(values)}
    log = numeric and bool(values) and min(at.values()) > 0 and max(at.values()) >= 10 * min(at.values())
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    styles = run_styles(len(s.lines))
    spans = []
    for i, line in enumerate(s.lines):
        pts = [p for p in shown if p.line == line]
        if not pts:
            continue
        style = {"color": styles[i]["color"], "marker": styles[i]["marker"], "markersize": 6}
        dodge = 0.0 if numeric else 0.1 * (i - (len(s.lines) - 1) / 2)  # categories: each line's points side by side
        x = [at[text(p.x)] + dodge for p in pts]
        mean, std = np.array([p.acc[0] for p in pts]), np.array([p.acc[1] for p in pts])
        ax.plot(x, mean, linestyle="-" if numeric else "none", linewidth=2.2, label=f"{line}: personal", **style)
        spread(ax, x, mean, std, style["color"], numeric)
        spans.append((mean, std))
        glob = [p for p in pts if p.global_acc is not None]
        if glob:
            gx = [at[text(p.x)] + dodge for p in glob]
            gmean, gstd = np.array([p.global_acc[0] for p in glob]), np.array([p.global_acc[1] for p in glob])
            note = same_note([p.acc[0] for p in glob], gmean, [text(p.x) for p in glob], param.label, "points")
            dashes = "--" if numeric else "none"
            ax.plot(
                gx,
                gmean,
                linestyle=dashes,
                linewidth=1.4,
                markerfacecolor="white",
                label=f"{line}: global{note}",
                **style,
            )
            spread(ax, gx, gmean, gstd, style["color"], numeric, alpha=0.07)
            spans.append((gmean, gstd))
    if log:
        ax.set_xscale("log")
    ax.set_xticks([at[v] for v in values], values)
    ax.minorticks_off()
    if not numeric:
        ax.set_xlim(-0.5, len(values) - 0.5)  # each category in its own slot
    ax.set_xlabel(param.label + (" (log scale)" if log else ""))
    ax.set_ylabel("final test accuracy (%)")
    ax.set_ylim(*zoom(spans, top=101.0))  # a point at 100 % keeps its whole marker
    ax.grid(alpha=0.3)
    handles, texts = ax.get_legend_handles_labels()
    wrap = int(0.4 * fig.get_figwidth() * 12)  # characters: the legend stays narrower than the axes beside it
    texts = [textwrap.fill(t, wrap, break_on_hyphens=False) for t in texts]
    ax.legend(handles, texts, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    seeds = max((len(p.run.result["seeds"]) for p in shown), default=1)
    solid, dashed = ("solid", "dashed") if numeric else ("filled", "hollow")
    key = f"{solid}: personal (each client's model, own test rows); {dashed}: global model (all test rows); " + (
        f"{'shaded' if numeric else 'error bars'}: ±1 std over seeds (ddof=1), within 0-100 %"
        if seeds > 1
        else "one seed: no band"
    )
    left = len(s.points) - len(shown)
    key += f"; {left} result(s) without {param.label} left out" if left else ""
    fig.suptitle(wrapped_title(f"final accuracy vs {param.label}: " + sweep_title(s), key, fig), fontsize=8)
    return _finish(fig, path)


def spread(ax, x, mean, std, color, numeric: bool, alpha: float = 0.15) -> None:
    """±1 std: a band along a numeric axis, error bars on categories (no band between unrelated values); both within
    0-100 %."""
    if numeric:
        band(ax, x, mean, std, color, alpha=alpha)
        return
    yerr = [np.minimum(std, mean), np.minimum(std, 100.0 - np.asarray(mean))]
    ax.errorbar(x, mean, yerr=yerr, fmt="none", ecolor=color, capsize=3, linewidth=1)


def zoom(groups: list[tuple], top: float = 100.0) -> tuple[float, float]:
    """y limits that span the bars' tops and error bars, or the lines and their bands (groups: (mean [C], std [C]
    or None)), clipped to 0-100 %, with a margin up to `top`: an 85-98 % spread fills the axis instead of its top
    eighth."""
    tops = [v for mean, std in groups for v in (mean if std is None else np.concatenate([mean - std, mean + std]))]
    if not tops:
        return 0.0, top
    lo, hi = float(np.clip(min(tops), *PERCENT)), float(np.clip(max(tops), *PERCENT))
    pad = max(1.0, 0.1 * (hi - lo))
    return max(0.0, lo - pad), min(top, hi + pad)


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
    fig.tight_layout()
    fig.legend(  # right of the panels, never over them (the PNG's tight bounding box takes it in)
        handles=handles,
        title="class" + (f" (first 20 of {K})" if K > 20 else ""),
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize=7,
        title_fontsize=8,
    )
    fig.suptitle(wrapped_title(heading, "", fig).rstrip("\n"), fontsize=9, y=1.0, va="bottom")
    return png(fig, PLOT_MARK, dpi=110)
