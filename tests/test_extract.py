"""`featcache extract` end to end on the built-in offline digits with a real offline backbone: cache layout, cache
hits, determinism, views, noise, the CLI contract, and one-line errors that leave nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from featcache import cache as C
from featcache.errors import UserError
from featcache.extraction.plan import SMALL_IMAGES, Noise, default_image_size, extract

SMALL = dict(
    dataset="offline-digits",
    backbone=["efficientnet_lite0"],
    partition="feature",
    per_class=3,
    test_per_class=2,
    image_size=32,
    domains=["mnist", "synth"],
)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "featcache.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    return extract(**SMALL, out=out), out


def test_cache_layout_and_metadata(small_cache):
    res, _ = small_cache
    assert res["cache_hit"] is False and res["backbones"] == ["efficientnet_lite0"]
    assert res["images"] == 2 * 10 * (3 + 2)  # 2 clients x 10 classes x (3 train + 2 test)
    with h5py.File(res["cache"]) as f:
        meta = C.read_attrs(f)
        assert meta["featcache_format"] == C.FORMAT and meta["domains"] == ["mnist", "synth"]
        assert meta["partition"]["scheme"] == "feature" and len(meta["counts"]["clients"]) == 2
        bb = C.read_attrs(f["backbones/efficientnet_lite0"])
        assert bb["weights"].startswith("package:") and len(bb["weights_sha256"]) == 64
        assert bb["preprocessing"]["input_size"] == [3, 32, 32] and bb["columns"] == [0, bb["dim"]]
        assert list(f["train/features"]) == ["concat"]  # the features are stored once
        x = C.client_rows(f, "train", 0)
        assert x.shape == (30, bb["dim"]) and x.dtype == np.float32 and np.isfinite(x).all()
        assert sorted(np.bincount(C.client_rows(f, "train", 0, "labels"))) == [3] * 10
        assert len(C.client_rows(f, "train", 0, "val_index")) > 0


def test_cache_hit_is_instant_and_identical(small_cache):
    res, out = small_cache
    again = extract(**SMALL, out=out)
    assert again["cache_hit"] and again["cache"] == res["cache"] and again["seconds"] < 1.0
    assert "phases" not in again and res["phases"]["embedding"] > 0
    names = "setup identity weights dataset plan models embedding commit assembly finish".split()
    assert list(res["phases"]) == names
    assert abs(sum(res["phases"].values()) - res["seconds"]) <= 0.05 * res["seconds"]  # the phases are all the time


def test_other_seed_or_backbone_gives_new_cache_and_same_seed_same_bytes(small_cache, tmp_path):
    res, _ = small_cache
    other = extract(**(SMALL | {"seed": 1}), out=tmp_path)
    assert other["cache"] != res["cache"]
    twin = extract(**SMALL, out=tmp_path / "twin")
    with h5py.File(res["cache"]) as a, h5py.File(twin["cache"]) as b:
        for split in ("train", "test"):
            np.testing.assert_array_equal(a[f"{split}/features/concat"][...], b[f"{split}/features/concat"][...])


def test_two_backbones_concatenate_in_order(tmp_path):
    """Each backbone's columns of `concat` hold exactly what a cache of that backbone alone holds."""
    names, options = ["efficientnet_lite0", "resnet18=random"], SMALL | {"domains": ["mnist"]}
    res = extract(**(options | {"backbone": names}), out=tmp_path)
    alone = [extract(**(options | {"backbone": [b]}), out=tmp_path)["cache"] for b in names]
    with h5py.File(res["cache"]) as f:
        assert json.loads(f.attrs["backbones"]) == ["efficientnet_lite0", "resnet18-random"]
        assert f["backbones/resnet18-random"].attrs["weights"] == "random"
        columns = [json.loads(f[f"backbones/{k}"].attrs["columns"]) for k in res["backbones"]]
        x = C.client_rows(f, "test", 0)  # [n, D0 + D1]
        for (a, b), single in zip(columns, alone):
            with h5py.File(single) as g:
                np.testing.assert_array_equal(x[:, a:b], C.client_rows(g, "test", 0))
    assert columns[0][0] == 0 and columns[0][1] == columns[1][0] and columns[1][1] == x.shape[1]
    swapped = C.load_clients(res["cache"], "test", backbones=["resnet18-random", "efficientnet_lite0"])
    (a0, b0), (a1, b1) = columns
    np.testing.assert_array_equal(swapped.features[0, : len(x)].numpy(), np.concatenate([x[:, a1:b1], x[:, a0:b0]], 1))
    assert swapped.meta["backbones"] == res["backbones"]


