"""`featcache report` of a search's run folder (`featcache search`): its trials as a markdown table sorted by
validation (completed trials first), a completed trial's score after its last round apart from a stopped one's at the
round it stopped (a rung's score is not comparable with a last round's), and `search.png`, validation accuracy against
rounds, each line named by its settings, the pruned trials drawn apart (grey, a cross where each stopped) and the
rungs marked.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..atomic import check_folder
from ..errors import UserError
from .figures import REPORT_MARK, png, pyplot, write_report


def is_search(path: str | Path) -> bool:
    """Whether `path` is a finished search's run folder (it holds search.json)."""
    return (Path(path) / "search.json").is_file()


def load_search(folder: str | Path) -> dict:
    """A finished search's result (its search.json), checked for what the report reads."""
    path = Path(folder) / "search.json"
    try:
        result = json.loads(path.read_text())
        assert isinstance(result["selection"], list) and result["selection"]
        assert all(isinstance(r["curve"], list) and (r["curve"] or r["state"] == "failed") for r in result["selection"])
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise UserError(f"{path} is not a search result of `featcache search`: run the search again") from None
    return result


def stopped_at(row: dict, rungs: list[int]) -> tuple[str, str]:
    """(round, rung) a trial stopped (or failed) at, as the table writes them: '-' for a completed trial."""
    if row["state"] == "complete":
        return "-", "-"
    r = row["rounds_trained"]
    return str(r), str(sum(1 for at in rungs if at <= r))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def settings(result: dict, row: dict) -> str:
    """A trial's searched settings, as `--set` writes them."""
    return ", ".join(f"{k}={_fmt(row['config'][k])}" for k in result["space"])


def search_table(result: dict) -> str:
    """The trials as a markdown table, sorted as the search sorted them (by validation, completed trials first)."""
    keys = list(result["space"])
    retrain = result.get("retrain")
    lines = [
        f"**{result['algo']} search**: {len(result['selection'])} trials x {len(result['seeds'])} seeds, "
        f"{result['sampler']} sampler, {result['pruner']} pruner (rungs at rounds "
        f"{', '.join(map(str, result['rungs'])) or 'none'}, η = {result['reduction']}); "
        f"{result['model_rounds']} of {result['model_rounds_unpruned']} model-rounds trained.",
        "",
        f"Best: {result['best']}"
        + (
            f", retrained on the full train split: test acc {retrain['mean_acc']:.2f}({retrain['std_acc']:.2f}) %."
            if retrain
            else "."
        ),
        "",
        "| rank | trial | "
        + " | ".join(keys)
        + " | val acc % mean(std), last round | val acc % mean(std) where stopped | state | stopped at round | rung |",
        "|---" * (len(keys) + 7) + "|",
    ]
    for rank, r in enumerate(result["selection"], 1):
        rnd, rung = stopped_at(r, result["rungs"])
        cells = [str(rank), str(r["trial"]), *(_fmt(r["config"][k]) for k in keys)]
        score = "-" if r["val_mean"] is None else f"{r['val_mean']:.2f}({r['val_std']:.2f})"
        cells += [score, "-"] if r["state"] == "complete" else ["-", score]
        cells += [r["state"], rnd, rung]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [f"- trial {r['trial']} failed: {r['reason']}" for r in result["selection"] if r.get("reason")]
    return "\n".join(lines + ([""] + failed if failed else [])) + "\n"


def search_png(result: dict) -> bytes:
    """Validation accuracy against rounds, one line per trial: completed trials in colour (the best thickest), each
    named by its settings, pruned ones grey and thin with a cross where each stopped, failed ones (NaN/Inf) red up to
    their last score; the rungs as dotted vertical lines."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    best = result["selection"][0]["trial"]
    done = [r for r in result["selection"] if r["state"] == "complete"]
    colours = plt.get_cmap("viridis")
    for r in [r for r in result["selection"] if r["state"] != "complete" and r["curve"]]:
        x, y = zip(*r["curve"])
        grey = "0.6" if r["state"] == "pruned" else "tab:red"
        ax.plot(x, y, color=grey, lw=0.8, alpha=0.7, zorder=1)
        ax.plot(x[-1], y[-1], "x", color=grey, ms=5, zorder=2)
    for k, r in enumerate(done):
        x, y = zip(*r["curve"])
        top = r["trial"] == best
        label = f"trial {r['trial']}: {settings(result, r)}" + (" (best)" if top else "")
        ax.plot(x, y, color=colours(k / max(1, len(done))), lw=2.4 if top else 1.3, zorder=3, label=label)
    for at in result["rungs"]:
        ax.axvline(at, color="0.3", ls=":", lw=1)
    ax.plot([], [], color="0.6", marker="x", lw=0.8, label="pruned (x: stopped)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title(f"{result['algo']}: {result['sampler']} sampler, {result['pruner']} pruner (dotted: rungs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right", ncol=1 + len(done) // 8)
    fig.tight_layout()
    return png(fig, REPORT_MARK)


def search_report(folder: str | Path, out: str | Path | None = None) -> dict:
    """The report of a search's run folder: the markdown table under `table`; with `out`, OUT/report.md and
    OUT/search.png written together."""
    if out:
        check_folder(out)
    result = load_search(folder)
    table = search_table(result)
    answer = {"table": table, "skipped": [], "search": str(folder)}
    if not out:
        return answer

    figure = search_png(result)
    markdown = f"<!-- {REPORT_MARK} -->\n" + table + "\n![validation accuracy vs rounds](search.png)\n"
    write_report(out, {"search.png": figure, "report.md": markdown})
    return answer | {"markdown": str(Path(out) / "report.md"), "figure": str(Path(out) / "search.png")}
