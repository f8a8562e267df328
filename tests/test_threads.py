"""The thread policy (`featcache/threads.py`): the `featcache` command starts torch with its idle threads sleeping
(OpenMP reads that when torch loads, so it is checked in fresh interpreters, by what OpenMP itself reports) unless
the user set the wait policy; `threads=N` / `--threads N` runs train, grid and extract on N threads, recorded in the
result and the checkpoint's identity and restored afterwards, while leaving it out keeps torch's count (extract's
forward: one fewer than the cores); a bad count is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
from harness import BACKBONES, one_line_error, run_cli
from hypothesis import given, strategies as st
from synthetic import write_cache

from featcache.errors import UserError
from featcache.extraction import pipeline as P
from featcache.extraction.plan import extract
from featcache.threads import WAIT, check_threads, use_threads
from featcache.runs.select import grid
from featcache.runs.train import train

REPO = Path(__file__).resolve().parent.parent


def fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter whose environment has no OpenMP settings but `env`, OpenMP reporting its own."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=base | {"OMP_DISPLAY_ENV": "true"} | env,
    )


def omp_wait_policy(stderr: str) -> str:
    """The wait policy libgomp reports at start-up (OMP_DISPLAY_ENV)."""
    lines = [line for line in stderr.splitlines() if line.strip().startswith("OMP_WAIT_POLICY")]
    if not lines:
        pytest.skip("torch's OpenMP runtime does not report its settings (not GNU libgomp)")
    return lines[0].split("=")[1].strip().strip("'")


def test_the_command_starts_torch_with_its_threads_sleeping():
    done = fresh(
        "import sys, os, featcache.cli; loaded = 'torch' in sys.modules; import torch; torch.ones(1); "
        "print(loaded, os.environ['OMP_WAIT_POLICY'])"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", WAIT["OMP_WAIT_POLICY"]]  # set before torch loaded ...
    assert omp_wait_policy(done.stderr) == "PASSIVE"  # ... and OpenMP read it


@pytest.mark.parametrize("theirs", ["ACTIVE", "active"])
def test_a_wait_policy_the_user_set_is_kept(theirs):
    done = fresh(
        "import os, featcache.cli, torch; torch.ones(1); print(os.environ['OMP_WAIT_POLICY'])", OMP_WAIT_POLICY=theirs
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == theirs and omp_wait_policy(done.stderr) == "ACTIVE"


def test_importing_the_library_changes_nothing():
    done = fresh("import os, featcache, featcache.threads; print(os.environ.get('OMP_WAIT_POLICY'))")
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr


@given(st.one_of(st.integers(max_value=0), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.just([2])))
def test_a_bad_count_is_one_line(threads):
    with pytest.raises(UserError) as e:
        check_threads(threads)
    assert "\n" not in str(e.value) and "--threads must be a whole number >= 1" in str(e.value)


@pytest.mark.parametrize("command", ["train", "grid", "extract"])
def test_a_bad_count_on_the_command_line_is_one_line(command, tmp_path):
    args = {
        "train": ["--cache", "c.h5", "--algo", "fedavg"],
        "grid": ["--cache", "c.h5", "--algo", "fedavg", "--grid", "lr=0.1"],
        "extract": [],
    }[command]
    result = run_cli(command, *args, "--threads", "0", "--out", str(tmp_path / "out"))
    assert result.code == 2
    one_line_error(result, "--threads")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("threads", [9999, 2**31, 10**20])
def test_more_threads_than_cores_run_on_the_cores_with_one_warning_line(small_cache, tmp_path, threads):
    """--threads 9999 once started ~20,000 threads; 2^31 and 10^20 overflowed torch's count."""
    result = run_cli(
        "train",
        "--cache",
        small_cache,
        "--algo",
        "fedavg",
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--json",
        "--threads",
        str(threads),
        "--out",
        tmp_path,
    )
    assert result.code == 0 and "Traceback" not in result.stderr, result.stderr
    warned = [line for line in result.stderr.splitlines() if "--threads" in line]
    assert warned == [
        f"warning: --threads {threads} is more than the {P.cores()} cores this process may run on: "
        f"running on {P.cores()}"
    ]
    assert json.loads(result.stdout)["provenance"]["torch_threads"] == P.cores()
    with pytest.warns(UserWarning, match="running on"):
        assert check_threads(threads) == P.cores()


