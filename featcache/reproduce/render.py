"""Rendering: the runs of a pipeline's cells -> our value per cell, the markdown table beside the paper's numbers,
the whole OUT/NAME.md (command, profile, caches, mapping note, claims, resolved configuration) and the figure.

'—' = not run (no implementation, or not in this profile); 'n/a' = no counterpart in this data (or no server model).
"""

from __future__ import annotations

import datetime
import io
import json
import math
import os
import shlex
from pathlib import Path

import numpy as np

from .. import __version__
from ..provenance import cpu_model, gpu_name
from .agreement import agreement_lines, rank_agreement
from .metrics import METRICS, Value, domain_clients, fmt_value, metric_value
from .schema import Pipeline


def cell_values(pipe: Pipeline, cells: dict, runs: dict) -> dict[tuple[str, str], Value]:
    """(row, column) -> our value (`runs`: job.key() -> run); a heatmap with normalize = column divides each column by
    its sum (as FedPCL's Figure 3)."""
    metric = {c.name: c.metric for c in pipe.columns}
    col_pick = {c.name: c.backbones[0] for c in pipe.columns if c.backbones}
    row_pick = {r.row: r.backbones[0] for r in pipe.runs if r.backbones}
    pick = lambda row, col: row_pick.get(row, col_pick.get(col))  # the backbone a cell reads: its run's, else column's
    values = {
        (row, col): metric_value(runs[job.key()], metric[col], pick(row, col)) for (row, col), job in cells.items()
    }
    if pipe.figure.get("normalize") == "column":
        for col in {c for _, c in values}:
            total = sum(v[0] for (_, c), v in values.items() if c == col and isinstance(v, tuple))
            for (row, c), v in list(values.items()):
                if c == col and isinstance(v, tuple) and total > 0:
                    values[(row, c)] = (v[0] / total, v[1] / total)
    return values


def column_labels(pipe: Pipeline, cells: dict, runs: dict) -> dict[str, str]:
    """What each mapped paper column is on this data, e.g. 'clients of domain optdigits' for USPS."""
    labels = {}
    for col in pipe.columns:
        jobs = [job for (_, c), job in cells.items() if c == col.name]
        kind, _, arg = col.metric.partition(":")
        if not jobs:
            labels[col.name] = "not run in this profile"
        elif METRICS[kind].per_domain:
            found = {domain_clients(runs[j.key()], arg)[0] for j in jobs} - {None}
            labels[col.name] = (
                f"clients of domain {', '.join(sorted(found))}"
                if found
                else f"n/a (the data has no domain {arg.replace('|', ' or ')})"
            )
        else:
            labels[col.name] = METRICS[kind].text + (f" {arg}" if arg else "")
    return labels


def column_domains(pipe: Pipeline, cells: dict, runs: dict) -> dict[str, str]:
    """Per-domain columns whose clients hold a domain of another name: column -> what it really is (USPS ->
    optdigits offline)."""
    plain = lambda name: name.lower().replace("-", "").replace("_", "")
    found = {}
    for col in pipe.columns:
        kind, _, arg = col.metric.partition(":")
        if METRICS[kind].per_domain:
            names = {domain_clients(runs[j.key()], arg)[0] for (_, c), j in cells.items() if c == col.name} - {None}
            if names and {plain(n) for n in names} != {plain(col.name)}:
                found[col.name] = ", ".join(sorted(names))
    return found


def paper_cell(pipe: Pipeline, row: str, col: str):
    """The paper's number for a cell, as the pipeline gives it (None: the paper has no such row)."""
    return pipe.paper_rows[row][pipe.paper_columns.index(col)] if row in pipe.paper_rows else None


def fmt_paper(cell) -> str:
    if isinstance(cell, bool) or cell is None:
        return "—"
    if isinstance(cell, int):
        return f"{cell:,}"
    return str(cell)


