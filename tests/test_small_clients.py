"""Small clients: a client with fewer rows than a batch trains with the defaults (drop_last keeps a client's only
batch), every client with a row takes a step, extract warns about such clients, and train/grid say when a client
takes one local step per round or when configurations tie on validation."""

from __future__ import annotations

import warnings

import featcache
import pytest
import torch
from harness import folder_extract_args, run_cli, write_folders
from hypothesis import given
from hypothesis import strategies as st

from featcache.extraction.plan import TRAIN_BATCH
from featcache.algorithms import create
from featcache.testing import synthetic_clients
from featcache.training.config import ENGINE_SETTINGS
from featcache.training.schedule import (
    client_steps,
    dropped_note,
    one_step_note,
    plan_steps,
    trained_counts,
    trained_rows,
)
from tests.synthetic import write_cache


def test_extract_batch_is_trainings_default():
    assert TRAIN_BATCH == ENGINE_SETTINGS["batch_size"].default


@given(
    counts=st.lists(st.integers(1, 200), min_size=1, max_size=8),
    batch=st.integers(1, 64),
    drop_last=st.booleans(),
)
def test_every_client_with_a_row_takes_a_step(counts, batch, drop_last):
    steps = client_steps(counts, batch, drop_last)
    rows = trained_rows(counts, batch, drop_last)
    assert all(s >= 1 for s in steps)
    assert trained_counts(torch.tensor(counts), batch, drop_last).tolist() == rows
    for n, r in zip(counts, rows):
        if n >= batch and drop_last:  # at least one full batch: the last partial one is dropped, as before
            assert r == n // batch * batch
        else:  # no drop, or the client's only batch: every row
            assert r == n


@given(counts=st.lists(st.integers(1, 80), min_size=1, max_size=6), batch=st.integers(1, 48))
def test_the_plan_trains_every_client(counts, batch):
    N = max(counts)
    data = synthetic_clients(C=len(counts), n=(N, N), D=4, K=3)
    data.counts = torch.tensor(counts)  # [C] fewer valid rows than padded
    plan = plan_steps(data, batch, True)
    assert (plan.client_steps >= 1).all()
    trained = [sum(int(v[c].sum()) for v in plan.valid) for c in range(len(counts))]
    assert trained == trained_rows(counts, batch, True)


def test_a_cache_with_a_client_smaller_than_a_batch_trains_with_defaults(tmp_path):
    cache = write_cache(tmp_path / "c.h5", C=3, n=(10, 60), val_fraction=0.2)  # 51, 13, 39 rows
    counts = featcache.load_cache(cache, "train").counts.tolist()
    assert min(counts) < 32 <= max(counts)  # the README's alpha=0.1 shape: one client below batch_size=32
    with pytest.warns(UserWarning, match="one local step per round"):
        result = featcache.train(cache, "fedprox", rounds=2, seeds=[0], out=tmp_path / "runs")
    assert result["config"]["drop_last"] is True and result["config"]["batch_size"] == 32
    assert 0 <= result["mean_acc"] <= 100


def test_one_step_note_names_the_proximal_term_and_only_where_there_is_one():
    fedprox = create("fedprox")
    assert one_step_note(fedprox, [64, 70], 32, True, 1) == ""  # two steps each at least
    assert one_step_note(fedprox, [40], 32, False, 1) == ""  # 32 + 8 rows without drop_last
    assert one_step_note(fedprox, [10, 70], 32, True, 2) == ""  # two epochs: two steps
    line = one_step_note(fedprox, [10, 70, 40], 32, True, 1)
    assert "2 of 3 clients take one local step per round (10-40 rows" in line and "fedprox's proximal term" in line
    assert "\n" not in line
    for name in ("fedavg", "fedpcl"):  # no proximal term: one step from the global model is plain SGD
        assert one_step_note(create(name), [10, 70, 40], 32, True, 1) == ""


def test_dropped_note_says_the_share_of_rows_drop_last_leaves_out():
    assert dropped_note([64, 96], 32, True) == "" and dropped_note([50, 60], 32, False) == ""
    assert dropped_note([330, 10], 32, True) == ""  # 10 of 340: under a tenth; a client under a batch keeps its rows
    line = dropped_note([50, 60, 10], 32, True)  # 18 + 28 of 120 rows
    assert line.startswith("drop_last leaves 46 of 120 training rows (38 %) out of every local epoch")
    assert "drop_last=false" in line and "\n" not in line


def test_grid_notes_a_tie_and_says_which_it_picked(tmp_path):
    cache = write_cache(tmp_path / "c.h5", C=2, n=(20, 30), val_fraction=0.25)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = featcache.grid(
            cache, "fedprox", grid=["mu=0,0.5"], seeds=[0], rounds=2, out=tmp_path / "g", retrain=False
        )
    lines = [str(w.message) for w in seen]
    assert any("one local step per round" in s and "validation-fit" in s for s in lines)
    # one step from the global model: the proximal term has no gradient, so mu does not change the model
    assert out["selection"][0]["val_mean"] == out["selection"][1]["val_mean"]
    tie = [s for s in lines if "tie exactly on validation" in s]
    assert len(tie) == 1 and "'mu': 0.0" in tie[0] and "first of them in grid order" in tie[0]
    assert out["best"]["mu"] == 0.0


def test_extract_warns_in_one_line_about_a_client_smaller_than_a_batch(tmp_path):
    root = write_folders(tmp_path / "images", domains=("d1",), per_class=8)
    args = folder_extract_args(root, tmp_path / "out", "--partition", "iid", "--clients", "2")
    done = run_cli(*args)
    assert done.code == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "fewer training images than a batch of 32" in line]
    assert len(said) == 1 and "client 0 (" in said[0] and "client 1 (" in said[0]


def test_extract_names_the_clients_without_test_images_in_one_line():
    """A 1,000-client cache whose clients hold no test image is said at extraction, not refused by train later."""
    import numpy as np

    from featcache.extraction.partition.make import ClientPart
    from featcache.extraction.partition.spec import PartitionSpec
    from featcache.extraction.plan import untested_clients

    def part(n_test: int) -> ClientPart:
        return ClientPart("d", np.arange(40), np.arange(n_test), np.zeros(0, np.int64))

    spec = PartitionSpec(scheme="label", clients=3)
    assert untested_clients(spec, [part(5), part(1), part(2)], [spec]) == ""
    line = untested_clients(spec, [part(5), part(0), part(0)], [spec])
    assert line.startswith("2 of 3 clients hold no test image, client 1 (and 1 more) first, and train refuses")
    assert "\n" not in line
    sweep = [spec, PartitionSpec(scheme="label", clients=3, alpha=0.1)]
    assert untested_clients(sweep[1], [part(0)] * 3, sweep).startswith("cache alpha=0.1: 3 of 3 clients")
