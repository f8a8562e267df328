"""What a report says about its runs: labels and a title, the markdown table, and the numbers its figures draw (the
result's curves with their std over seeds from its `.metrics.csv` sidecar, the per-client accuracies). std is always
the sample std (ddof=1)."""

from __future__ import annotations

import ast
import csv
import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..extraction.partition.spec import DIRICHLET
from ..runs.metrics import CSV_COLUMNS
from .load import Run, cache_of, is_number

CSV_TOLERANCE = 0.05  # percentage points: a metrics.csv whose seed means differ more from its result's curve is stale


def fmt(mean: float, std: float) -> str:
    return f"{mean:.2f}({std:.2f})"


def fmt_global(r: dict) -> str:
    """The global model's test accuracy mean(std), or "n/a" (no global model, or a result file without the metric)."""
    mean, std = r.get("global_mean_acc"), r.get("global_std_acc")
    return fmt(mean, std) if is_number(mean) and is_number(std) else "n/a"


def _settings(r: dict) -> dict:
    cfg = r.get("config") if isinstance(r.get("config"), dict) else {}
    return {"algo": r["algo"], **cfg, "seeds": ",".join(map(str, r["seeds"]))}


def _defaults(algo: str) -> dict:
    """The resolved default settings of a registered algorithm ({} for one this featcache does not know)."""
    try:
        from ..algorithms import create
        from ..training.config import resolve

        return resolve(create(algo))
    except Exception:
        return {}


def labels(results: list[dict], numbered: bool = True) -> list[str]:
    """Each run named by the settings that differ between the files: the algorithm when only it differs
    (`fedpcl`), else `fedpcl terms=global` / `lr=0.01 seeds=0,1`; runs that differ in nothing get #1, #2, ...
    (`numbered`; a sweep tells them apart by their caches). A setting that differs only because the algorithms'
    defaults differ (every file at its algorithm's default) does not name a run."""
    every = [_settings(r) for r in results]
    defaults = {a: _defaults(a) for a in {r["algo"] for r in results}}
    keys = list(dict.fromkeys(k for s in every for k in s))
    text = lambda v: json.dumps(v, sort_keys=True)
    differ = [
        k
        for k in keys
        if len({text(s.get(k)) for s in every}) > 1
        and (
            k in ("algo", "seeds")
            or any(
                k in s and (k not in defaults[s["algo"]] or text(s[k]) != text(defaults[s["algo"]][k])) for s in every
            )
        )
    ]
    out = []
    for s in every:
        parts = [s["algo"]] if "algo" in differ or not differ else []
        parts += [f"{k}={s.get(k, '—')}" for k in differ if k != "algo"]
        out.append(" ".join(parts))
    if numbered and len(set(out)) < len(out):  # identical settings: tell the rows apart by position
        out = [f"{label} #{i + 1}" for i, label in enumerate(out)]
    return out


# Settings a title leaves out: stated on their own (rounds, seeds) or only how often the curve is drawn.
UNTITLED = ("rounds", "seed", "eval_every")


def partition_text(r: dict) -> str:
    """`label partition α=0.5, 10 clients, 10 train / 50 test images per class`: the cache's partition as its
    result records it (only the client count for a result without it)."""
    p = cache_of(r).get("partition")
    clients = r.get("clients")
    if not isinstance(p, dict) or not p:
        return f"{clients} clients" if isinstance(clients, int) else "partition not recorded"
    return partition_words(p, clients)


def partition_words(p: dict, clients) -> str:
    """A partition's words; a key `p` lacks (a sweep's caches differ in it) is left out."""
    scheme = p.get("scheme")
    words = [f"α={p['alpha']:g}"] if scheme in DIRICHLET and is_number(p.get("alpha")) else []
    if scheme == "pathological" and p.get("classes_per_client") is not None:
        words.append(f"{p['classes_per_client']} classes per client")
    words += [f"{clients} clients"] if isinstance(clients, int) else []
    caps = [f"{p[k]} {side}" for k, side in (("per_class", "train"), ("test_per_class", "test")) if p.get(k)]
    words += [f"{' / '.join(caps)} images per class per client"] if caps else []
    words += [f"domains {', '.join(p['domains'])}"] if p.get("domains") else []
    words += [f"tested on held-out {p['holdout_domain']}"] if p.get("holdout_domain") else []
    head = [f"{scheme} partition" + (f" {words.pop(0)}" if words[:1] and words[0][0] == "α" else "")] if scheme else []
    return ", ".join(head + words)  # `label partition α=0.5, 10 clients`, `feature partition, 4 clients`


