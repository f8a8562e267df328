"""`featcache report`: result JSON files -> a markdown table (mean(std) over seeds, communication) and a PNG of
accuracy curves. Used by the CLI and the reproduction pipelines."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError


def load_results(paths) -> list[dict]:
    results = []
    for p in paths:
        try:
            results.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read result file {p}: {e}") from None
    return results


def fmt(mean: float, std: float) -> str:
    return f"{mean:.2f}({std:.2f})"


def markdown_table(results: list[dict]) -> str:
    """One row per run: algorithm, final mean(std) over seeds, best-round mean(std), worst-20 %, uploads."""
    rows = ["| algorithm | final acc % | best-round acc % | worst 20 % | params up / client / round | seeds |",
            "|---|---|---|---|---|---|"]
    for r in results:
        w20 = r["fairness"]["worst_20"]
        rows.append(f"| {r['algo']} | {fmt(r['mean_acc'], r['std_acc'])} | "
                    f"{fmt(r['best_round_mean_acc'], r['best_round_std_acc'])} | {fmt(*w20)} | "
                    f"{r['params_uploaded_per_round']:,} | {len(r['seeds'])} |")
    return "\n".join(rows) + "\n"


def curves_png(results: list[dict], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot(r["curve"]["rounds"], r["curve"]["mean_acc"], label=r["algo"])
    ax.set_xlabel("round")
    ax.set_ylabel("mean client test accuracy (%)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: list[str | Path], out: str | Path | None = None) -> dict:
    """Render the table (returned, and written to OUT/report.md with OUT/curves.png when `out` is given)."""
    loaded = load_results(results)
    if not loaded:
        raise UserError("no result files given: pass runs/*.json")
    table = markdown_table(loaded)
    written = {}
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(table)
        curves_png(loaded, out / "curves.png")
        written = {"markdown": str(out / "report.md"), "figure": str(out / "curves.png")}
    return {"table": table, **written}