def test_views_and_noise(tmp_path):
    base = SMALL | {"domains": ["mnist"]}
    views = extract(**(base | {"views": 2}), out=tmp_path)
    with h5py.File(views["cache"]) as f:
        v = C.client_rows(f, "train", 0, "views/concat")
        x = C.client_rows(f, "train", 0)
        assert v.shape == (30, 2, x.shape[1]) and not np.allclose(v[:, 0], v[:, 1])
    clean = C.load_clients(views["cache"], "train")
    noisy = extract(**(base | {"noise": Noise("gaussian", 0.2, 0.1)}), out=tmp_path)
    assert noisy["cache"] != views["cache"]
    assert not np.allclose(C.load_clients(noisy["cache"], "train").features, clean.features)
    with pytest.raises(UserError, match="noise"):
        Noise("uniform", 0.1, 0.1)


def test_cli_json_and_info(small_cache, tmp_path):
    res, out = small_cache
    run = cli(
        "extract",
        "--dataset",
        "offline-digits",
        "--backbone",
        "efficientnet_lite0",
        "--partition",
        "feature",
        "--per-class",
        "3",
        "--test-per-class",
        "2",
        "--image-size",
        "32",
        "--domains",
        "mnist",
        "--domains",
        "synth",
        "--out",
        str(out),
        "--json",
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["cache"] == res["cache"] and got["cache_hit"] is True
    assert {"cache", "cache_hit", "images", "backbones", "seconds"} <= set(got)
    info = cli("info", res["cache"], "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["counts"]["clients"][0]["train"] == 30


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--partition", "label", "--alpha", "-1"], "alpha"),
        (["--backbone", "resnet181"], "resnet18"),
        (["--domains", "mnst"], "mnist"),
        (["--partition", "iid", "--clients", "100000", "--domains", "mnist"], "clients"),
        (["--dataset", "digit5", "--data-root", "/nonexistent"], "digit"),
        (["--backbone", "resnet18=/nonexistent/model_best.pth.tar"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, args, needle):
    base = ["extract", "--per-class", "2", "--test-per-class", "1", "--image-size", "32", "--out", str(tmp_path / "o")]
    run = cli(*base, *args)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in run.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_keys_cover_featcache_embedding_code_but_not_its_comments(monkeypatch):
    """A change of what pipeline.py computes gives other store and cache keys; a comment or docstring does not."""
    from featcache.cache import identity

    monkeypatch.setattr(identity, "memo_path", lambda: None)  # the bytes _read_source gives, not a memo by stat
    real = identity._read_source
    before = identity.code_identity()
    edits = {
        "comment": b"\n# a comment\n",
        "docstring": b'\ndef f():\n    """A docstring."""\n',
        "code": b"\nEXTRA = 1\n",
    }
    after = {}
    for name, text in edits.items():
        baseline = b'\ndef f():\n    """Another."""\n' if name == "docstring" else b""
        monkeypatch.setattr(
            identity, "_read_source", lambda rel, t=text: real(rel) + (t if rel == "pipeline.py" else b"")
        )
        after[name] = identity.code_identity()["sha256"]
        if baseline:
            monkeypatch.setattr(
                identity, "_read_source", lambda rel: real(rel) + (baseline if rel == "pipeline.py" else b"")
            )
            assert identity.code_identity()["sha256"] == after[name]  # two docstrings, one key
    assert after["comment"] == before["sha256"] and after["code"] != before["sha256"]
    assert {"pipeline.py", "embed.py", "backbones/__init__.py"} <= set(before["files"])
    assert not any(f.startswith("partition/") for f in before["files"])  # stores ignore the partition code
    assert any(
        f.startswith("partition/")
        for f in identity.code_identity(identity.EMBEDDING_CODE + identity.PARTITION_CODE)["files"]
    )


def test_two_backbones_with_the_same_key_get_distinct_keys(tmp_path):
    """Two checkpoints whose names give the same key (here: the same random model spelled twice) make one cache,
    the second backbone keyed '-2', instead of failing after the whole embedding pass."""
    import h5py

    r = extract(
        dataset="offline-digits",
        backbone=["test_efficientnet=random", "test_efficientnet= random"],
        domains=["mnist"],
        per_class=2,
        test_per_class=2,
        image_size=32,
        out=tmp_path,
    )
    assert len(r["backbones"]) == 2 and r["backbones"][1] == r["backbones"][0] + "-2"
    with h5py.File(r["cache"]) as f:
        assert sorted(f["backbones"]) == sorted(r["backbones"])


@pytest.mark.parametrize("size", [32.7, 0, -32, True, "64"])
def test_api_refuses_an_image_size_that_is_not_a_whole_number_of_pixels(tmp_path, size):
    from featcache.extraction.plan import extract

    with pytest.raises(UserError, match="--image-size must be a whole number of pixels from 8 to 2048"):
        extract(image_size=size, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_default_image_size_follows_the_dataset_and_is_said():
    """Small images (the offline digits' 32 px) are embedded at 64 px, not at a backbone's own 224+; photos at each
    backbone's own size; either way one line says which and how to change it."""
    size, line = default_image_size("offline-digits", 32)
    assert size == SMALL_IMAGES == 64 and line.startswith("image size 64 (offline-digits images are 32 px;")
    assert "--image-size N" in line
    size, line = default_image_size("pacs", 227)
    assert size is None and line.startswith("image size: each backbone's own input size (pacs images are 227 px;")
    assert default_image_size("imagefolder", None)[0] is None


def test_default_image_size_is_keyed_as_the_explicit_size_and_a_label_partition_names_its_domain(tmp_path):
    args = dict(backbone=["test_resnet=random"], partition="label", clients=2, per_class=2, test_per_class=1)
    told = []
    with pytest.warns(UserWarning, match="RANDOM"):
        default = extract(**args, out=tmp_path, note=told.append)
    assert default["image_size"] == 64 and told == default["notes"] and len(told) == 2
    assert told[0].startswith("image size 64 (offline-digits images are 32 px")
    assert told[1] == "partition label splits one domain: mnist, the dataset's first (--domains NAME picks another)"
    explicit = extract(**args, image_size=64, out=tmp_path)
    assert explicit["cache"] == default["cache"] and explicit["cache_hit"] and explicit["notes"] == told[1:]
    assert extract(**args, out=tmp_path)["notes"] == told  # a cache hit says the same


def test_the_forward_buffer_is_allocated_once_and_holds_the_rows_in_order():
    """The pass's queue normalises rows of any chunk sizes into one buffer of exactly `size` rows (what keeps the
    pass's memory flat): each forward gets that same buffer, the rows in the order they came, the last one padded
    with zero images; the values are `normalise`'s."""
    import torch

    from featcache.extraction import embed as E
    from featcache.extraction import pipeline as P

    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    chunks = [torch.randint(0, 256, (n, 3, 4, 4), dtype=torch.uint8) for n in (3, 5, 2, 1)]  # 11 rows
    queue, got = E._Queue(4, mean, std), []
    for b, x in enumerate(chunks):
        got += [(x.data_ptr(), n, parts, x.clone()) for x, n, parts in queue.put(b, x)]
    got += [(x.data_ptr(), n, parts, x.clone()) for x, n, parts in queue.rest()]
    assert len({ptr for ptr, *_ in got}) == 1
    assert [(n, parts) for _, n, parts, _ in got] == [(4, [(0, 3), (1, 1)]), (4, [(1, 4)]), (3, [(2, 2), (3, 1)])]
    rows = torch.cat([x for *_, x in got])  # [12, 3, 4, 4]
    want = P.normalise(torch.cat(chunks), mean, std)  # [11, 3, 4, 4]
    assert torch.equal(rows[:11], want) and not rows[11].any()
    assert got[0][3].is_contiguous(memory_format=torch.channels_last)


def test_strided_rows_are_written_whole(tmp_path):
    """A ViT's pooled class token is a strided view (x[:, 0] of [B, T, D]): the writer writes its rows in order, as
    it writes a contiguous tensor's."""
    import torch

    from featcache.extraction.embed import _Writer

    tokens = torch.arange(4 * 3 * 5, dtype=torch.float32).reshape(4, 3, 5)  # [B, T, D]
    pooled = tokens[:, 0]  # [B, D], not C-contiguous
    assert not pooled.is_contiguous()
    writer = _Writer(torch.device("cpu"), lag=0)
    with open(tmp_path / "rows.bin", "wb") as fh:
        writer.put(fh, pooled)
        writer.flush()
    assert (tmp_path / "rows.bin").read_bytes() == pooled.contiguous().numpy().astype("<f4").tobytes()


@pytest.mark.slow
def test_a_vit_backbone_extracts_on_the_cpu(tmp_path):
    """A timm ViT (random weights, offline) through a whole CPU extraction: its class-token rows reach the cache."""
    r = extract(
        dataset="offline-digits",
        backbone=["vit_tiny_patch16_224=random"],
        per_class=1,
        test_per_class=1,
        image_size=32,
        domains=["mnist"],
        out=str(tmp_path),
    )
    with h5py.File(r["cache"]) as h:
        features = h["train/features/concat"][:]
    assert features.shape == (10, 192) and np.isfinite(features).all() and features.std(axis=0).max() > 0