def shared_text(results: list[dict]) -> str:
    """The settings every run has with the same value (`lr=0.001 batch_size=32 ...`), rounds and seeds aside."""
    configs = [r.get("config") if isinstance(r.get("config"), dict) else {} for r in results]
    text = lambda v: json.dumps(v, sort_keys=True)
    same = [
        k
        for k in configs[0]
        if k not in UNTITLED and all(k in c and text(c[k]) == text(configs[0][k]) for c in configs)
    ]
    return " ".join(f"{k}={configs[0][k]}" for k in same)


def title(results: list[dict]) -> str:
    """What the whole table is about: `offline-digits cache 4aca237fe6b6d7b8: label partition α=0.5, 10 clients, 10
    train / 50 test images per class per client; backbones b0, b1; 50 rounds; shared settings lr=0.001 ...; seeds
    0,1,2`."""
    caches = {(cache_of(r).get("dataset"), cache_of(r).get("key")): r for r in results}
    names = ", ".join(
        f"{d or '?'} cache {k[:16]}: {partition_text(r)}" if isinstance(k, str) else "cache not recorded"
        for (d, k), r in sorted(caches.items(), key=lambda kv: str(kv[0]))
    )
    backbones = sorted({", ".join(r.get("backbones") or cache_of(r).get("backbones") or ["?"]) for r in results})
    rounds = sorted({str((r.get("config") or {}).get("rounds", "?")) for r in results})
    seeds = sorted({",".join(map(str, r["seeds"])) for r in results})
    shared = shared_text(results)
    return (
        f"{names}; backbones {' / '.join(backbones)}; {' / '.join(rounds)} rounds"
        + (f"; shared settings {shared}" if shared else "")
        + f"; seeds {' / '.join(seeds)}"
    )


