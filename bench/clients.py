"""Benchmark: what a cache's client count costs when the images and their embeddings stay the same. One image folder
(`--images` random 8x8 PNGs, 10 classes, one domain) is embedded once into a store (`--backbone`, default a
random-weight EfficientNet-Lite0 at 32 px: 1280-d features); then, for each client count of `--clients` (label
partition, alpha 1), in interleaved turns (the order alternating every repeat), each in a fresh child process:

- `assembly`: `extract` through the filled store into a fresh --out (0 images embedded): the whole call, and its
  `assembly` phase (writing the cache);
- `first_load`: `load_clients` of train then test, the first load of the file in the process (it checks every
  checksum, as `train` does);
- `view_load`: what a cache that holds no features of its own (index lists into the store) would cost at its first
  load: the cache's index arrays (offsets, source indices, domains: sha256 checked) and its rows gathered from the
  store (`Store.gather`: each row checked against its crc32) into the same padded [C, Nmax, D] tensors (asserted
  equal to `load_clients`'). A lower bound of such a load: the metadata checks of `first_load` are left out;
- `train`: `featcache.train` FedAvg, `--rounds` rounds, one seed, `drop_last=false` (1,000 clients hold a few rows
  each): the call's wall time and the share of it spent in its rounds (the result's `seconds_total`).

Prints one JSON object: each case's seconds (every repeat and the median), the ratios of the largest client count
over the smallest side by side, the 1-minute load before and after, and the targets as pass/fail (not asserted):
assembly and first load of the largest count within 2x the smallest's, train at the largest count >= 70 % in its
rounds. Run: `.venv/bin/python bench/clients.py [--images 20000] [--clients 100,1000] [--repeats 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

TARGETS = {"assembly": 2.0, "first_load": 2.0, "train_in_rounds": 0.7}


def write_images(root: Path, images: int) -> None:
    """`root/d1/c<k>/img_<i>.png`: random 8x8 RGB images, each seeded by its name, 10 classes of images // 10."""
    import numpy as np
    from PIL import Image

    for k in range(10):
        folder = root / "d1" / f"c{k}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(images // 10):
            rng = np.random.default_rng(zlib.crc32(f"{k}/{i}".encode()))
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / f"img_{i:05d}.png")


def extract_options(args, work: Path, clients: int, out: Path) -> dict:
    return dict(
        dataset="imagefolder",
        data_root=work / "images",
        backbone=[args.backbone],
        partition="label",
        clients=clients,
        alpha=1.0,
        image_size=args.image_size,
        out=out,
        store=work / "store",
    )


def child(args) -> dict:
    """One timed case in this process (imports done before the clock starts)."""
    warnings.simplefilter("ignore")  # the random weights' warning, once per child
    import featcache.cache as C
    import featcache.runs.train as T
    from featcache.extraction.plan import extract

    work, clients = Path(args.work), int(args.clients)
    out = work / f"out-{clients}"
    if args.child == "assembly":
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        result = extract(**extract_options(args, work, clients, out))
        seconds = time.perf_counter() - t
        (work / f"cache-{clients}.txt").write_text(result["cache"])
        embedded = sum(result["embedded"].values())
        return {"seconds": seconds, "assembly_phase": result["phases"]["assembly"], "embedded": embedded}
    cache = (work / f"cache-{clients}.txt").read_text()
    if args.child == "view_load":
        t = time.perf_counter()
        views = {split: view_load(cache, work / "store", split) for split in ("train", "test")}
        seconds = time.perf_counter() - t
        for split, x in views.items():
            assert torch_equal(x, C.load_clients(cache, split).features), split
        return {"seconds": seconds}
    if args.child == "first_load":
        t = time.perf_counter()
        C.load_clients(cache, "train")
        C.load_clients(cache, "test")
        return {"seconds": time.perf_counter() - t}
    runs = work / f"runs-{clients}"
    shutil.rmtree(runs, ignore_errors=True)
    t = time.perf_counter()
    result = T.train(
        cache, "fedavg", rounds=args.rounds, seeds=[0], set=["drop_last=false"], out=runs, checkpoint_every=0
    )
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "in_rounds": result["seconds_total"] / seconds, "rounds_s": result["seconds_total"]}


