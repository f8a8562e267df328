"""Benchmark: the embedding store at the size of today's data sets. Synthetic 1,280-d float32 rows in stores of
10,000 and 1,000,000 rows of one (domain, split), built in a temporary folder through the store's own fill (plan,
block files as the embedding pass writes them, commit) and deleted after:

- `fill_ratio`: a fill of 1,000 new rows (plan from what the store holds, blocks written, committed) into the
  1,000,000-row store over the same fill into the 10,000-row store;
- `gather_ratio`: a 10,000-row partition (rows drawn at random from the whole data set's indices, as a subsample
  such as FedPCL's draws) gathered from the 1,000,000-row store over the same rows gathered from a 10,000-row store
  that holds just them; `gather_contiguous_ratio` the same for the first 10,000 indices;
- `peak_rss_mb`: this process's peak RSS (VmHWM) over the whole run, building included, beside the bytes gathered;
- `kill`: a fill of 100,000 rows into the large store killed (SIGKILL) while it writes its segment, after the
  segment before the store file's rename, and after that rename: the store still verifies (every row against its
  crc, in a fresh process), and the next fill ends with the bytes of an undisturbed fill of the same rows (made in a
  copy of the store whose segments are hard links).

Each operation runs in a fresh `Store` (the index read as a new process reads it), interleaved between the two
stores, median of `--repeats`, in wall seconds and in this process's CPU seconds (`cpu_ratios`: on a machine shared
with other work, the wall ratios carry its load). Each repeat's fill goes into all three stores (the 10,000 first
indices' too, untimed), so compared stores differ in their rows alone, not in the segments a fresh `Store` opens. The
page cache is warm: each gather runs once untimed first. The gather target holds for both gathers. Prints one JSON
object with the 1-minute load before and after. Run: `.venv/bin/python bench/store_scale.py [--rows 1000000]
[--quick]`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from featcache.cache.identity import content_key
from featcache.extraction import store as S
from featcache.extraction.store import Store
from featcache.files import locked, npy_file

D = 1280
NEED = ("synthetic", "train", 0)
IDENTITY = {"dataset": "synthetic", "bench": "store_scale"}
KEY = content_key(IDENTITY)
BACKBONE = {"key": "synthetic", "name": "synthetic", "dim": D}
BLOCK = 16384  # rows per block file while a store is built


TABLE = np.random.default_rng(0).random((4096, D), np.float32)  # [4096, D]


def rows_of(index: np.ndarray) -> np.ndarray:
    """[n, D] float32: the rows of source indices `index`, a function of the index alone."""
    return TABLE[index % len(TABLE)] + np.asarray(index, np.float32)[:, None]  # [n, D]


def fill(path: Path, wanted: np.ndarray, block: int = BLOCK) -> tuple[float, float]:
    """Fill the store at `path` with the rows of `wanted` it lacks, as `extract` does; returns (wall, CPU) seconds."""
    t, cpu = time.perf_counter(), time.process_time()
    store = Store(path, KEY)
    with locked(store.work):
        held = store.held(pending=True).get(NEED, np.zeros(0, np.int64))
        missing = np.sort(wanted[~S.isin_sorted(wanted, held)])
        blocks = [(NEED, missing[a : a + block]) for a in range(0, len(missing), block)]
        for (_, rows), file in zip(blocks, store.plan(blocks)):
            with npy_file(file, (len(rows), D)) as fh:
                fh.write(rows_of(rows).tobytes())
        (store.work / "meta.json").write_text(json.dumps(BACKBONE))
        store.commit(IDENTITY)
    return time.perf_counter() - t, time.process_time() - cpu


def gather(path: Path, wanted: np.ndarray) -> tuple[float, float]:
    """Gather `wanted` from the store at `path` in a fresh `Store`; returns (wall, CPU) seconds."""
    t, cpu = time.perf_counter(), time.process_time()
    rows = Store(path, KEY).gather(NEED, wanted)
    assert np.array_equal(rows[:3], rows_of(wanted[:3]))
    return time.perf_counter() - t, time.process_time() - cpu


def digest(path: Path) -> dict[str, str]:
    """sha256 of a store's file and each of its segments, by name."""
    files = [path, *sorted(S.rows_folder(path).glob("*.h5"))]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


KILLS = {  # where a fill is killed: code run in the killed process before its fill
    "mid-segment": "real = S.crc32_rows\n"
    "def crc(rows, n=[]):\n"
    "    n.append(1)\n"
    "    if len(n) == 3: os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return real(rows)\n"
    "S.crc32_rows = crc\n",
    "before-store-rename": "S._write = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n",
    "after-store-rename": "real = os.replace\n"
    "def replace(a, b):\n"
    "    real(a, b)\n"
    "    if str(b).endswith('big.h5'): os.kill(os.getpid(), signal.SIGKILL)\n"
    "os.replace = replace\n",
}


