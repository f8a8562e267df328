"""How a reproduction compares with its paper: whether the run is comparable at all, and whether the paper's ranking
of its rows holds in ours (Kendall's τ-b per result column: 1 the same order, 0 unrelated, −1 reversed; and whether
the paper's best row is ours too).

Comparable means every input the paper's numbers depend on matches: its data set, its backbones (architecture,
weights, feature width, frozen), its rounds, seeds and images per class (the `full` profile), and there are paper
numbers to compare with. Anything else is a reason, and every reason is listed.
"""

from __future__ import annotations

import json
import re
from pathlib import PurePath

from .metrics import METRICS
from .schema import PaperBackbone, Pipeline

FULL = "full"  # the profile with the papers' rounds and seeds
NO_PAPER = "the pipeline names no paper ([paper]): there is nothing to compare with"


def comparability(pipe: Pipeline, profile: str, jobs, backbones: list[list[dict]]) -> list[str]:
    """Why this run's numbers are not comparable with the paper's ([] only when everything matches). `backbones`:
    each extraction's backbones in order, as its cache records them ({key, name, weights, dim})."""
    if not pipe.paper:
        return [NO_PAPER]
    why, prof, full = [], pipe.profiles[profile], pipe.profiles.get(FULL)
    if not pipe.paper_rows:
        why.append("the pipeline holds no paper numbers ([paper.rows])")
    if full is None:
        why.append(f"the pipeline has no `{FULL}` profile (the paper's rounds and seeds)")
    elif profile != FULL:
        if prof.rounds != full.rounds:
            why.append(f"{prof.rounds} rounds (`{FULL}`: {full.rounds})")
        if len(prof.seeds) != len(full.seeds):
            why.append(f"{len(prof.seeds)} seeds (`{FULL}`: {len(full.seeds)})")
    caps = {("per_class", "train"), ("test_per_class", "test")}
    for key, split in sorted(caps):
        if key in prof.extract and prof.extract[key] != pipe.extract.get(key):
            why.append(f"{prof.extract[key]} {split} images per class (the pipeline's: {pipe.extract.get(key, 'all')})")
    datasets = sorted({json.loads(job.extract)["dataset"] for job in jobs})
    if not pipe.paper_dataset:
        why.append("the pipeline does not name the paper's data set (paper_dataset)")
    elif datasets != [pipe.paper_dataset]:
        why.append(f"data {', '.join(datasets)} stands in for the paper's {pipe.paper_dataset}")
    return why + _backbone_reasons(pipe.paper_backbones, backbones)


def _backbone_reasons(paper: tuple[PaperBackbone, ...], used: list[list[dict]]) -> list[str]:
    """Why the backbones differ from the paper's: architecture, weights or width at any position, or the paper
    training them end to end."""
    if not paper:
        return ["the pipeline does not name the paper's backbones ([paper] backbones)"]
    why = [
        f"the paper trains its {b.arch} end to end; featcache trains heads on frozen backbones"
        for b in paper
        if not b.frozen
    ]
    theirs = ", ".join(f"{b.arch} ({b.weights}" + (f", {b.dim}-d)" if b.dim else ")") for b in paper)
    for ours in {json.dumps(u, sort_keys=True): u for u in used}.values():
        if len(ours) != len(paper) or not all(map(_same_backbone, paper, ours)):
            why.append(f"backbones {', '.join(map(_describe, ours))} stand in for the paper's {theirs}")
    return why


def _same_backbone(paper: PaperBackbone, ours: dict) -> bool:
    """Same architecture, width and weights: the paper's weights word names our checkpoint (random never does)."""
    weights = str(ours["weights"])
    return (
        ours["name"] == paper.arch
        and paper.dim in (None, int(ours["dim"]))
        and weights != "random"
        and paper.weights.lower() in weights.lower()
    )


def _describe(ours: dict) -> str:
    source, _, where = str(ours["weights"]).partition(":")
    weights = "/".join(PurePath(where).parts[-2:]) if source == "file" else ours["weights"]
    return f"{ours['key']} ({ours['name']}, {weights}, {int(ours['dim'])}-d)"


