"""`featcache report`: result files of `featcache train` -> a markdown table and PNG figures. Used by the CLI and the
reproduction pipelines.

Inputs: result files and folders (`load.load_inputs`). Written to OUT: `report.md` (the table and the figures' links),
`curves.png` (test accuracy per evaluation round, with the global model's accuracy and the mean local training loss
where the results hold them; a shaded ±1 std band over seeds where the result's `.metrics.csv` sidecar holds the
per-seed numbers) and `clients.png` (final accuracy per client, one group of bars per run, error bars ±1 std over
seeds). std is always the sample std (ddof=1).
"""

from __future__ import annotations

from pathlib import Path

from ..atomic import check_folder, write_together
from ..errors import UserError
from .figures import REPORT_MARK, clients_png, curves_png, png_mark
from .load import check_one_cache, load_inputs
from .tables import markdown_table


def written_by_us(path: Path) -> bool:
    """Whether the file at `path` is one `featcache report` wrote (so a new report may replace it)."""
    if path.suffix != ".md":
        return png_mark(path) == REPORT_MARK
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip() == f"<!-- {REPORT_MARK} -->"
    except (OSError, UnicodeDecodeError):
        return False


def report(results: list[str | Path], out: str | Path | None = None, note=None) -> dict:
    """Render result files and folders (see `load_inputs`) as a markdown table, returned under `table` with the
    skipped inputs' notes under `skipped` (also passed, one line each, to `note`). With `out`, also writes
    OUT/report.md, OUT/curves.png and OUT/clients.png, all three or none."""
    if out:
        check_folder(out)
    inputs = load_inputs(results)
    for line in inputs.notes() if note is not None else ():
        note(line)
    loaded = [run.result for run in inputs.runs]
    check_one_cache(loaded, [str(run.path) for run in inputs.runs])
    table = markdown_table(loaded)
    written = {}
    if out:
        figures = {"curves.png": curves_png(inputs.runs), "clients.png": clients_png(inputs.runs)}  # before any write
        markdown = (
            f"<!-- {REPORT_MARK} -->\n"
            + table
            + "\n![accuracy curves](curves.png)\n\n![per-client accuracy](clients.png)\n"
        )
        theirs = [n for n in (*figures, "report.md") if (Path(out) / n).exists() and not written_by_us(Path(out) / n)]
        if theirs:
            raise UserError(
                f"--out {out}: {theirs[0]} exists and was not written by `featcache report`: pass another "
                "--out or move it (a report never overwrites a file it did not write)"
            )
        write_together([(Path(out) / name, body) for name, body in (figures | {"report.md": markdown}).items()])
        written = {
            "markdown": str(Path(out) / "report.md"),
            "figure": str(Path(out) / "curves.png"),
            "clients_figure": str(Path(out) / "clients.png"),
        }
    return {"table": table, "skipped": inputs.notes(), **written}
