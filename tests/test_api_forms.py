"""The Python API takes each option in the command line's own form too: the comma lists the commands parse
(extract's --clients, --alpha, --per-class and --holdout-domain, the runs' --seeds) as the same strings, with the
same one-line errors, and a lone value where the command repeats an option."""

from __future__ import annotations

import inspect

import featcache
import pytest
import typer
from harness import folder_extract_args, run_cli, write_folders

from featcache.cli import app
from featcache.errors import UserError
from featcache.training.config import check_seeds
from tests.synthetic import write_cache

# command -> its options that take a comma list on the command line (parsed by the API function itself)
COMMA = {"extract": ("clients", "alpha", "per_class", "holdout_domain"), "train": ("seeds",), "grid": ("seeds",)}


def options(command: str) -> dict:
    return {p.name: p for p in typer.main.get_command(app).commands[command].params}


@pytest.mark.parametrize("command", sorted(COMMA))
def test_comma_options_are_strings_on_the_command_line_and_arguments_of_the_api(command):
    cli, api = options(command), inspect.signature(getattr(featcache, command)).parameters
    for name in COMMA[command]:
        assert cli[name].type.name == "text" and not cli[name].multiple, name  # one string, commas inside
        assert name in api


def test_seeds_take_the_command_lines_form():
    assert check_seeds("0,1,2") == check_seeds([0, 1, 2]) == [0, 1, 2] and check_seeds("4") == [4]
    with pytest.raises(UserError, match=r"--seeds '0,,1' has an empty item"):
        check_seeds("0,,1")
    with pytest.raises(UserError, match=r"--seeds '0,x': write comma-separated ints"):
        check_seeds("0,x")


def test_train_and_grid_take_seeds_as_the_command_writes_them(tmp_path):
    cache = write_cache(tmp_path / "c.h5", C=2, n=(40, 50))
    a = featcache.train(cache, "fedavg", rounds=1, seeds="0,1", out=tmp_path / "a")
    b = featcache.train(cache, "fedavg", rounds=1, seeds=[0, 1], out=tmp_path / "b")
    assert a["seeds"] == b["seeds"] == [0, 1] and a["mean_acc"] == b["mean_acc"]
    g = featcache.grid(cache, "fedavg", grid="lr=0.01,0.001", seeds="0,1", rounds=1, out=tmp_path / "g", retrain=False)
    assert g["seeds"] == [0, 1] and len(g["selection"]) == 2


def test_extract_takes_sweeps_as_the_command_writes_them(tmp_path):
    root = write_folders(tmp_path / "images", domains=("d1",), per_class=8)
    common = dict(
        dataset="imagefolder",
        data_root=root,
        backbone="test_resnet=random",
        image_size=32,
        partition="label",
        out=tmp_path / "cache",
    )
    text = featcache.extract(**common, clients="2,3", alpha="0.5,1")
    listed = featcache.extract(**common, clients=[2, 3], alpha=[0.5, 1.0])
    assert listed["cache_hit"] and [c["key"] for c in text["caches"]] == [c["key"] for c in listed["caches"]]
    one = featcache.extract(**common, clients="2", alpha="0.5")  # one value: one cache, not a sweep of one
    assert one["cache"] == text["caches"][0]["cache"]
    with pytest.raises(UserError, match=r"--clients '2,,3' has an empty item"):
        featcache.extract(**common, clients="2,,3")
    with pytest.raises(UserError, match=r"--alpha '0.5,x': write comma-separated floats"):
        featcache.extract(**common, alpha="0.5,x")


def test_the_command_line_reads_its_comma_lists_through_the_api(tmp_path):
    root = write_folders(tmp_path / "images", domains=("d1",), per_class=8)
    done = run_cli(*folder_extract_args(root, tmp_path / "out", "--partition", "label", "--clients", "2,3"))
    assert done.code == 0, done.stderr
    bad = run_cli(*folder_extract_args(root, tmp_path / "out", "--partition", "label", "--per-class", "2,"))
    assert bad.code == 2 and "--per-class '2,' has an empty item" in bad.stderr
