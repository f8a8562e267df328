"""Partitions and caches of many clients keep their bytes: the index lists of every scheme (up to 1,000 clients) and a
cache written from them (`plan._write`, stand-in stores whose rows are a function of their source index) hash to
digests pinned from the per-client code, so vectorizing that code changed no client's images. Speed is
bench/clients.py's."""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import zlib

import h5py
import numpy as np
import pytest
from test_partition import make_dataset

from featcache.extraction import plan
from featcache.extraction.partition import PartitionSpec, make_partition, partition_counts, steps

DATA = make_dataset(n_train=12000, n_test=3000)
CASES = {  # name -> (spec, sha256 of every client's index lists)
    "label-1000": (
        PartitionSpec("label", clients=1000, alpha=1.0),
        "10502cb4443821d01564308bedbae98fb917298cfdc4d2b80acc41929893252f",
    ),
    "label-100-small-alpha": (
        PartitionSpec("label", clients=100, alpha=0.1, seed=3),
        "92f23c448d5e9dff0376d51a94532ea36c3748a096855368c38797e6546ff1c6",
    ),
    "label-capped": (
        PartitionSpec("label", clients=300, alpha=0.5, per_class=20, test_per_class=3),
        "1ea3ca0d5a768207eed751133f380803d33b247f563bffc8104cc6bcc3f9152a",
    ),
    "feature-1000": (
        PartitionSpec("feature", clients=1000, per_class=2),
        "df137413ca5c11c8aacef87188a885887fe2e378865bbbe82b39ced59c9f58de",
    ),
    "feature-whole": (
        PartitionSpec("feature", clients=40, order="first", val_fraction=0.3),
        "648a1298ceaa23b7b20aaa9b08c388bf7598d82cec5c4d737ff3778ce1983035",
    ),
    "feature-label": (
        PartitionSpec("feature-label", clients=500, alpha=0.5, per_class=10),
        "851e749b88eea0f13e41d2dd21ef2578843a4cbcd6ef5b5f291e4fedf5e398b1",
    ),
    "pathological": (
        PartitionSpec("pathological", clients=700, classes_per_client=3),
        "77e2a0bb160cb3012176db904e5f35243077a5c8033c39f0fa76117c6ad6ca87",
    ),
    "iid": (
        PartitionSpec("iid", clients=1000, test_split="whole"),
        "a60fbb77d7f831289d59b132797ecef4e32876789940fb9d80fc11f47ee73b5f",
    ),
    "holdout-percent": (
        PartitionSpec("feature", clients=200, holdout_domain="usps", percent=0.5),
        "f8c635c27ecb3bff3cbd25354caca24a42d172c770df566846aed108d6ed2a30",
    ),
}
CACHES = {  # name -> (spec, views, sha256 of the cache's datasets and counts)
    "label-1000": (CASES["label-1000"][0], 0, "a878a99c65e5f186612f162e429ac1a2c233a2d14d4aa95c5a46fd14c2ffcd2f"),
    "feature-views": (
        PartitionSpec("feature", clients=60, per_class=3),
        2,
        "99828df5287dbfdaf6e5c92f13d0e731069580f1c7511c27ff2d158503080c6e",
    ),
    "holdout": (
        PartitionSpec("feature", clients=30, per_class=4, holdout_domain="synth"),
        0,
        "b1e2b8fd3785b80ef3248cbba2285a856165a8aadc868b50c10ae974e752b50b",
    ),
}


def parts_sha256(parts) -> str:
    digest = hashlib.sha256()
    for p in parts:
        digest.update(p.domain.encode() + p.test_domain.encode())
        for a in (p.train, p.test, p.val, p.test_train):
            digest.update(np.ascontiguousarray(a, "<i8").tobytes() + b"|")
    return digest.hexdigest()


@pytest.mark.parametrize("name", CASES)
def test_every_clients_index_lists_are_the_pinned_ones(name):
    spec, pinned = CASES[name]
    assert parts_sha256(make_partition(DATA, spec)) == pinned