def view_load(cache: str, store: Path, split: str):
    """[C, Nmax, D] float32 of `split` gathered from the store at the cache's source indices (one backbone's store:
    the benchmark's), the cache's index arrays checked against their sha256, each row gathered against its crc32."""
    import hashlib

    import h5py
    import numpy as np
    import torch

    from featcache.extraction.store import Store

    def checked(ds) -> np.ndarray:
        data = ds[...]
        if hashlib.sha256(np.ascontiguousarray(data)).hexdigest() != ds.attrs["sha256"]:
            raise SystemExit(f"{ds.name}: sha256 mismatch")
        return data

    with h5py.File(cache, "r") as f:
        domains = json.loads(f.attrs["domains"])
        at, source, domain = (checked(f[f"{split}/{k}"]) for k in ("offsets", "source_index", "domain"))
    path = max(store.glob("*.h5"), key=lambda p: p.stat().st_mtime)  # the store this code's extractions filled
    rows = Store(path, None)
    counts = np.diff(at)  # [C]
    n = int(counts.max(initial=0))
    out = np.zeros((len(counts), n, rows.backbone()["dim"]), np.float32)  # [C, Nmax, D]
    client = np.repeat(np.arange(len(counts)), counts)  # [N] each row's client
    dest = client * n + (np.arange(len(source)) - at[client])  # [N] each row's place in [C * Nmax]
    for d in np.unique(domain):
        mine = domain == d
        out.reshape(-1, out.shape[-1])[dest[mine]] = rows.gather((domains[d], split, 0), source[mine])
    return torch.from_numpy(out)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def run_child(args, case: str, clients: int, work: Path) -> dict:
    argv = [sys.executable, __file__, "--child", case, "--clients", str(clients), "--work", str(work)]
    argv += ["--backbone", args.backbone, "--image-size", str(args.image_size), "--rounds", str(args.rounds)]
    done = subprocess.run(argv, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{case} at {clients} clients failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--clients", default="100,1000")
    ap.add_argument("--backbone", default="efficientnet_lite0=random")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cases", default="assembly,first_load,view_load,train")
    ap.add_argument("--work", default=None, help="folder kept between runs (default: a temporary one)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    load = [os.getloadavg()[0]]
    work = Path(args.work or tempfile.mkdtemp(prefix="featcache-clients-"))
    counts = [int(c) for c in args.clients.split(",")]
    if not (work / "images").is_dir():
        write_images(work / "images", args.images)
    t = time.perf_counter()
    run_child(args, "assembly", 10, work)  # fills the store (every image embedded once)
    setup = time.perf_counter() - t
    cases = args.cases.split(",")
    found: dict = {case: {c: [] for c in counts} for case in cases}
    for r in range(args.repeats):
        for c in counts if r % 2 == 0 else counts[::-1]:
            for case in cases:
                found[case][c].append(run_child(args, case, c, work))
                if found[case][c][-1].get("embedded"):
                    raise SystemExit(f"the store was not filled: {c} clients embedded images")
    load.append(os.getloadavg()[0])
    median = lambda runs, key="seconds": statistics.median(run[key] for run in runs)  # noqa: E731
    lo, hi = counts[0], counts[-1]
    figures = {
        case: {str(c): {"runs": runs, "median_s": median(runs)} for c, runs in by_count.items()}
        for case, by_count in found.items()
    }
    ratios, targets = {}, {}
    for case in ("assembly", "first_load"):
        if case in found:
            ratios[case] = median(found[case][hi]) / median(found[case][lo])
            targets[f"{case}_{hi}_within_{TARGETS[case]}x_of_{lo}"] = ratios[case] <= TARGETS[case]
    if "view_load" in found and "first_load" in found:
        for c in (lo, hi):
            ratios[f"view_load_over_first_load_{c}"] = median(found["view_load"][c]) / median(found["first_load"][c])
    if "assembly" in found:
        ratios["assembly_phase"] = median(found["assembly"][hi], "assembly_phase") / median(
            found["assembly"][lo], "assembly_phase"
        )
    if "train" in found:
        for c in (lo, hi):
            ratios[f"train_in_rounds_{c}"] = median(found["train"][c], "in_rounds")
        targets[f"train_{hi}_in_rounds_at_least_{TARGETS['train_in_rounds']}"] = (
            ratios[f"train_in_rounds_{hi}"] >= TARGETS["train_in_rounds"]
        )
    report = {
        "images": args.images,
        "backbone": args.backbone,
        "image_size": args.image_size,
        "clients": counts,
        "repeats": args.repeats,
        "store_fill_s": setup,
        "figures": figures,
        "ratios": ratios,
        "targets": targets,
        "cpus": os.cpu_count(),
        "load_1min": load,
    }
    print(json.dumps(report, indent=1))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