def table_markdown(pipe: Pipeline, values: dict[tuple[str, str], Value], domains: dict | None = None) -> str:
    """Rows = the paper's rows (+ extra rows); for every paper column: ours, then the paper's number (ours only
    without a paper). `domains` (column_domains) names the domain our column really holds: `USPS (optdigits) ours`."""
    metric = {c.name: c.metric for c in pipe.columns}
    domains = domains or {}
    sides = ("ours", "paper") if pipe.paper else ("ours",)
    head = ["row"] + [
        f"{c} ({domains[c]}) ours" if c in domains and side == "ours" else f"{c} {side}"
        for c in pipe.paper_columns
        for side in sides
    ]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for row in pipe.rows:
        cells = [row]
        for col in pipe.paper_columns:
            ours = fmt_value(values[(row, col)], metric[col]) if (row, col) in values else "—"
            cells += [ours, fmt_paper(paper_cell(pipe, row, col)) if row in pipe.paper_rows else "—"][: len(sides)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def command_line(pipe: Pipeline, profile: str, data_root, dataset, backbones, out, cache) -> str:
    parts = ["featcache", "reproduce", pipe.path, "--profile", profile]
    parts += ["--data-root", str(data_root)] if data_root else []
    parts += ["--dataset", dataset] if dataset else []
    for b in backbones or ():
        parts += ["--backbones", b]
    parts += ["--out", str(out), "--cache", str(cache)]
    return shlex.join(parts)


def made_on() -> str:
    """The machine a result was made on, for the header of OUT/NAME.md: CPU model and cores, and the GPU when there is
    one (extraction runs on it; training runs on the CPU, TRAIN_DEVICE)."""
    gpu = gpu_name("cuda") if _cuda_available() else None
    return f"{cpu_model() or 'unknown CPU'} ({os.cpu_count()} cores)" + (f", GPU {gpu}" if gpu else "")


def _cuda_available() -> bool:
    import torch  # lazy: the CLI imports this module at start-up

    return torch.cuda.is_available()


def render(
    pipe: Pipeline,
    profile: str,
    command: str,
    cells: dict,
    runs: dict,
    caches: dict,
    figures: list[str],
    why: list[str],
) -> str:
    """The whole OUT/NAME.md: whether it is comparable with the paper (`why` not: agreement.comparability) and
    whether the paper's ranking holds, header (command, profile, caches and keys), mapping note, table, claims,
    config (`caches`: job.extract -> the extraction's summary)."""
    prof = pipe.profiles[profile]
    labels = column_labels(pipe, cells, runs)
    values = cell_values(pipe, cells, runs)
    out = [
        f"# {pipe.name}: {pipe.paper} {pipe.table}: {pipe.title}" if pipe.paper else f"# {pipe.name}: {pipe.title}",
        "",
        *agreement_lines(why, rank_agreement(pipe, values) if pipe.paper else {}, pipe.paper),
        "",
        f"- command: `{command}`",
        *([f"- paper: {pipe.source}"] if pipe.paper else []),
        f"- profile `{profile}`: rounds {prof.rounds}, seeds {', '.join(map(str, prof.seeds))}"
        + (f", settings {json.dumps(prof.set, sort_keys=True)}" if prof.set else "")
        + (f", extract {json.dumps(prof.extract, sort_keys=True)}" if prof.extract else ""),
        f"- made by featcache {__version__} on {made_on()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
        "- caches (content keys):",
    ]
    for info in caches.values():
        out.append(
            f"  - `{Path(info['cache']).name}` key `{info['key']}` ({info['images']} images, "
            f"backbones {', '.join(info['backbones'])})"
        )
    out += ["", pipe.note, "", "Our columns: " + "; ".join(f"**{c}** = {labels[c]}" for c in labels), ""]
    out += [
        table_markdown(pipe, values, column_domains(pipe, cells, runs)),
        "ours: mean(std) over seeds; '—' not run (no implementation, or not in this profile); "
        "'n/a' no counterpart in this data.",
        "",
    ]
    if pipe.claims:
        out += ["The paper's claims for this target:", ""] + [f"- {c}" for c in pipe.claims] + [""]
    out += [f"![{pipe.name}]({Path(f).name})" for f in figures] + ([""] if figures else [])
    config = {
        "profile": profile,
        "jobs": [_job_config(job, cells, runs, caches) for job in dict.fromkeys(cells.values())],
    }
    out += [
        "<details><summary>Resolved configuration</summary>",
        "",
        "```json",
        json.dumps(config, indent=1, sort_keys=True),
        "```",
        "",
        "</details>",
        "",
    ]
    return "\n".join(out)


def _job_config(job, cells: dict, runs: dict, caches: dict) -> dict:
    """One job in the resolved configuration: its cells, algorithm, cache file, backbones, seeds and full config."""
    names = job.extract_kwargs["backbone"]
    return {
        "cells": [f"{r} / {c}" for (r, c), j in cells.items() if j == job],
        "algo": job.algo,
        "cache": Path(caches[job.extract]["cache"]).name,
        "backbones": [names[i] for i in job.chosen(len(names))],
        "seeds": list(job.seeds),
        "config": runs[job.key()]["config"],
    } | ({"search": json.loads(job.search)} if job.search != "{}" else {})


def figure_png(pipe: Pipeline, values: dict) -> bytes:
    """NAME.png's bytes: lines (x = each column's x, our means with std error bars) or a heatmap (rows x columns)."""
    import matplotlib  # lazy: matplotlib and its Agg backend only when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    number = lambda r, c: isinstance(values.get((r, c.name)), tuple)
    rows = [r for r in pipe.rows if any(number(r, c) for c in pipe.columns)]
    cols = [c for c in pipe.columns if any(number(r, c) for r in rows)]
    if pipe.figure["kind"] == "lines":
        for row in rows:
            pts = [(c.x, values[(row, c.name)]) for c in cols if number(row, c)]
            ax.errorbar(
                [p[0] for p in pts],
                [p[1][0] for p in pts],
                yerr=[p[1][1] for p in pts],
                marker="o",
                capsize=3,
                label=row,
            )
        ax.set_xscale(pipe.figure.get("xscale", "linear"))
        ax.set_xticks([c.x for c in cols], [f"{c.x:g}" for c in cols])
        ax.minorticks_off()
        ax.legend()
        ax.grid(alpha=0.3)
    else:
        grid = np.array([[values[(r, c.name)][0] if number(r, c) else math.nan for c in cols] for r in rows])
        im = ax.imshow(grid, cmap="Blues")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center")
        ax.set_xticks(range(len(cols)), [c.name for c in cols])
        ax.set_yticks(range(len(rows)), rows)
        fig.colorbar(im, ax=ax)
    ax.set_xlabel(pipe.figure.get("xlabel", ""))
    ax.set_ylabel(pipe.figure.get("ylabel", ""))
    ax.set_title(f"{pipe.paper} {pipe.table} (ours)" if pipe.paper else pipe.title)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()