class Rows:
    """A store's stand-in: the rows of source index i of (domain, split) are a fixed function of both."""

    def __init__(self, dim: int, salt: int) -> None:
        self.dim, self.salt = dim, salt

    def gather(self, need, wanted: np.ndarray) -> np.ndarray:
        domain, split, views = need
        at = zlib.crc32(f"{domain}/{split}".encode()) % 1000 + self.salt
        rows = ((wanted[:, None] * 7 + np.arange(self.dim) + at) % 101).astype(np.float32) / 7  # [n, D]
        return rows if not views else rows[:, None] + np.arange(views, dtype=np.float32)[:, None] / 3  # [n, V, D]


def write_cache(path, spec: PartitionSpec, views: int):
    """The cache `extract` writes for `spec` from two backbones' stand-in stores (5 and 3 columns)."""
    parts = make_partition(DATA, spec)
    metas = [
        {"key": f"b{j}", "name": f"b{j}", "weights": "random", "weights_sha256": "0" * 64, "dim": d}
        | {"preprocessing": {}}
        for j, d in enumerate((5, 3))
    ]
    manifest = {"partition": spec.to_dict(), "versions": {"pinned": 1}}
    plan._write(path, "k" * 64, manifest, DATA, parts, [Rows(5, 0), Rows(3, 11)], metas, views, 0.0)
    return parts


@pytest.mark.parametrize("name", CACHES)
def test_a_cache_of_many_clients_holds_the_pinned_bytes(name, tmp_path):
    spec, views, pinned = CACHES[name]
    path = tmp_path / "c.h5"
    parts = write_cache(path, spec, views)
    with h5py.File(path) as f:
        found = {name: f[name].attrs["sha256"] for name in sorted(_datasets(f))}
        found |= {"counts": f.attrs["counts"], "domains": f.attrs["domains"], "images": int(f.attrs["images"])}
    assert json.loads(f"{found['counts']}") == partition_counts(DATA, parts)
    assert hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest() == pinned


@pytest.mark.parametrize("name", CACHES)
def test_clients_written_together_make_the_file_written_client_by_client(name, tmp_path, monkeypatch):
    """The writer puts consecutive clients' rows into one slice; the file is the one a write per client made, byte
    for byte (HDF5 places a dataset's bytes at its first write: that stays where the per-client writer put it)."""
    spec, views, _ = CACHES[name]
    write_cache(tmp_path / "together.h5", spec, views)

    class PerClient:
        def __init__(self, rows) -> None:
            self.rows = rows

        def add(self, blocks, n: int) -> None:
            self.rows.add_columns(blocks, n)

        def close(self) -> str:
            return self.rows.close()

    monkeypatch.setattr(importlib.import_module("featcache.cache.write"), "_Batched", PerClient)
    write_cache(tmp_path / "alone.h5", spec, views)
    assert (tmp_path / "together.h5").read_bytes() == (tmp_path / "alone.h5").read_bytes()


def _datasets(f: h5py.File) -> list[str]:
    found = []
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
    return found


def test_a_choice_of_no_image_draws_nothing():
    """`steps._val_positions` skips the classes that keep every image (and a client's stream where all do), which
    gives the same positions only because a choice of none takes nothing from the stream."""
    rng, again = np.random.default_rng(5), np.random.default_rng(5)
    assert len(rng.choice(np.arange(4), 0, replace=False)) == 0
    assert rng.integers(0, 2**62) == again.integers(0, 2**62)
    assert steps._val_positions(np.zeros(0, np.int64), 0.2, rng).tolist() == []


def test_every_argsort_of_the_partition_code_is_stable():
    """numpy sorts with the machine's SIMD instructions (AVX-512 or not), and an unstable argsort orders ties by
    them: a partition must not depend on the CPU, so every argsort of the partition code says kind="stable" (np.sort
    of values and lexsort cannot tell ties apart)."""
    from pathlib import Path

    import featcache.extraction.partition as P

    for file in sorted(Path(P.__file__).parent.glob("*.py")):
        for i, line in enumerate(file.read_text().splitlines(), 1):
            for call in re.findall(r"argsort\(([^()]*)\)", line):
                assert 'kind="stable"' in call, f"{file.name}:{i}: {line.strip()}"
