"""End to end on real pixels: extract offline-digits with a real offline backbone, then train every registered
algorithm a few rounds on the cache (backbones are not loaded while training)."""

from __future__ import annotations

import sys

import pytest

from featcache.algorithms import list_algorithms
from featcache.extract import extract
from featcache.train import train


@pytest.fixture(scope="module")
def digits_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    return extract(dataset="offline-digits", backbone=["efficientnet_lite0"], partition="feature", per_class=8,
                   test_per_class=5, image_size=32, views=2, out=out)["cache"]


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(list_algorithms()))
def test_every_algorithm_trains_on_extracted_digits(digits_cache, tmp_path, algo):
    before = set(sys.modules)
    res = train(digits_cache, algo, rounds=3, seeds=[0], set=["batch_size=16"], out=tmp_path)
    assert "timm" not in set(sys.modules) - before  # training never builds a backbone
    assert len(res["per_client"]) == 4 and 0 <= res["mean_acc"] <= 100
    assert res["params_uploaded_per_round"] >= 0 and len(res["curve"]["mean_acc"]) == 3
