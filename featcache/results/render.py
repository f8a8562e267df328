"""`featcache report`: result files of `featcache train` -> a markdown table and PNG figures. Used by the CLI and the
reproduction pipelines.

Inputs: result files and folders (`load.load_inputs`). Results of one cache: a table of runs. Results of several
caches (a sweep: `extract --alpha 0.1,1,10`, then `train` on each) are keyed by the cache parameter that differs
between them, read from each result's own record of its cache (`sweep.PARAMETERS`; `x` picks one when several
differ): a table of points and `sweep.png`, final accuracy against it. Written to OUT: `report.md` (the table and
the figures' links), `curves.png` (test accuracy per evaluation round, with the global model's accuracy and the mean
local training loss where the results hold them; a shaded ±1 std band over seeds where the result's `.metrics.csv`
sidecar holds the per-seed numbers), `clients.png` (final accuracy per client, one group of bars per run, error bars
±1 std over seeds) and, for a sweep, `sweep.png`. std is always the sample std (ddof=1).
"""

from __future__ import annotations

from pathlib import Path

from ..atomic import check_folder
from ..errors import UserError
from .figures import REPORT_MARK, clients_png, curves_png, sweep_png, write_report
from .load import load_inputs
from .search import is_search, search_report
from .sweep import PARAMETERS, caches, choose_x, sweep, sweep_points, sweep_table, sweep_title, text
from .tables import markdown_table


def report(results: list[str | Path], out: str | Path | None = None, x: str | None = None, note=None) -> dict:
    """Render result files and folders (see `load_inputs`) as a markdown table, returned under `table` with the
    skipped inputs' notes under `skipped` (also passed, one line each, to `note`). Results of several caches are a
    sweep over the cache parameter that differs (`x` names it when several do: alpha, clients, partition, ...; see
    `sweep.PARAMETERS`): one row per point, and `x` and `points` (x, line, personal and global accuracy mean/std,
    cache, result file) in the answer. With `out`, also writes OUT/report.md, OUT/curves.png, OUT/clients.png and,
    for a sweep, OUT/sweep.png, all of them or none (`figures.write_report`). A search's run folder (`featcache
    search`) is reported alone, by `search.search_report`."""
    searches = [p for p in results if is_search(p)]
    if searches:
        if len(results) > 1:
            raise UserError(f"{searches[0]} is a search's run folder: report it alone")
        if x is not None:
            raise UserError(f"{searches[0]} is a search's run folder: its report has no --x, drop it")
        return search_report(searches[0], out)
    if out:
        check_folder(out)
    inputs = load_inputs(results)
    for line in inputs.notes() if note is not None else ():
        note(line)
    runs = inputs.runs
    loaded = [run.result for run in runs]
    swept = None
    if caches(loaded) > 1 or x is not None:
        swept = sweep(runs, choose_x(loaded, x))
        runs = [p.run for p in swept.points]
        table = sweep_table(swept)
    else:
        table = markdown_table(loaded)
    answer = {"table": table, "skipped": inputs.notes()}
    if swept is not None:
        answer |= {"x": swept.x, "points": sweep_points(swept)}
    if not out:
        return answer
    names, heading = None, None
    if swept is not None:
        label = PARAMETERS[swept.x].label
        names = [f"{label}={text(p.x)} · {p.line}" for p in swept.points]
        heading = sweep_title(swept)
    figures = {  # drawn before any write
        "curves.png": curves_png(runs, names=names, heading=heading),
        "clients.png": clients_png(runs, names=names, heading=heading),
    } | ({"sweep.png": sweep_png(swept)} if swept is not None else {})
    links = [("accuracy vs the swept parameter", "sweep.png")] * (swept is not None) + [
        ("accuracy curves", "curves.png"),
        ("per-client accuracy", "clients.png"),
    ]
    markdown = f"<!-- {REPORT_MARK} -->\n" + table + "".join(f"\n![{alt}]({name})\n" for alt, name in links)
    write_report(out, figures | {"report.md": markdown})
    return (
        answer
        | {
            "markdown": str(Path(out) / "report.md"),
            "figure": str(Path(out) / "curves.png"),
            "clients_figure": str(Path(out) / "clients.png"),
        }
        | ({"sweep_figure": str(Path(out) / "sweep.png")} if swept is not None else {})
    )
