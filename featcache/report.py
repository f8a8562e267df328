"""`featcache report`: result files of `featcache train` -> a markdown table and PNG figures. Used by the CLI and the
reproduction pipelines.

Inputs are any mix of result files and folders. A folder stands for the `*.json` files directly in it (one level:
a grid's run folder inside `runs/` holds chunk files, not results; pass that folder itself to report its retrained
result). Files that are not results are skipped with one note each; the sidecars `train` writes beside a result
(`.timing.json`, `.metrics.csv`, `.state.safetensors`) share one note. Results from different caches are refused.

Written to OUT: `report.md` (the table and the figures' links), `curves.png` (test accuracy per evaluation round,
with the global model's accuracy and the mean local training loss where the results hold them; a shaded ±1 std band
over seeds where the result's `.metrics.csv` sidecar holds the per-seed numbers) and `clients.png` (final accuracy
per client, one group of bars per run, error bars ±1 std over seeds). std is always the sample std (ddof=1).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .atomic import check_folder, write_atomic, write_together
from .errors import UserError
from .metrics import CSV_COLUMNS

_NUMBERS = ("mean_acc", "std_acc", "best_round_mean_acc", "best_round_std_acc")

# What `train` writes beside a result `NAME.json`: never results themselves, skipped together in one note.
SIDECARS = {".timing.json": "a .timing.json sidecar", ".metrics.csv": "a .metrics.csv sidecar",
            ".state.safetensors": "a saved state (.state.safetensors): draw it with `featcache plot`"}
MAX_RESULT_BYTES = 64 * 2**20  # a result file is a few kB; a larger input is some other file, not read
CSV_TOLERANCE = 0.05  # percentage points: a metrics.csv whose seed means differ more from its result's curve is stale


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
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in r["seeds"]):
        return "'seeds' is not a list of integers"
    curve = r.get("curve")
    if not isinstance(curve, dict):
        return "no accuracy 'curve'"
    rounds, acc = curve.get("rounds"), curve.get("mean_acc")
    if not (isinstance(rounds, list) and isinstance(acc, list) and rounds and len(rounds) == len(acc)
            and all(_number(v) for v in rounds + acc)):
        return "'curve' needs lists 'rounds' and 'mean_acc' of numbers, of the same length"
    return None


@dataclass
class Run:
    """One result file: where it is and what it holds."""

    path: Path
    result: dict


@dataclass
class Inputs:
    """The inputs sorted out: results, sidecar files (one note for all of them), other files skipped (one note each)."""

    runs: list[Run] = field(default_factory=list)
    sidecars: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def notes(self) -> list[str]:
        """One line per skipped input, sidecars in one line."""
        lines = []
        if self.sidecars:
            kinds = {}
            for p in self.sidecars:
                kinds[_sidecar(p)] = kinds.get(_sidecar(p), 0) + 1
            lines.append(f"skipped {len(self.sidecars)} sidecar file(s) beside the results ("
                         f"{', '.join(f'{k} x{n}' for k, n in kinds.items())}): not result files")
        return lines + [f"skipped {line}" for line in self.skipped]


def _sidecar(p: Path) -> str | None:
    return next((suffix for suffix in SIDECARS if p.name.endswith(suffix)), None)


def expand(paths) -> tuple[list[Path], list[Path]]:
    """(files, folders' files): each folder replaced by the `*.json` files directly in it, sorted by name; a path
    given twice (directly or through its folder) is kept once. A path that does not exist is refused."""
    given, found, seen = [], [], set()
    for p in map(Path, paths):
        if not (p.is_file() or p.is_dir()):
            raise UserError(f"result file {p} does not exist: pass result files or folders holding them")
        files = [p] if p.is_file() else [f for f in sorted(p.glob("*.json")) if f.is_file()]
        for f in files:
            if f.resolve() not in seen:
                seen.add(f.resolve())
                (given if p.is_file() else found).append(f)
    return given, found


def _parse(p: Path) -> tuple[dict | None, str | None]:
    """(result, None) for a result file, else (None, why it is not one)."""
    try:
        if p.stat().st_size > MAX_RESULT_BYTES:
            return None, f"{p.stat().st_size / 2**20:.0f} MB, too large for a result file"
        parsed = json.loads(p.read_bytes().decode("utf-8"))
    except OSError as e:
        raise UserError(f"cannot read result file {p}: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        kind = p.suffix.lower() if p.suffix.lower() not in ("", ".json") else "binary"
        return None, f"not JSON (a {kind} file?)"
    why = result_problem(parsed)
    return (parsed, None) if why is None else (None, why)


def load_inputs(paths) -> Inputs:
    """Sort result files from the rest. A single file that is not a result file is refused (the user named it); among
    several inputs, or in a folder, it is skipped (a glob such as runs/* picks up the sidecars)."""
    paths = list(paths)
    given, found = expand(paths)
    if not given and not found:
        raise UserError(f"no .json files in {', '.join(map(str, paths))}: pass the result JSON files of "
                        "`featcache train` or the folder holding them, e.g. runs/")
    single = len(given) == 1 and not found and len(paths) == 1
    inputs = Inputs()
    for p in given + found:
        kind = _sidecar(p)
        result, why = (None, SIDECARS[kind]) if kind else _parse(p)
        if result is not None:
            inputs.runs.append(Run(p, result))
        elif single:
            raise UserError(f"{p} is not a featcache result file: {why}")
        elif kind:
            inputs.sidecars.append(p)
        else:
            inputs.skipped.append(f"{p}: not a result file ({why})")
    if not inputs.runs:
        first = inputs.notes()[0]
        raise UserError(f"none of the {len(given) + len(found)} inputs is a featcache result file ({first}): pass the "
                        "result JSON files of `featcache train` or their folder, e.g. runs/*.json or runs/")
    return inputs


def load_results(paths, note=None) -> list[dict]:
    """The results among `paths` (files and folders, see `load_inputs`); `note` receives one line per skipped input."""
    inputs = load_inputs(paths)
    for line in inputs.notes() if note is not None else ():
        note(line)
    return [run.result for run in inputs.runs]


def fmt(mean: float, std: float) -> str:
    return f"{mean:.2f}({std:.2f})"


def fmt_global(r: dict) -> str:
    """The global model's test accuracy mean(std), or "n/a" (no global model, or a result from before the metric)."""
    mean, std = r.get("global_mean_acc"), r.get("global_std_acc")
    return fmt(mean, std) if _number(mean) and _number(std) else "n/a"


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
        from .training.config import resolve

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
    mean(std) over seeds, best-round mean(std), the global model's accuracy ("n/a" without one), worst-20 %, uploads.
    std is the sample std over seeds (ddof=1; 0 with one seed)."""
    rows = [f"**{title(results)}** — mean(std) over seeds, std = sample std (ddof=1; 0 with one seed)", "",
            "| run | final acc % | best-round acc % | global acc % | worst 20 % | params up / client / round | seeds |",
            "|---|---|---|---|---|---|---|"]
    for r, label in zip(results, labels(results)):
        w20 = r["fairness"]["worst_20"]
        rows.append(f"| {label} | {fmt(r['mean_acc'], r['std_acc'])} | "
                    f"{fmt(r['best_round_mean_acc'], r['best_round_std_acc'])} | {fmt_global(r)} | {fmt(*w20)} | "
                    f"{r['params_uploaded_per_round']:,} | {len(r['seeds'])} |")
    return "\n".join(rows) + "\n"


# -- per-seed curves from metrics.csv ----------------------------------------------------------------------------------

def metrics_csv(result_file: Path) -> Path:
    """The `.metrics.csv` sidecar `train` writes beside `result_file` (NAME.json -> NAME.metrics.csv)."""
    return result_file.with_suffix(".metrics.csv")


def read_metrics(path: Path) -> list[dict] | None:
    """The rows of a metrics.csv (round, seed, client, split, loss, accuracy, global_accuracy), or None when there
    is none or it cannot be read as one."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error):
        return None
    return rows if rows and set(CSV_COLUMNS) <= set(rows[0]) else None


def per_seed(rows: list[dict], split: str, column: str, rounds: list[int], seeds: list[int]) -> np.ndarray | None:
    """[R, S]: `column` of the `split` rows averaged over the clients that have a value, per evaluation round and
    seed; None when a round or seed has no value (the file does not cover the curve)."""
    sums, counts = np.zeros((len(rounds), len(seeds))), np.zeros((len(rounds), len(seeds)))
    at_round, at_seed = {r: i for i, r in enumerate(rounds)}, {s: j for j, s in enumerate(seeds)}
    for row in rows:
        try:
            i, j = at_round.get(int(row["round"])), at_seed.get(int(row["seed"]))
            value = float(row[column]) if row["split"] == split and row[column] not in ("", None) else None
        except (TypeError, ValueError):
            return None
        if i is not None and j is not None and value is not None and math.isfinite(value):
            sums[i, j] += value
            counts[i, j] += 1
    return sums / counts if counts.all() else None


def _in_percent(values: np.ndarray, curve: list) -> np.ndarray | None:
    """values [R, S] (fractions or %) in %, when their mean over seeds is the result's own curve [R] (in %); None
    when it is not (a stale or foreign metrics.csv)."""
    target = np.asarray(curve, dtype=np.float64)
    for scale in (100.0, 1.0):
        if np.abs(values.mean(1) * scale - target).max() <= CSV_TOLERANCE:
            return values * scale
    return None


@dataclass
class Series:
    """One line of a figure: mean [R] over seeds, and std [R] over seeds (ddof=1) when the per-seed values are known."""

    rounds: list
    mean: np.ndarray
    std: np.ndarray | None = None


def series(run: Run) -> dict[str, Series]:
    """A run's curves by name (`accuracy`, `global`, `loss`): the result's own means, with the std over seeds from
    its metrics.csv when that file exists, covers every evaluation round and seed, and agrees with the means."""
    r, curve = run.result, run.result["curve"]
    rounds, seeds = [int(v) for v in curve["rounds"]], [int(s) for s in r["seeds"]]
    rows = read_metrics(metrics_csv(run.path))
    out = {}
    for name, key, split, column, percent in (("accuracy", "mean_acc", "test", "accuracy", True),
                                              ("global", "global_acc", "test", "global_accuracy", True),
                                              ("loss", "train_loss", "train", "loss", False)):
        mean = curve.get(key)
        if not (isinstance(mean, list) and len(mean) == len(rounds) and all(_number(v) for v in mean)):
            continue
        values = per_seed(rows, split, column, rounds, seeds) if rows and len(seeds) > 1 else None
        if values is not None:
            values = _in_percent(values, mean) if percent else (
                values if np.abs(values.mean(1) - np.asarray(mean)).max() <= 1e-3 * max(1.0, max(map(abs, mean)))
                else None)
        std = values.std(1, ddof=1) if values is not None else None
        out[name] = Series(rounds, np.asarray(mean, dtype=np.float64), std)
    return out


# -- figures ---------------------------------------------------------------------------------------------------------

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
    data = png(fig, MARK)
    if path is not None:
        write_atomic(path, data)
    return data


MARK = "featcache report"  # in report.md's first line and the PNGs' Software text: files this command may replace


def written_by_us(path: Path) -> bool:
    """Whether the file at `path` is one `featcache report` wrote (so a new report may replace it)."""
    if path.suffix != ".md":
        return png_mark(path) == MARK
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip() == f"<!-- {MARK} -->"
    except (OSError, UnicodeDecodeError):
        return False


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


def per_client(r: dict) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Final test accuracy per client: (mean [C], std [C] over seeds, ddof=1, None with one seed), or None when the
    result holds no per-client numbers."""
    rows = r.get("per_client_per_seed")
    try:
        acc = np.asarray(rows, dtype=np.float64)  # [S, C]
    except (TypeError, ValueError):
        acc = None
    if acc is not None and acc.ndim == 2 and acc.size and np.isfinite(acc).all():
        return acc.mean(0), acc.std(0, ddof=1) if acc.shape[0] > 1 else None
    flat = r.get("per_client")
    if isinstance(flat, list) and flat and all(_number(v) for v in flat):
        return np.asarray(flat, dtype=np.float64), None
    return None


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


# -- the command -----------------------------------------------------------------------------------------------------

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
        markdown = f"<!-- {MARK} -->\n" + table + "\n![accuracy curves](curves.png)\n\n![per-client accuracy](clients.png)\n"
        theirs = [n for n in (*figures, "report.md") if (Path(out) / n).exists() and not written_by_us(Path(out) / n)]
        if theirs:
            raise UserError(f"--out {out}: {theirs[0]} exists and was not written by `featcache report`: pass another "
                            "--out or move it (a report never overwrites a file it did not write)")
        write_together([(Path(out) / name, body) for name, body in (figures | {"report.md": markdown}).items()])
        written = {"markdown": str(Path(out) / "report.md"), "figure": str(Path(out) / "curves.png"),
                   "clients_figure": str(Path(out) / "clients.png")}
    return {"table": table, "skipped": inputs.notes(), **written}
