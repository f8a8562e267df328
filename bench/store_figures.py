"""Figure 7 of bench/extract.py: the embedding store (embed once, partition many), measured side by side in one run.

- repartition: an extraction into an empty store (`first`), then a new α and a new client count on the same images
  through the filled store (`alpha`, `clients`), each beside the same extraction into a fresh --out (an empty store:
  what a new partition costs when nothing is embedded yet). Target: <= 0.05 x the time, 0 images
  embedded.
- sweeps: `--alpha` with 5 values and `--clients` with 5 values, each one command into an empty store, against one
  extraction of one setting, in the order one, sweep, sweep, one (mean of two each). Target: <= 1.2 x.
- demo_bytes: the demo's extraction (`make demo`), the bytes of its stores and of its cache.
- reproduce_quick: every extraction of every pipeline's quick profile (training skipped), in order into one cache
  folder: the images each backbone embedded, and the images of the caches written (what embedding once per
  extraction cost).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from featcache.extraction.plan import extract


def _timed(out: Path, **kw) -> dict:
    t = time.perf_counter()
    result = extract(out=out, **kw)
    return {
        "seconds": time.perf_counter() - t,
        "embedded": sum(result["embedded"].values()),
        "caches": len(result.get("caches", [result])),
    }


def repartition_and_sweeps(root: Path, backbone: str, size: int, domain: str) -> dict:
    base = dict(
        dataset="offline-digits", backbone=[backbone], domains=[domain], partition="label", image_size=size, workers=0
    )
    warm = root / "warm"
    _timed(warm, **base, clients=10)  # builds the dataset once (kept in --out) and warms the libraries
    figures = {}
    shared = root / "shared"
    shutil.copytree(warm, shared, ignore=shutil.ignore_patterns("store", "*.h5"))  # the dataset, not the store
    figures["first"] = _timed(shared, **base, clients=10, alpha=0.5)
    for name, setting in (("alpha", dict(clients=10, alpha=1.0)), ("clients", dict(clients=20, alpha=0.5))):
        fresh = root / f"fresh-{name}"
        shutil.copytree(warm, fresh, ignore=shutil.ignore_patterns("store", "*.h5"))
        through = _timed(shared, **base, **setting)
        alone = _timed(fresh, **base, **setting)
        figures[name] = {"through_store": through, "fresh": alone, "ratio": through["seconds"] / alone["seconds"]}
    sweeps = {
        "alpha": dict(clients=10, alpha=[0.1, 0.5, 1.0, 5.0, 10.0]),
        "clients": dict(clients=[5, 10, 20, 40, 80], alpha=0.5),
    }
    for name, setting in sweeps.items():  # ABBA order: a load that drifts during the four runs cancels out
        runs = {"one": [], "sweep": []}
        for i, kind in enumerate(("one", "sweep", "sweep", "one")):
            folder = root / f"{kind}-{name}-{i}"
            shutil.copytree(warm, folder, ignore=shutil.ignore_patterns("store", "*.h5"))
            runs[kind].append(_timed(folder, **base, **(setting if kind == "sweep" else dict(clients=10, alpha=0.5))))
            shutil.rmtree(folder)
        mean = {k: sum(r["seconds"] for r in v) / 2 for k, v in runs.items()}
        figures[f"sweep_{name}"] = runs | {"ratio": mean["sweep"] / mean["one"]}
    return figures


def demo_bytes(root: Path) -> dict:
    out = root / "demo"
    result = extract(
        dataset="offline-digits",
        backbone=["efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2"],
        partition="feature",
        per_class=10,
        test_per_class=50,
        image_size=64,
        out=out,
    )
    stores = sorted((out / "store").glob("*.h5"))
    return {
        "images": result["images"],
        "cache_bytes": os.path.getsize(result["cache"]),
        "store_bytes": sum(os.path.getsize(s) for s in stores),
        "stores": len(stores),
    }


def reproduce_quick(root: Path) -> dict:
    """Every distinct extraction of every pipeline's quick profile, in pipeline order, into one cache folder."""
    from featcache.reproduce.plan import plan
    from featcache.reproduce.run import _embedded, _extract, load_pipeline

    out = root / "reproduce"
    infos, seen = [], set()
    t = time.perf_counter()
    for toml in sorted(Path(__file__).resolve().parents[1].glob("pipelines/*.toml")):
        pipe = load_pipeline(toml)
        for job in dict.fromkeys(plan(pipe, "quick", None, None, None).values()):
            if job.extract not in seen:
                seen.add(job.extract)
                infos.append(_extract(job.extract_kwargs, out, None))
    return {
        "extractions": len(infos),
        "embedded": _embedded(infos),
        "cache_images": _embedded(infos, "images"),
        "seconds": time.perf_counter() - t,
    }


def store_figures(
    backbone: str = "efficientnet_lite0", size: int = 64, domain: str = "mnist", reproduce: bool = True
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        figures = {
            "setting": {
                "dataset": "offline-digits",
                "domain": domain,
                "partition": "label",
                "backbone": backbone,
                "image_size": size,
            }
        }
        figures |= repartition_and_sweeps(root, backbone, size, domain)
        figures["demo_bytes"] = demo_bytes(root)
        if reproduce:
            figures["reproduce_quick"] = reproduce_quick(root)
        return figures


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(store_figures(reproduce="--no-reproduce" not in sys.argv), indent=1))
