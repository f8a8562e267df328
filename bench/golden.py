"""The golden set: every algorithm's result file, a grid's and a quick reproduction's, written through the CLI into
OUT and listed by sha256 (OUT/golden.json; hex digests, which follow the code's and the commit's, left out). Run it
before and after a refactor that must not change a number, at the same OUT (result files record their command line):
`python bench/golden.py OUT && mv OUT/golden.json before.json && rm -r OUT`, change the code, `python bench/golden.py
OUT --against before.json` (exit 1, the differing files named, when a byte differs). CPU, offline, random-weight
backbones: minutes."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

CLI = [sys.executable, "-m", "featcache.cli"]
TRAIN = ["--rounds", "3", "--seeds", "0,1", "--set", "batch_size=16", "--set", "drop_last=false"]


def images(root: Path) -> Path:
    """Two domains of three classes, 24 different 32-px images each (seeded)."""
    rng = np.random.default_rng(0)
    for d in ("d1", "d2"):
        for c in ("a", "b", "c"):
            (root / d / c).mkdir(parents=True, exist_ok=True)
            for i in range(24):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / d / c / f"img_{i:03d}.png")
    return root


def cli(*args: str) -> dict:
    done = subprocess.run([*CLI, *args, "--json"], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"featcache {' '.join(args)} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def write(out: Path) -> dict[str, str]:
    data = images(out / "images")
    cache = cli(
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(data),
        "--backbone",
        "test_resnet=random",
        "--image-size",
        "32",
        "--partition",
        "label",
        "--clients",
        "4",
        "--alpha",
        "0.5",
        "--val-fraction",
        "0.2",
        "--views",
        "2",
        "--out",
        str(out / "cache"),
    )["cache"]
    algos = [a for a in cli("algos")["algorithms"]]
    for algo in algos:
        cli("train", "--cache", cache, "--algo", algo, *TRAIN, "--out", str(out / "train"))
    cli(
        "grid",
        "--cache",
        cache,
        "--algo",
        "fedprox",
        "--grid",
        "mu=0,0.1",
        "--grid",
        "lr=0.01,0.05",
        "--seeds",
        "0,1",
        "--rounds",
        "3",
        "--set",
        "batch_size=16",
        "--set",
        "drop_last=false",
        "--chunk",
        "3",
        "--out",
        str(out / "grid"),
    )
    cli(
        "reproduce",
        "pipelines/fedpcl-table2.toml",
        "--profile",
        "quick",
        "--out",
        str(out / "reproduce"),
        "--cache",
        str(out / "cache"),
    )
    return digest(out)


HEX = re.compile(rb"\b[0-9a-f]{12,64}\b")  # content keys, result-name digests, the commit: they follow the code


def digest(out: Path) -> dict[str, list[str]]:
    """Each result file's sha256 by its path, both with every hex digest written as `#`: the cache's content key
    names the code that embedded it, the provenance records the commit, and a result's name digests its body, so
    across a refactor only the numbers and words are compared (a name shared by several files lists their hashes)."""
    found: dict[str, list[str]] = {}
    for folder in ("train", "grid", "reproduce"):
        for p in sorted((out / folder).rglob("*")):
            if p.is_file() and not p.name.endswith((".timing.json", ".done")):  # seconds; the code's digest
                name = HEX.sub(b"#", str(p.relative_to(out)).encode()).decode()
                found.setdefault(name, []).append(hashlib.sha256(HEX.sub(b"#", p.read_bytes())).hexdigest())
    return {k: sorted(v) for k, v in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--against", type=Path, help="an earlier golden.json: exit 1 when a file's bytes differ")
    parser.add_argument("--written", action="store_true", help="OUT was written before: list its files only")
    args = parser.parse_args()
    if args.out.exists() and not args.written:
        sys.exit(f"{args.out} exists: pass a new folder")
    hashes = digest(args.out) if args.written else write(args.out)
    (args.out / "golden.json").write_text(json.dumps(hashes, indent=1, sort_keys=True))
    print(f"{len(hashes)} files in {args.out}/golden.json")
    if args.against:
        before = json.loads(args.against.read_text())
        differ = sorted(k for k in before.keys() | hashes.keys() if before.get(k) != hashes.get(k))
        print("\n".join(f"differs: {k}" for k in differ) or "every file byte-identical")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