def number(cell) -> float | None:
    """A paper cell or one of our values as a number: '82.75(0.40)' -> 82.75, 133632, (mean, std) -> mean; None for
    '-', n/a or not run."""
    if isinstance(cell, tuple):
        return float(cell[0])
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        return float(cell)
    m = re.match(r"^-?\d[\d,]*(\.\d+)?", cell) if isinstance(cell, str) else None
    return float(m.group(0).replace(",", "")) if m else None


def kendall_tau_b(a: list[float], b: list[float]) -> float | None:
    """Kendall's τ-b of two equally long lists (ties counted as neither agreeing nor disagreeing); None when either
    list is constant."""
    con = dis = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = (a[i] > a[j]) - (a[i] < a[j]), (b[i] > b[j]) - (b[i] < b[j])
            if da and db:
                con += da == db
                dis += da != db
            else:
                ties_a += not da and bool(db)
                ties_b += not db and bool(da)
    denom = ((con + dis + ties_a) * (con + dis + ties_b)) ** 0.5
    return (con - dis) / denom if denom else None


def rank_agreement(pipe: Pipeline, values: dict) -> dict[str, dict]:
    """Per paper result column (accuracy-like, never one the architecture fixes such as upload sizes) with at least 3
    rows that both the paper and this run have numbers for: `rows`, `tau` (None: one side is constant), `best_ours`
    and `best_paper` (the rows with the highest number)."""
    metric = {c.name: c.metric.partition(":")[0] for c in pipe.columns}
    out = {}
    for col in pipe.paper_columns:
        if col in metric and not METRICS[metric[col]].result:
            continue
        rows = [
            r
            for r in pipe.rows
            if r in pipe.paper_rows
            and number(values.get((r, col))) is not None
            and number(pipe.paper_rows[r][pipe.paper_columns.index(col)]) is not None
        ]
        if len(rows) < 3:
            continue
        ours = [number(values[(r, col)]) for r in rows]
        paper = [number(pipe.paper_rows[r][pipe.paper_columns.index(col)]) for r in rows]
        out[col] = {
            "rows": len(rows),
            "tau": kendall_tau_b(ours, paper),
            "best_ours": rows[ours.index(max(ours))],
            "best_paper": rows[paper.index(max(paper))],
        }
    return out


def agreement_lines(why: list[str], ranks: dict[str, dict], paper: str = "paper") -> list[str]:
    """The markdown lines at the top of NAME.md: comparable or not (and why), then the rank agreement; without a
    `paper`, the one line that there is nothing to compare with."""
    if not paper:
        return [f"**Comparable with a paper: no** — {NO_PAPER}; the table shows ours only."]
    lines = [
        f"**Comparable with the paper: {'no' if why else 'yes'}**"
        + (
            f" — {'; '.join(why)}."
            if why
            else " (the paper's data set, backbones, rounds, seeds and images per class)."
        )
    ]
    if not ranks:
        return lines + ["", "Rank agreement: fewer than 3 rows with numbers on both sides in every column."]
    exact = sum(r["tau"] == 1 for r in ranks.values())
    best = sum(r["best_ours"] == r["best_paper"] for r in ranks.values())
    tau = lambda r: "n/a" if r["tau"] is None else f"{r['tau']:.2f}"
    cells = "; ".join(
        f"{c} {tau(r)} ({r['rows']} rows"
        + ("" if r["best_ours"] == r["best_paper"] else f", best: ours {r['best_ours']}, paper {r['best_paper']}")
        + ")"
        for c, r in ranks.items()
    )
    return lines + [
        "",
        f"**Does the paper's ranking hold?** Its order of rows holds exactly in {exact} of "
        f"{len(ranks)} columns, and its best row is ours too in {best} of {len(ranks)}. Kendall's "
        f"τ-b per column (1 = the paper's order, 0 = unrelated, −1 = reversed): {cells}.",
    ]