def kill_case(big: Path, start: int, n: int, point: str) -> dict:
    """Kill a fill of n rows into `big` at `point`; verify the store in a fresh process; resume; compare with an
    undisturbed fill of the same rows into a copy whose segments are hard links."""
    twin = big.with_name(f"twin-{point}.h5")
    S.rows_folder(twin).mkdir()
    for p in S.rows_folder(big).iterdir():
        os.link(p, S.rows_folder(twin) / p.name)
    shutil.copy(big, twin)
    new = np.arange(start, start + n)
    code = (
        "import os, signal, sys; sys.path.insert(0, 'bench'); import store_scale as B, numpy as np\n"
        "from featcache.extraction import store as S\n"
        f"S.SLICE_BYTES = max(1, {n} * B.D * 4 // 16)\n"
        f"{KILLS[point]}"
        f"B.fill(B.Path({str(big)!r}), np.arange({start}, {start + n}))\n"
    )
    killed = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent).returncode
    verify = subprocess.run(
        [sys.executable, "-c", f"from featcache.extraction.stores import verify; print(verify({str(big)!r})['ok'])"],
        capture_output=True,
        text=True,
    )
    resumed = fill(big, new)[0]
    fill(twin, new)
    theirs = {big.name if k == twin.name else k: v for k, v in digest(twin).items()}
    shutil.rmtree(S.rows_folder(twin))
    twin.unlink()
    return {
        "point": point,
        "rows": n,
        "killed_by": -killed,
        "verified_after_kill": verify.stdout.strip() == "True",
        "resume_seconds": round(resumed, 3),
        "same_bytes_as_undisturbed": digest(big) == theirs,
    }


def load() -> float:
    return os.getloadavg()[0]


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the large store")
    ap.add_argument("--small", type=int, default=10_000, help="rows of the small store and of the partition")
    ap.add_argument("--add", type=int, default=1_000, help="rows of a fill")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="100,000 rows, 2 repeats")
    ap.add_argument("--folder", default=None, help="where to build the stores (default: a temporary folder)")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.repeats = 100_000, 2
    out: dict = {"rows": args.rows, "small": args.small, "fill_rows": args.add, "dim": D, "load_1min": [load()]}
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(args.rows, args.small, replace=False))  # the partition: a random subsample
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        big, small, first = Path(tmp, "big.h5"), Path(tmp, "small.h5"), Path(tmp, "first.h5")
        t = time.perf_counter()
        fill(big, np.arange(args.rows))
        out["build_seconds"] = round(time.perf_counter() - t, 1)
        fill(small, sample)
        fill(first, np.arange(args.small))
        out["bytes"] = {p.stem: sum(f.stat().st_size for f in [p, *S.rows_folder(p).iterdir()]) for p in (big, small)}
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in ("fill_big", "fill_small")}
        times |= {k: [] for k in ("gather_big", "gather_small", "gather_big_first", "gather_first")}
        part = rng.permutation(sample)  # the clients' order
        head = rng.permutation(args.small)
        for path, wanted in ((big, part), (small, part), (big, head), (first, head)):
            gather(path, wanted)  # the rows it reads into the page cache
        base = 10 * args.rows
        for r in range(args.repeats):
            new = np.arange(base + r * args.add, base + (r + 1) * args.add)  # rows neither store holds
            times["fill_big"].append(fill(big, new))
            times["fill_small"].append(fill(small, new))
            fill(first, new)  # a segment as the others take: the stores of a comparison differ in their rows alone
            times["gather_big"].append(gather(big, part))
            times["gather_small"].append(gather(small, part))
            times["gather_big_first"].append(gather(big, head))
            times["gather_first"].append(gather(first, head))
        for clock, label in ((0, "seconds"), (1, "cpu_seconds")):
            med = {k: statistics.median(t[clock] for t in v) for k, v in times.items()}
            out[label] = {k: round(v, 4) for k, v in med.items()}
            ratios = {
                "fill_ratio": round(med["fill_big"] / med["fill_small"], 3),
                "gather_ratio": round(med["gather_big"] / med["gather_small"], 3),
                "gather_contiguous_ratio": round(med["gather_big_first"] / med["gather_first"], 3),
            }
            out |= ratios if clock == 0 else {"cpu_ratios": ratios}
        out["peak_rss_mb"] = round(vm("VmHWM") / 2**20)
        out["gathered_mb"] = round(args.small * D * 4 / 2**20)
        n = min(100_000, args.rows // 10)
        out["kill"] = [kill_case(big, (20 + i) * args.rows, n, point) for i, point in enumerate(KILLS)]
    out["load_1min"].append(load())
    out["targets"] = {
        "fill_ratio <= 1.2": out["fill_ratio"] <= 1.2,
        "gather_ratio <= 1.5": out["gather_ratio"] <= 1.5,
        "gather_contiguous_ratio <= 1.5": out["gather_contiguous_ratio"] <= 1.5,
        "peak_rss_mb <= 1024 + gathered": out["peak_rss_mb"] <= 1024 + out["gathered_mb"],
        "kill: verifies and resumes to the same bytes": all(
            k["killed_by"] == signal.SIGKILL and k["verified_after_kill"] and k["same_bytes_as_undisturbed"]
            for k in out["kill"]
        ),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