@pytest.mark.parametrize("threads", [0, -2, 1.5, "2", True])
def test_a_bad_count_in_the_api_is_refused_before_anything_is_written(small_cache, tmp_path, threads):
    calls = {
        "train": lambda out: train(small_cache, "fedavg", rounds=1, out=out, threads=threads),
        "grid": lambda out: grid(small_cache, "fedavg", grid=["lr=0.1"], rounds=1, out=out, threads=threads),
        "extract": lambda out: extract(out=out, threads=threads),
    }
    for name, call in calls.items():
        with pytest.raises(UserError, match="--threads must be a whole number >= 1"):
            call(tmp_path / name)
        assert not (tmp_path / name).exists(), name


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("threads") / "c.h5", C=3, D=8, K=3)


def test_train_runs_on_the_threads_asked_for_and_its_identity_says_so(small_cache, tmp_path):
    from featcache.runs import train as T

    before, seen, original = torch.get_num_threads(), [], T.run_configs

    def spy(*a, **k):  # the count where the run trains
        seen.append(torch.get_num_threads())
        return original(*a, **k)

    with mock.patch.object(T, "run_configs", spy):
        one = train(small_cache, "fedavg", rounds=2, seeds=[0], out=tmp_path, threads=1)
        again = train(small_cache, "fedavg", rounds=2, seeds=[0], out=tmp_path, threads=1)
        two = train(small_cache, "fedavg", rounds=2, seeds=[0], out=tmp_path, threads=2)
        default = train(small_cache, "fedavg", rounds=2, seeds=[0], out=tmp_path / "d")
    assert seen == [1, 2, before]  # `again` finished earlier: the same command at the same count trains nothing
    assert again.get("finished_earlier") and not two.get("finished_earlier")  # another count: another identity
    assert [r["provenance"]["torch_threads"] for r in (one, two, default)] == [1, 2, before]
    assert torch.get_num_threads() == before  # restored


def test_grid_runs_on_the_threads_asked_for(small_cache, tmp_path):
    before = torch.get_num_threads()
    result = grid(small_cache, "fedavg", grid=["lr=0.1,0.01"], seeds=[0], rounds=2, out=tmp_path, threads=1)
    assert result["provenance"]["torch_threads"] == 1 and torch.get_num_threads() == before


@pytest.mark.parametrize(
    "cores,torch_threads,asked,expected",
    [(4, 4, None, 3), (4, 2, None, 2), (1, 1, None, 1), (2, 2, 2, 2), (2, 2, 1, 1), (4, 1, 3, 3)],
)
def test_the_forward_runs_on_one_fewer_than_the_cores_unless_asked(cores, torch_threads, asked, expected):
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        with mock.patch.object(P, "cores", lambda: cores), use_threads(asked), P.forward_threads(torch.device("cpu")):
            inside = torch.get_num_threads()
        with P.forward_threads(torch.device("meta")):  # not a CPU forward: left alone
            assert torch.get_num_threads() == torch_threads
        assert inside == expected and torch.get_num_threads() == torch_threads
    finally:
        torch.set_num_threads(before)


def test_extract_runs_its_forward_on_the_threads_asked_for(images, tmp_path):
    """Through the command: `--threads N` is the forward's count, else one fewer than the cores; the cache's key does
    not depend on it."""
    seen, original = [], P.forward_threads

    @contextmanager
    def spy(device):
        with original(device):
            seen.append(torch.get_num_threads())
            yield

    before, names = torch.get_num_threads(), set()
    for threads in (None, 1, 2, 3):
        flags = [a for spec in BACKBONES for a in ("--backbone", spec)]
        flags += ["--threads", str(threads)] if threads else []
        with mock.patch.object(P, "forward_threads", spy):
            result = run_cli(
                "extract",
                "--dataset",
                "imagefolder",
                "--data-root",
                str(images),
                "--image-size",
                "32",
                "--batch-size",
                "4",
                "--out",
                str(tmp_path / str(threads)),
                "--json",
                *flags,
            )
        assert result.code == 0, result.stderr
        assert seen.pop() == (min(threads, P.cores()) if threads else min(before, max(1, P.cores() - 1))) and not seen
        assert torch.get_num_threads() == before
        names.add(Path(json.loads(result.stdout)["cache"]).name)
    assert len(names) == 1