def markdown_table(results: list[dict]) -> str:
    """A title (cache, seeds), then one row per run: its label (the settings that differ between the runs), final
    mean(std) over seeds, best-round mean(std), the global model's accuracy ("n/a" without one), worst-20 %, uploads.
    std is the sample std over seeds (ddof=1; 0 with one seed)."""
    rows = [
        f"**{title(results)}** — mean(std) over seeds, std = sample std (ddof=1; 0 with one seed)",
        "",
        "| run | final acc % | best-round acc % | global acc % | worst 20 % | params up / client / round | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, label in zip(results, labels(results)):
        w20 = r["fairness"]["worst_20"]
        rows.append(
            f"| {label} | {fmt(r['mean_acc'], r['std_acc'])} | "
            f"{fmt(r['best_round_mean_acc'], r['best_round_std_acc'])} | {fmt_global(r)} | {fmt(*w20)} | "
            f"{r['params_uploaded_per_round']:,} | {len(r['seeds'])} |"
        )
    return "\n".join(rows) + "\n"


# -- per-seed curves from metrics.csv ----------------------------------------------------------------------------------


def metrics_csv(result_file: Path) -> Path:
    """The `.metrics.csv` sidecar `train` writes beside `result_file` (NAME.json -> NAME.metrics.csv)."""
    return result_file.with_suffix(".metrics.csv")


def read_metrics(path: Path) -> list[dict] | None:
    """The rows of a metrics.csv (round, seed, client, split, loss, accuracy, global_accuracy), None when there is
    none; one UserError line when there is one that is not a metrics.csv of `featcache train` (its columns or a
    cell of the wrong type): a figure is drawn from what a run wrote, or not at all."""
    if not path.is_file():
        return None
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        why = f"unreadable ({type(e).__name__})"
    else:
        why = _metrics_problem(reader.fieldnames, rows)
    if why is None:
        return rows or None
    raise UserError(
        f"{path} is not a metrics.csv of `featcache train` ({why}): delete it (the figures then draw "
        "no std band) or re-run the training that wrote its result"
    )


def _metrics_problem(columns, rows: list[dict]) -> str | None:
    """Why a parsed metrics.csv is not `train`'s (None when it is): its header, then each row's cells."""
    if list(columns or ()) != list(CSV_COLUMNS):
        return f"its columns are not {','.join(CSV_COLUMNS)}"
    for i, row in enumerate(rows, start=2):
        if None in row or None in row.values():  # more or fewer cells than columns
            return f"line {i} does not have {len(CSV_COLUMNS)} cells"
        try:
            ok = all(int(row[k]) >= 0 for k in ("round", "seed", "client")) and row["split"] in ("train", "test")
            ok = ok and all(
                row[k] == "" or not math.isnan(float(row[k])) for k in ("loss", "accuracy", "global_accuracy")
            )
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return f"line {i} is not round,seed,client as integers, split train/test and numbers"
    return None


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
    for name, key, split, column, percent in (
        ("accuracy", "mean_acc", "test", "accuracy", True),
        ("global", "global_acc", "test", "global_accuracy", True),
        ("loss", "train_loss", "train", "loss", False),
    ):
        mean = curve.get(key)
        if not (isinstance(mean, list) and len(mean) == len(rounds) and all(is_number(v) for v in mean)):
            continue
        values = per_seed(rows, split, column, rounds, seeds) if rows and len(seeds) > 1 else None
        if values is not None:
            values = (
                _in_percent(values, mean)
                if percent
                else (
                    values
                    if np.abs(values.mean(1) - np.asarray(mean)).max() <= 1e-3 * max(1.0, max(map(abs, mean)))
                    else None
                )
            )
        std = values.std(1, ddof=1) if values is not None else None
        out[name] = Series(rounds, np.asarray(mean, dtype=np.float64), std)
    return out


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
    if isinstance(flat, list) and flat and all(is_number(v) for v in flat):
        return np.asarray(flat, dtype=np.float64), None
    return None


def client_domains(run: Run) -> list | None:
    """Each client's domain where known: from the partition's own domain list (client i owns domain i mod n), else
    from the cache its provenance names (`--cache X`), when that file is still there under the result's key; None
    when neither tells."""
    r = run.result
    p = cache_of(r).get("partition")
    clients = r.get("clients")
    if not (isinstance(clients, int) and clients > 0):
        return None
    if isinstance(p, dict) and isinstance(p.get("domains"), list) and p["domains"]:
        return [p["domains"][c % len(p["domains"])] for c in range(clients)]
    for path in _named_caches(run):
        from ..cache.h5 import peek_attrs  # lazy: h5py loads only where a figure names clients

        attrs = peek_attrs(path, ("key", "counts")) or {}
        if attrs.get("key") == cache_of(r).get("key"):
            try:
                counts = json.loads(attrs["counts"]) if isinstance(attrs.get("counts"), str) else attrs.get("counts")
                names = [row.get("domain") for row in counts["clients"]]
            except (KeyError, TypeError, AttributeError, ValueError):
                return None
            return names if len(names) == clients else None
    return None


def _named_caches(run: Run) -> list[Path]:
    """The files the result's provenance names as its cache (`--cache X` of a command, `cache='X'` of a library
    call), each as given (relative: to the current folder) and beside the result's folder and its parent."""
    prov = run.result.get("provenance") if isinstance(run.result.get("provenance"), dict) else {}
    named = []
    if isinstance(prov.get("command"), str):
        try:
            argv = shlex.split(prov["command"])
        except ValueError:
            argv = []
        named += [b for a, b in zip(argv, argv[1:]) if a == "--cache"]
        named += [a.split("=", 1)[1] for a in argv if a.startswith("--cache=")]
    if isinstance(prov.get("call"), str):
        for quoted in re.findall(r"\bcache=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")", prov["call"]):
            try:
                named.append(str(ast.literal_eval(quoted)))
            except (ValueError, SyntaxError):
                pass
    places = [Path(), run.path.parent, run.path.parent.parent]
    found = [Path(n) if Path(n).is_absolute() else place / n for n in named if n for place in places]
    return list(dict.fromkeys(found))
