"""Benchmark: `featcache extract` throughput vs the bare backbone forward on the same batches, and peak memory for
two dataset sizes. Prints one JSON object. Run: `.venv/bin/python bench/extract.py [--backbone efficientnet_lite0]`.

- extract images/s: a full cache miss (decode, preprocess, forward, HDF5 writes) divided into the images it embeds.
  Also split by phase (dataset build, model build, embedding = decode + preprocess + forward + block writes,
  assembly): the embedding phase's images/s says whether the input pipeline keeps the backbone fed; the whole
  command's adds the fixed costs, which a larger dataset amortises.
- bare images/s: the same backbone's forward alone on the same preprocessed batches (tensors built beforehand).
- peak RSS: each size runs in a fresh subprocess; flat memory means the larger dataset costs no more RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import featcache  # noqa: E402, F401  (before torch: its allocator settings)
import torch  # noqa: E402


def run_extract(backbone: str, per_class: int, image_size: int, out: str, device: str) -> dict:
    from featcache.extract import extract

    return extract(dataset="offline-digits", backbone=[backbone], partition="feature", per_class=per_class,
                   test_per_class=per_class, image_size=image_size, out=out, device=device)


def bare_forward(backbone: str, per_class: int, image_size: int, device: str) -> tuple[float, int]:
    """images/s of the backbone forward alone, on the batches extraction would build (built before timing)."""
    from featcache.backbones import create_backbone
    from featcache.datasets import load_dataset
    from featcache.partition import PartitionSpec, make_partition

    data = load_dataset("offline-digits")
    parts = make_partition(data, PartitionSpec(per_class=per_class, test_per_class=per_class))
    bb = create_backbone(backbone, image_size=image_size)
    tf = bb.transform()
    images = [tf(data.domains[p.domain][s].image(int(i))) for p in parts for s in ("train", "test")
              for i in getattr(p, s)]
    batches = [torch.stack(images[i : i + 64]).to(device) for i in range(0, len(images), 64)]
    model = bb.model.to(device)
    with torch.inference_mode():
        model(batches[0])
        t0 = time.perf_counter()
        for x in batches:
            model(x)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return len(images) / (time.perf_counter() - t0), len(images)


def child(args) -> None:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        res = run_extract(args.backbone, args.per_class, args.image_size, out, args.device)
        seconds = time.perf_counter() - t0
    print(json.dumps({"images": res["images"], "seconds": seconds, "phases": res["phases"],
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backbone", default="efficientnet_lite0")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--sizes", default="20,80", help="images per class per client and split")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--per-class", type=int, default=20)
    args = ap.parse_args()
    if args.child:
        return child(args)
    runs = []
    for size in (int(s) for s in args.sizes.split(",")):
        cmd = [sys.executable, __file__, "--child", "--per-class", str(size), "--backbone", args.backbone,
               "--image-size", str(args.image_size), "--device", args.device]
        runs.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout) | {"per_class": size})
    big = runs[-1]
    bare, n = bare_forward(args.backbone, big["per_class"], args.image_size, args.device)
    ips = big["images"] / big["seconds"]
    embed_ips = big["images"] / big["phases"]["embedding"]
    print(json.dumps({
        "backbone": args.backbone, "image_size": args.image_size, "device": args.device,
        "threads": torch.get_num_threads(),
        "extract_images_per_second": round(ips, 1), "bare_forward_images_per_second": round(bare, 1),
        "ratio_extract_over_bare": round(ips / bare, 3), "target_ratio": 0.9,
        "phases_seconds": big["phases"],
        "embedding_phase_images_per_second": round(embed_ips, 1),
        "ratio_embedding_phase_over_bare": round(embed_ips / bare, 3),
        "peak_rss_mb": {str(r["images"]): round(r["peak_rss_mb"], 1) for r in runs},
        "rss_growth_ratio": round(runs[-1]["peak_rss_mb"] / runs[0]["peak_rss_mb"], 3),
        "images": {str(r["per_class"]): r["images"] for r in runs},
    }, indent=1))


if __name__ == "__main__":
    main()
