"""End to end on real pixels: extract offline-digits with a real offline backbone, then train every registered
algorithm a few rounds on the cache: each must beat twice chance, and training never loads a backbone."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import fast_settings

from featcache.algorithms import list_algorithms
from featcache.extraction.plan import extract
from featcache.runs.train import train


CHANCE = 2 * 100 / 10  # twice chance with 10 classes: a head that learned nothing cannot reach it


@pytest.fixture(scope="module")
def digits_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    return extract(
        dataset="offline-digits",
        backbone=["efficientnet_lite0"],
        partition="feature",
        per_class=16,
        test_per_class=5,
        image_size=32,
        views=2,
        out=out,
    )["cache"]


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(list_algorithms()))
def test_every_algorithm_trains_on_extracted_digits(digits_cache, tmp_path, algo):
    fast = [f"{k}={v}" for k, v in fast_settings(algo).items()]
    res = train(digits_cache, algo, rounds=3, seeds=[0], set=["batch_size=16", *fast], out=tmp_path)
    assert len(res["per_client"]) == 4 and 0 <= res["mean_acc"] <= 100
    assert res["mean_acc"] > CHANCE, f"{algo} does not beat chance on real digits: {res['mean_acc']:.1f} %"
    assert res["params_uploaded_per_round"] >= 0 and len(res["curve"]["mean_acc"]) == 3


@pytest.mark.slow
def test_training_never_loads_timm(digits_cache, tmp_path):
    """In a fresh interpreter (this one imported timm for the extraction), training on a real cache whose metadata
    names a timm backbone never imports timm: training never builds a backbone."""
    code = (
        "import sys; from featcache.runs.train import train; "
        f"train({str(digits_cache)!r}, 'fedpcl', rounds=1, seeds=[0], set=['batch_size=16'], "
        f"out={str(tmp_path)!r}); print(sorted(m for m in sys.modules if m.split('.')[0] == 'timm'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
