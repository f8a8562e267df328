"""`featcache report`: result JSON files -> a markdown table (mean(std) over seeds, communication) and a PNG of
accuracy curves. Used by the CLI and the reproduction pipelines."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from .atomic import check_folder, write_atomic
from .errors import UserError

_NUMBERS = ("mean_acc", "std_acc", "best_round_mean_acc", "best_round_std_acc")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def result_problem(r) -> str | None:
    """Why a parsed JSON value is not a `featcache train` result file (None when it is one)."""
    if not isinstance(r, dict):
        kind = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(r), "null")
        return f"a JSON {kind}, not an object"
    if "curve" not in r and "seconds_per_round" in r:
        return "a .timing.json sidecar"
    if "selection" in r and "axes" in r:
        return "a grid summary (grid.json): report its retrained result file instead"
    if not isinstance(r.get("algo"), str) or not r["algo"]:
        return "no algorithm name ('algo')"
    for k in _NUMBERS:
        if not _number(r.get(k)):
            return f"'{k}' is missing or not a finite number"
    w20 = (r.get("fairness") or {}).get("worst_20") if isinstance(r.get("fairness"), dict) else None
    if not (isinstance(w20, list) and len(w20) == 2 and all(_number(v) for v in w20)):
        return "'fairness.worst_20' is missing or not [mean, std]"
    if not (isinstance(r.get("params_uploaded_per_round"), int) and not isinstance(r["params_uploaded_per_round"], bool)
            and r["params_uploaded_per_round"] >= 0):
        return "'params_uploaded_per_round' is missing or not a count"
    if not (isinstance(r.get("seeds"), list) and r["seeds"]):
        return "'seeds' is missing or empty"
    curve = r.get("curve")
    if not isinstance(curve, dict):
        return "no accuracy 'curve'"
    rounds, acc = curve.get("rounds"), curve.get("mean_acc")
    if not (isinstance(rounds, list) and isinstance(acc, list) and rounds and len(rounds) == len(acc)
            and all(_number(v) for v in rounds + acc)):
        return "'curve' needs lists 'rounds' and 'mean_acc' of numbers, of the same length"
    return None


def load_results(paths, note=None) -> list[dict]:
    """Parse and check each result file. A file that does not exist is refused; one that is not a result file (a
    timing sidecar, grid.json, other JSON, a binary file) is refused when it is the only one, and skipped with a
    one-line `note` when several files are given (a glob or a folder such as runs/*)."""
    results, skipped = [], []
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.is_file():
            what = f"is a folder: pass the result files in it, e.g. {p / '*.json'}" if p.is_dir() else "does not exist"
            raise UserError(f"result file {p} {what}")
        try:
            parsed = json.loads(p.read_bytes().decode("utf-8"))
            why = result_problem(parsed)
        except OSError as e:
            raise UserError(f"cannot read result file {p}: {e.strerror or e}") from None
        except (UnicodeDecodeError, ValueError, RecursionError):
            why = "not JSON (a binary file?)"
        if why is None:
            results.append(parsed)
        elif len(paths) == 1:
            raise UserError(f"{p} is not a featcache result file: {why}")
        else:
            skipped.append(f"{p}: not a result file ({why})")
    if skipped and not results:
        raise UserError(f"none of the {len(paths)} inputs is a featcache result file ({skipped[0]}"
                        f"{f'; +{len(skipped) - 1} more' if len(skipped) > 1 else ''}): pass the result JSON files "
                        "of `featcache train`, e.g. runs/*.json")
    for line in skipped if note is not None else ():
        note(f"skipped {line}")
    return results


def fmt(mean: float, std: float) -> str:
    return f"{mean:.2f}({std:.2f})"


def _cache_of(r: dict) -> dict:
    c = r.get("cache")
    return c if isinstance(c, dict) else {}


def check_one_cache(results: list[dict], names: list[str] | None = None) -> None:
    """Refuse, in one line, results trained on different caches (their numbers are not comparable in one table)."""
    keys = {}
    for i, r in enumerate(results):
        key = _cache_of(r).get("key")
        if isinstance(key, str):
            keys.setdefault(key, names[i] if names else r["algo"])
    if len(keys) > 1:
        (a, fa), (b, fb) = list(keys.items())[:2]
        raise UserError(f"the results come from {len(keys)} different caches ({fa}: {a[:16]}, {fb}: {b[:16]}): report "
                        "the files of each cache separately")


def _settings(r: dict) -> dict:
    cfg = r.get("config") if isinstance(r.get("config"), dict) else {}
    return {"algo": r["algo"], **cfg, "seeds": ",".join(map(str, r["seeds"]))}


def _defaults(algo: str) -> dict:
    """The resolved default settings of a registered algorithm ({} for one this featcache does not know)."""
    try:
        from .algorithms import create
        from .config import resolve

        return resolve(create(algo))
    except Exception:
        return {}


def labels(results: list[dict]) -> list[str]:
    """Each run named by the settings that differ between the files: the algorithm when only it differs
    (`fedpcl`), else `fedpcl terms=global` / `lr=0.01 seeds=0,1`; runs that differ in nothing get #1, #2, ...
    A setting that differs only because the algorithms' defaults differ (every file at its algorithm's default) does
    not name a run."""
    every = [_settings(r) for r in results]
    defaults = {a: _defaults(a) for a in {r["algo"] for r in results}}
    keys = list(dict.fromkeys(k for s in every for k in s))
    text = lambda v: json.dumps(v, sort_keys=True)
    differ = [k for k in keys if len({text(s.get(k)) for s in every}) > 1 and (
        k in ("algo", "seeds") or any(k in s and (k not in defaults[s["algo"]] or text(s[k]) != text(
            defaults[s["algo"]][k])) for s in every))]
    out = []
    for s in every:
        parts = [s["algo"]] if "algo" in differ or not differ else []
        parts += [f"{k}={s.get(k, '—')}" for k in differ if k != "algo"]
        out.append(" ".join(parts))
    if len(set(out)) < len(out):  # identical settings: tell the rows apart by position
        out = [f"{label} #{i + 1}" for i, label in enumerate(out)]
    return out


def title(results: list[dict]) -> str:
    """`offline-digits cache 4aca237fe6b6d7b8, seeds 0,1,2`: what the whole table is about."""
    caches = {(_cache_of(r).get("dataset"), _cache_of(r).get("key")) for r in results}
    names = ", ".join(f"{d or '?'} cache {k[:16]}" if isinstance(k, str) else "cache not recorded"
                      for d, k in sorted(caches, key=str))
    seeds = sorted({",".join(map(str, r["seeds"])) for r in results})
    return f"{names}; seeds {' / '.join(seeds)}"


def markdown_table(results: list[dict]) -> str:
    """A title (cache, seeds), then one row per run: its label (the settings that differ between the runs), final
    mean(std) over seeds, best-round mean(std), worst-20 %, uploads. std is the sample std over seeds (ddof=1; 0 with
    one seed)."""
    rows = [f"**{title(results)}** — mean(std) over seeds, std = sample std (ddof=1; 0 with one seed)", "",
            "| run | final acc % | best-round acc % | worst 20 % | params up / client / round | seeds |",
            "|---|---|---|---|---|---|"]
    for r, label in zip(results, labels(results)):
        w20 = r["fairness"]["worst_20"]
        rows.append(f"| {label} | {fmt(r['mean_acc'], r['std_acc'])} | "
                    f"{fmt(r['best_round_mean_acc'], r['best_round_std_acc'])} | {fmt(*w20)} | "
                    f"{r['params_uploaded_per_round']:,} | {len(r['seeds'])} |")
    return "\n".join(rows) + "\n"


def curves_png(results: list[dict], path: str | Path | None = None) -> bytes:
    """The accuracy curves as PNG bytes (also written atomically to `path` when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    for r, label in zip(results, labels(results)):
        ax.plot(r["curve"]["rounds"], r["curve"]["mean_acc"], label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_title(title(results), fontsize=9)
    ax.set_xlabel("round")
    ax.set_ylabel("mean client test accuracy (%)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    if path is not None:
        write_atomic(path, buf.getvalue())
    return buf.getvalue()


def report(results: list[str | Path], out: str | Path | None = None, note=None) -> dict:
    """Render the table (returned, and written to OUT/report.md with OUT/curves.png when `out` is given). `note`
    receives one line per input skipped because it is not a result file."""
    if out:
        check_folder(out)
    loaded = load_results(results, note)
    if not loaded:
        raise UserError("no result files among the inputs: pass the result JSON files of `featcache train`, e.g. "
                        "runs/*.json")
    check_one_cache(loaded)
    table = markdown_table(loaded)
    written = {}
    if out:
        out = Path(out)
        png = curves_png(loaded)  # rendered before anything is written
        existed = (out / "curves.png").exists()
        write_atomic(out / "curves.png", png)
        try:
            write_atomic(out / "report.md", table)
        except BaseException:
            if not existed:  # the pair is written together or not at all
                (out / "curves.png").unlink(missing_ok=True)
            raise
        written = {"markdown": str(out / "report.md"), "figure": str(out / "curves.png")}
    return {"table": table, **written}
