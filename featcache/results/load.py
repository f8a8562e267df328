"""Result files of `featcache train`, found and checked: which inputs are results.

Inputs are any mix of result files and folders. A folder stands for the `*.json` files directly in it (one level:
a grid's run folder inside `runs/` holds chunk files, not results; pass that folder itself to report its retrained
result). Files that are not results are skipped with one note each (beyond a few, one note counts them); the
sidecars `train` writes beside a result (`.timing.json`, `.metrics.csv`, `.state.safetensors`) share one note.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, as_list, not_a_file

_NUMBERS = ("mean_acc", "std_acc", "best_round_mean_acc", "best_round_std_acc")

# What `train` writes beside a result `NAME.json`: never results themselves, skipped together in one note.
SIDECARS = {
    ".timing.json": "a .timing.json sidecar",
    ".metrics.csv": "a .metrics.csv sidecar",
    ".state.safetensors": "a saved state (.state.safetensors): draw it with `featcache plot`",
}
SKIPPED_LINES = 3  # more skipped inputs than this are told in one line: their count and the first few
MAX_RESULT_BYTES = 64 * 2**20  # a result file is a few kB; a larger input is some other file, not read


def is_number(v) -> bool:
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
        if not is_number(r.get(k)):
            return f"'{k}' is missing or not a finite number"
        if not is_percent(r[k]):
            return f"'{k}' is {r[k]:g}, not an accuracy in % (0 to 100)"
    w20 = (r.get("fairness") or {}).get("worst_20") if isinstance(r.get("fairness"), dict) else None
    if not (isinstance(w20, list) and len(w20) == 2 and all(is_number(v) and is_percent(v) for v in w20)):
        return "'fairness.worst_20' is missing or not [mean, std] in %"
    if not (
        isinstance(r.get("params_uploaded_per_round"), int)
        and not isinstance(r["params_uploaded_per_round"], bool)
        and r["params_uploaded_per_round"] >= 0
    ):
        return "'params_uploaded_per_round' is missing or not a count"
    if not (isinstance(r.get("seeds"), list) and r["seeds"]):
        return "'seeds' is missing or empty"
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in r["seeds"]):
        return "'seeds' is not a list of integers"
    curve = r.get("curve")
    if not isinstance(curve, dict):
        return "no accuracy 'curve'"
    rounds, acc = curve.get("rounds"), curve.get("mean_acc")
    if not (
        isinstance(rounds, list)
        and isinstance(acc, list)
        and rounds
        and len(rounds) == len(acc)
        and all(is_number(v) for v in rounds + acc)
    ):
        return "'curve' needs lists 'rounds' and 'mean_acc' of numbers, of the same length"
    if not all(is_percent(v) for v in acc):
        return "'curve.mean_acc' holds values that are not accuracies in % (0 to 100)"
    for k in ("global_acc", "train_loss"):  # optional curves: null, or one number per evaluation round
        v = curve.get(k)
        if v is not None and not (
            isinstance(v, list)
            and len(v) == len(rounds)
            and all(is_number(x) and (k != "global_acc" or is_percent(x)) or x is None for x in v)
        ):
            return f"'curve.{k}' is not null or a list of {len(rounds)} numbers (one per evaluation round)"
    return None


def is_percent(v) -> bool:
    return 0 <= v <= 100


@dataclass
class Run:
    """One result file: where it is and what it holds."""

    path: Path
    result: dict


@dataclass
class Inputs:
    """The inputs sorted out: results, sidecar files (one note for all of them), other files skipped (one note each,
    or one for all when there are more than SKIPPED_LINES)."""

    runs: list[Run] = field(default_factory=list)
    sidecars: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def notes(self) -> list[str]:
        """One line per skipped input (one for all of them beyond SKIPPED_LINES), sidecars in one line."""
        lines = []
        if self.sidecars:
            kinds = {}
            for p in self.sidecars:
                kinds[_sidecar(p)] = kinds.get(_sidecar(p), 0) + 1
            lines.append(
                f"skipped {len(self.sidecars)} sidecar file(s) beside the results ("
                f"{', '.join(f'{k} x{n}' for k, n in kinds.items())}): not result files"
            )
        if len(self.skipped) > SKIPPED_LINES:  # a folder of someone else's JSON: one line, not thousands
            first = "; ".join(self.skipped[:SKIPPED_LINES])
            return lines + [
                f"skipped {len(self.skipped)} files that are not results, the first {SKIPPED_LINES}: {first}; ..."
            ]
        return lines + [f"skipped {line}" for line in self.skipped]


def _sidecar(p: Path) -> str | None:
    return next((suffix for suffix in SIDECARS if p.name.endswith(suffix)), None)


def expand(paths) -> tuple[list[Path], list[Path]]:
    """(files, folders' files): each folder replaced by the `*.json` files directly in it, sorted by name; a path
    given twice (directly or through its folder) is kept once. A path that does not exist, or is not a file or a
    folder (a named pipe, a device), is refused."""
    given, found, seen = [], [], set()
    for p in map(Path, paths):
        if not p.is_dir() and (why := not_a_file(p)) is not None:  # a named pipe is never opened
            raise UserError(f"result file {p} {why}: pass result files or folders holding them")
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
    paths = as_list(paths, "results", (str, os.PathLike))  # one file or folder: a list of one
    if not paths:
        raise UserError("no result files given: pass the result JSON files of `featcache train` or their folder")
    given, found = expand(paths)
    if not given and not found:
        raise UserError(
            f"no .json files in {', '.join(map(str, paths))}: pass the result JSON files of "
            "`featcache train` or the folder holding them, e.g. runs/"
        )
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
        raise UserError(
            f"none of the {len(given) + len(found)} inputs is a featcache result file ({first}): pass the "
            "result JSON files of `featcache train` or their folder, e.g. runs/*.json or runs/"
        )
    return inputs


def cache_of(r: dict) -> dict:
    c = r.get("cache")
    return c if isinstance(c, dict) else {}
