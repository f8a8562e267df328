"""Resumable training: a `train` run stopped by Ctrl-C or kill -9 and run again writes the bytes of an undisturbed
run; Ctrl-C is one line and exit code 130; a checkpoint of other code or a damaged one is refused in one line; a
finished run is not trained again.

The in-process tests send the process a real SIGINT from the progress callback (after a round). The slow ones run
the CLI through tests/crashpoint.py, which sends itself SIGKILL or SIGINT at the N-th call of a named function."""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import re
import signal
import time
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import driver, everything_in, lines, one_line_error, run_cli
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from featcache.errors import UserError
from featcache.runs import checkpoint as ck
from featcache.runs import trees
from featcache.runs.checkpoint import Interrupted
from featcache.runs.train import train
from tests.synthetic import write_cache

DRIVER = Path(__file__).with_name("crashpoint.py")
ENV = os.environ | {"OMP_NUM_THREADS": "1"}
SMALL = ["batch_size=8", "proj_dim=16"]
CROSS_ROUND = ["scaffold", "fedproto", "fedpcl", "pfedgate"]  # control variates; prototypes; both; optimizer state


@pytest.fixture(autouse=True)
def ctrl_c_reaches_python():
    """Python's own SIGINT handler, as a run from a terminal has it: a suite started with SIGINT ignored (`nohup make
    test &`) would otherwise never see the Ctrl-C these tests send."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache") / "c.h5", C=3, D=8, K=3, views=2, n=(16, 24))


def ctrl_c_after(round_: int):
    """A progress callback that sends this process SIGINT (a real Ctrl-C) when round `round_` is done."""

    def tick(done, total, *rest):
        if done == round_:
            os.kill(os.getpid(), signal.SIGINT)

    return tick


def result_bytes(r: dict) -> dict[str, bytes]:
    return {k: Path(r[k]).read_bytes() for k in ("result_file", "metrics_csv")}


def interrupted_then_resumed(cache, algo, out: Path, at: int, rounds: int = 4, **kw) -> dict:
    with pytest.raises(Interrupted, match=f"stopped after round {at} of {rounds}.*same command"):
        train(cache, algo, rounds=rounds, seeds=[0, 1], set=SMALL, out=out, progress=ctrl_c_after(at), **kw)
    (saved,) = out.glob(".*.checkpoint")
    assert [p.name for p in out.iterdir()] == [saved.name]  # nothing but the checkpoint
    return train(cache, algo, rounds=rounds, seeds=[0, 1], set=SMALL, out=out, **kw)


@pytest.mark.parametrize("algo", CROSS_ROUND)
def test_ctrl_c_then_the_same_call_gives_the_undisturbed_bytes(cache, tmp_path, algo):
    ref = train(cache, algo, rounds=4, seeds=[0, 1], set=SMALL, out=tmp_path / "ref", checkpoint_every=0)
    assert not [p for p in (tmp_path / "ref").iterdir() if p.name.startswith(".")]  # checkpoints off: none kept
    again = interrupted_then_resumed(cache, algo, tmp_path / "b", at=2)
    assert result_bytes(again) == result_bytes(ref)
    assert again["resumed_after_round"] == 2 and "resumed_after_round" not in ref
    timing = json.loads(Path(again["result_file"]).with_suffix(".timing.json").read_text())
    assert timing["resumed_after_round"] == 2  # the sidecar says how it ran; the result does not
    assert not list((tmp_path / "b").glob(".*.checkpoint")) and len(list((tmp_path / "b").glob(".*.done"))) == 1


def test_seconds_per_round_after_a_resume_is_the_mean_of_the_rounds_this_process_ran(cache, tmp_path, monkeypatch):
    """Rounds of 1 s stopped after round 2 of 4, then resumed with fast rounds: the resumed run's timing holds its
    own 2 rounds (each well under 1 s, even on a loaded machine), not the 4 rounds' mean of two processes (>= 0.5 s)."""
    from featcache.training.engine import Engine

    local_train = Engine.local_train
    monkeypatch.setattr(Engine, "local_train", lambda *a: (time.sleep(1.0), local_train(*a))[1])
    with pytest.raises(Interrupted):
        train(cache, "fedavg", rounds=4, seeds=[0], set=SMALL, out=tmp_path, progress=ctrl_c_after(2))
    monkeypatch.setattr(Engine, "local_train", local_train)
    r = train(cache, "fedavg", rounds=4, seeds=[0], set=SMALL, out=tmp_path)
    timing = json.loads(Path(r["result_file"]).with_suffix(".timing.json").read_text())
    assert timing["resumed_after_round"] == 2 and timing["rounds_timed"] == 2
    assert timing["seconds_per_round"] < 0.5 and timing["seconds_total"] < 1.0


def test_a_run_resumed_at_partial_participation_keeps_the_undisturbed_figures(cache, tmp_path):
    """FedPCL at p < 1, evaluated every round: an evaluation scores only the clients that trained since the last
    one; a resumed run knows which (from the seeded draws and the restored records) and writes the same bytes."""
    opts, kw = SMALL + ["participation=0.67", "eval_every=1"], {"rounds": 4, "seeds": [0, 1]}
    ref = train(cache, "fedpcl", set=opts, out=tmp_path / "ref", checkpoint_every=0, **kw)
    with pytest.raises(Interrupted):
        train(cache, "fedpcl", set=opts, out=tmp_path / "b", progress=ctrl_c_after(2), **kw)
    assert result_bytes(train(cache, "fedpcl", set=opts, out=tmp_path / "b", **kw)) == result_bytes(ref)


def test_a_finished_run_is_returned_without_training(cache, tmp_path, monkeypatch):
    first = train(cache, "fedavg", rounds=2, seeds=[0], set=SMALL, out=tmp_path, save_state=True)
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr("featcache.runs.train.run_configs", lambda *a, **k: pytest.fail("trained again"))
    again = train(cache, "fedavg", rounds=2, seeds=[0], set=SMALL, out=tmp_path, save_state=True)
    assert again["finished_earlier"] and {k: again[k] for k in first} == first
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()
    # the trained state in memory, a missing sidecar or a changed result file: trained again, same bytes
    kept = train(cache, "fedavg", rounds=2, seeds=[0], set=SMALL, out=tmp_path, keep_state=True)
    assert "finished_earlier" not in kept and "trained" in kept
    Path(first["metrics_csv"]).unlink()
    redone = train(cache, "fedavg", rounds=2, seeds=[0], set=SMALL, out=tmp_path)
    assert "finished_earlier" not in redone
    assert result_bytes(redone) == {k: before[Path(first[k])] for k in ("result_file", "metrics_csv")}


def test_checkpoints_off_write_and_read_nothing(cache, tmp_path):
    with pytest.raises(
        Interrupted, match="stopped in round 1 of 3; no checkpoint yet: the same command starts it again from round 1"
    ):
        train(
            cache, "fedavg", rounds=3, seeds=[0], set=SMALL, out=tmp_path, checkpoint_every=0, progress=ctrl_c_after(1)
        )  # no handler of ours: KeyboardInterrupt at once, in round 1's progress
    assert everything_in(tmp_path) == []
    r = train(cache, "fedavg", rounds=3, seeds=[0], set=SMALL, out=tmp_path, checkpoint_every=0)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert (
        "finished_earlier"
        not in train(cache, "fedavg", rounds=3, seeds=[0], set=SMALL, out=tmp_path, checkpoint_every=0)
        and r
    )


def test_a_second_ctrl_c_stops_at_once_and_resumes_from_the_last_checkpoint(cache, tmp_path):
    ref = train(cache, "fedproto", rounds=4, seeds=[0, 1], set=SMALL, out=tmp_path / "ref", checkpoint_every=0)

    def twice(done, total, *rest):  # after round 2: Ctrl-C (noted), then Ctrl-C again (stops in round 2... at once)
        if done == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    args = dict(rounds=4, seeds=[0, 1], set=SMALL, out=tmp_path / "b", checkpoint_every=1)
    with pytest.raises(Interrupted, match="stopped in round 2 of 4; the checkpoint holds round 1: run the same"):
        train(cache, "fedproto", progress=twice, **args)
    resumed = train(cache, "fedproto", **args)
    assert resumed["resumed_after_round"] == 1 and result_bytes(resumed) == result_bytes(ref)


def _checkpoint(cache, out: Path) -> Path:
    with pytest.raises(Interrupted):
        train(cache, "scaffold", rounds=3, seeds=[0], set=SMALL, out=out, progress=ctrl_c_after(1))
    (path,) = out.glob(".*.checkpoint")
    return path


def _rewrite(path: Path, edit) -> None:
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = json.loads(f.metadata()["featcache"]), {k: f.get_tensor(k) for k in f.keys()}
    edit(meta, tensors)
    save_file(tensors, str(path), metadata={"featcache": json.dumps(meta)})


def _forged(edit):
    """An edit that a forger makes and then signs: the checksum recomputed, so only the content gives it away."""

    def forge(m, t):
        edit(m, t)
        m["sha256"] = ck.digest(t, m)

    return forge


def _shrink(m, t):
    """The first tensor of the saved state one element shorter along its last axis (its layout still in its span)."""
    node = dict(m["trees"]["dict"])["params"]
    while "tensor" not in node:
        node = node["dict"][0][1]
    node["shape"][-1] -= 1


def _cut_records(m, t):
    loop = dict(m["trees"]["dict"])["loop"]
    dict(loop["dict"])["upload_floats"]["list"].pop()


TAMPER = {
    "other-code": (lambda m, t: m["identity"].update(code="0" * 64), "comes from other featcache or plug-in code"),
    "other-machine": (lambda m, t: m["identity"]["machine"].update(torch_threads=99), "another machine"),
    "values-changed": (
        lambda m, t: next(v for v in t.values() if v.is_floating_point()).add_(1),
        "damaged (its checksum does not match)",
    ),
    "round-changed": (lambda m, t: m.update(round=2), "damaged (its checksum does not match)"),
    "round-999-of-3": (_forged(lambda m, t: m.update(round=999)), "claims round 999 of a 3-round run"),
    "round-3-of-3": (_forged(lambda m, t: m.update(round=3)), "claims round 3 of a 3-round run"),
    "round-0": (_forged(lambda m, t: m.update(round=0)), "claims round 0 of a 3-round run"),
    "round-not-a-number": (_forged(lambda m, t: m.update(round="1")), "claims round '1' of a 3-round run"),
    "records-of-another-round": (_forged(lambda m, t: m.update(round=2)), "holds records that do not fit its round 2"),
    "records-cut": (_forged(_cut_records), "holds records that do not fit its round 1"),
    "other-shapes": (_forged(_shrink), "holds a state of other names or shapes than this run's"),
    "layout-out-of-its-span": (_forged(lambda m, t: m["pads"].update(dict.fromkeys(m["pads"], -5))), "is damaged"),
}


@pytest.mark.parametrize("case", TAMPER, ids=TAMPER)
def test_a_mismatched_or_tampered_checkpoint_is_refused_in_one_line_and_kept(cache, tmp_path, case):
    path = _checkpoint(cache, tmp_path)
    edit, needle = TAMPER[case]
    _rewrite(path, edit)
    before = path.read_bytes()
    with pytest.raises(UserError, match=re.escape(needle)):
        train(cache, "scaffold", rounds=3, seeds=[0], set=SMALL, out=tmp_path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]
    res = run_cli(
        "train",
        "--cache",
        cache,
        "--algo",
        "scaffold",
        "--rounds",
        "3",
        "--seeds",
        "0",
        "--out",
        tmp_path,
        *[a for s in SMALL for a in ("--set", s)],
    )
    assert "delete it to train from round 1" in one_line_error(res, needle)


def test_a_truncated_checkpoint_is_refused(cache, tmp_path):
    path = _checkpoint(cache, tmp_path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match=r"is damaged \(.*\): delete it to train from round 1"):
        train(cache, "scaffold", rounds=3, seeds=[0], set=SMALL, out=tmp_path)


def test_another_configuration_does_not_see_the_checkpoint(cache, tmp_path):
    path = _checkpoint(cache, tmp_path)
    other = train(cache, "scaffold", rounds=3, seeds=[1], set=SMALL, out=tmp_path)  # another seed: its own file
    assert "resumed_after_round" not in other and path.is_file()


def test_bad_checkpoint_every_is_one_line(cache, tmp_path):
    for bad in (-1, 1.5, True, "5"):
        with pytest.raises(UserError, match="checkpoint_every=.*number of rounds >= 0"):
            train(cache, "fedavg", rounds=1, seeds=[0], out=tmp_path, checkpoint_every=bad)
    assert everything_in(tmp_path) == []


def test_the_optimizer_state_round_trips_whatever_persists(tmp_path):
    """Parameters, moments and step counts are saved generically (`state_dict`), in the layout a fused step gave
    them (a transposed weight stays transposed: the next step's kernels see what an uninterrupted run's see)."""
    from featcache.training.hparams import HParams
    from featcache.training.optim import MASKED, OPTIMIZERS

    hp = HParams.of({"lr": [0.1, 0.01], "weight_decay": [0.0, 0.1], "momentum": [0.9, 0.0]}, "cpu")
    for kind in [*OPTIMIZERS.values(), *MASKED.values()]:
        make = lambda: kind({"w": torch.zeros(2, 3, 4, 5)}, hp)
        opt = make()
        for step in range(3):  # gradients in the transposed layout a linear weight's gradient arrives in
            g = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(step)).mT
            opt.step({"w": g}, [[True, step > 0, True], [False, True, True]])
        fresh = make()
        fresh.load_state_dict(trees.unpack(*trees.pack(opt.state_dict())))
        theirs, ours = fresh.state_dict(), opt.state_dict()
        assert theirs.keys() == ours.keys() and "params" in ours
        for name, values in ours.items():
            if name == "count":
                assert theirs[name] == values
                continue
            for k, t in values.items():
                assert torch.equal(theirs[name][k], t) and theirs[name][k].stride() == t.stride(), (kind, name)
        g = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(9)).mT
        for o in (opt, fresh):
            o.step({"w": g}, [[True] * 3, [True] * 3])
        assert torch.equal(fresh.params["w"], opt.params["w"]), kind


LAYOUTS = {  # name -> a tensor made from t [H, C, A, B] (a fresh one of its own, or a view of t)
    "itself": lambda t: t,
    "transposed-view": lambda t: t.mT,
    "transposed-own": lambda t: t.mT.contiguous().mT,  # what a fused optimizer step leaves: its own memory
    "broadcast": lambda t: t[:, :1].expand(t.shape),  # FedAvg's one model per configuration
    "offset-view": lambda t: t[1:, 1:],
    "gapped-view": lambda t: t[..., ::2],
    "contiguous-copy": lambda t: t.clone(),
    "zero-size": lambda t: t[:, :0],
}


@given(
    shape=st.tuples(*[st.integers(2, 5)] * 4),
    picks=st.lists(st.sampled_from(sorted(LAYOUTS)), min_size=1, max_size=6),
    again=st.booleans(),
)
def test_a_tree_comes_back_in_the_layouts_it_was_packed_in(shape, picks, again):
    """Values, shapes, strides, which tensors are views, which share memory (and where in it), which are the same
    object, and each address modulo 64 bytes: what a kernel's rounding can depend on."""
    base = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    leaves = [LAYOUTS[name](base) for name in picks] + ([base] if again else [])  # `again`: a leaf twice
    tree = {"a": {str(i): t for i, t in enumerate(leaves)}, "b": [leaves[0], 3, None, "x"], "c": (1.5, True)}
    back = trees.unpack(*trees.pack(tree))
    assert back["b"][1:] == [3, None, "x"] and back["c"] == (1.5, True)
    got = [*back["a"].values(), back["b"][0]]
    ours = [*tree["a"].values(), tree["b"][0]]
    for t, r in zip(ours, got):
        assert torch.equal(t, r) and t.stride() == r.stride() and (t._base is None) == (r._base is None)
        assert t.data_ptr() % trees.ALIGN == r.data_ptr() % trees.ALIGN or t.numel() == 0
    for i, (t, r) in enumerate(zip(ours, got)):  # shared memory, its offsets and object identity as they were
        for u, q in zip(ours[:i], got[:i]):
            if t.numel() and u.numel():
                assert (t.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()) == (
                    r.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
                )
                assert (
                    t.data_ptr() - u.data_ptr() == r.data_ptr() - q.data_ptr()
                ) or t.untyped_storage().data_ptr() != u.untyped_storage().data_ptr()
            assert (t is u) == (r is q)


# -- the checkpoint file's own failures: a full disk, a special file in its place ---------------------------------


def disk_full_at(n: int, pattern: str, code: int = errno.ENOSPC):
    """A Path.write_bytes whose n-th write of a file named like `pattern` writes half its bytes and fails as a full
    disk does."""
    real, calls = Path.write_bytes, []

    def write_bytes(self, data):
        if fnmatch.fnmatch(self.name, pattern):
            calls.append(self)
            if len(calls) == n:
                real(self, data[: len(data) // 2])
                raise OSError(code, os.strerror(code))
        return real(self, data)

    return write_bytes


def test_a_full_disk_keeps_the_last_checkpoint_and_the_same_command_resumes_from_it(cache, tmp_path, monkeypatch):
    """The checkpoint of round 4 cannot be written (ENOSPC): one line, the checkpoint of round 2 kept, and the
    same command resumes from round 2 to the undisturbed bytes."""
    args = dict(rounds=6, seeds=[0, 1], set=SMALL, checkpoint_every=2)
    ref = train(cache, "scaffold", out=tmp_path / "ref", **args)
    monkeypatch.setattr(Path, "write_bytes", disk_full_at(2, ".*.checkpoint.*.tmp"))
    out = tmp_path / "b"
    with pytest.raises(
        UserError,
        match=r"^scaffold \(seeds 0, 1\): no checkpoint of round 4: cannot write .*No space "
        r"left on device; disk full: free space and run the same command again, which "
        r"resumes from the checkpoint of round 2 \(kept\)$",
    ):
        train(cache, "scaffold", out=out, **args)
    (kept,) = out.glob(".*.checkpoint")
    assert [p.name for p in out.iterdir()] == [kept.name]  # no temporary left
    monkeypatch.undo()
    again = train(cache, "scaffold", out=out, **args)
    assert again["resumed_after_round"] == 2 and result_bytes(again) == result_bytes(ref)


def test_a_full_disk_before_any_checkpoint_says_the_run_starts_again(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(Path, "write_bytes", disk_full_at(1, ".*.checkpoint.*.tmp", errno.EFBIG))
    with pytest.raises(
        UserError,
        match=r"no checkpoint of round 1: .*ulimit -f.*, which starts it again from round 1 "
        r"\(no checkpoint was written\)$",
    ):
        train(cache, "fedavg", rounds=3, seeds=[0], set=SMALL, out=tmp_path, checkpoint_every=1)
    assert everything_in(tmp_path) == []


SPECIAL = {"folder": os.mkdir, "fifo": os.mkfifo, "broken-link": lambda p: os.symlink("nowhere", p)}


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("which", ["checkpoint", "done"])
def test_a_special_file_in_the_checkpoints_place_is_one_line_and_left_alone(cache, tmp_path, kind, which):
    path = _checkpoint(cache, tmp_path / "probe")  # the name this run's checkpoint takes
    place = tmp_path / "out" / path.with_suffix(f".{which}").name
    place.parent.mkdir()
    SPECIAL[kind](place)
    with pytest.raises(
        UserError,
        match=f"{re.escape(str(place))} is (a folder|a named pipe|a broken symbolic link)"
        ".*: featcache keeps a run's checkpoint under that name; move it away",
    ):
        train(cache, "scaffold", rounds=3, seeds=[0], set=SMALL, out=tmp_path / "out")
    assert [p.name for p in place.parent.iterdir()] == [place.name] and os.path.lexists(place)
    res = run_cli(
        "train",
        "--cache",
        cache,
        "--algo",
        "scaffold",
        "--rounds",
        "3",
        "--seeds",
        "0",
        "--out",
        tmp_path / "out",
        *[a for s in SMALL for a in ("--set", s)],
    )
    one_line_error(res, "featcache keeps a run's checkpoint under that name")


# -- the command, killed or interrupted in a real process (slow: a torch start-up per process) ------------------


def command(cache, *algos: str) -> list[str]:
    return [
        "train",
        "--cache",
        cache,
        *[a for algo in algos for a in ("--algo", algo)],
        "--rounds",
        "6",
        "--seeds",
        "0,1",
        *[a for s in SMALL for a in ("--set", s)],
        "--out",
        "runs",
        "--checkpoint-every",
        "2",
        "--json",
    ]


def results(out: Path) -> dict[str, bytes]:
    """The visible files but the timing sidecars (wall-clock times), by name."""
    return {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".") and "timing" not in p.name}


LOCAL_TRAIN = "featcache.training.engine.Engine.local_train"
KILLS = {  # kill -9 of the second algorithm (fedproto) of `--algo fedavg --algo fedproto`, 6 rounds
    "round-1-before-any-checkpoint": f"after:{LOCAL_TRAIN}:7:*",
    "round-3": f"after:{LOCAL_TRAIN}:9:*",
    "round-6": f"after:{LOCAL_TRAIN}:12:*",
    "inside-the-second-checkpoint-write": "before:os.replace:2:.fedproto-*.checkpoint",
    "result-written-record-not": "before:os.replace:1:.fedproto-*.done",
}


@pytest.mark.slow
def test_kill_9_at_several_points_then_the_same_command_gives_the_undisturbed_bytes(cache, tmp_path):
    ref = driver(tmp_path / "ref", command(cache, "fedavg", "fedproto"))
    assert ref.returncode == 0, ref.stderr
    reference = results(tmp_path / "ref" / "runs")
    assert len(reference) == 4
    for name, spec in KILLS.items():
        out = tmp_path / name / "runs"
        killed = driver(out.parent, command(cache, "fedavg", "fedproto"), ["--kill", spec])
        assert killed.returncode == -signal.SIGKILL, (name, killed.stderr)
        assert len(list(out.glob(".fedavg-*.done"))) == 1  # the first algorithm finished before the kill
        again = driver(out.parent, command(cache, "fedavg", "fedproto"))
        assert again.returncode == 0, (name, again.stderr)
        fedavg, fedproto = json.loads(again.stdout)["runs"]
        assert fedavg["finished_earlier"] and "finished_earlier" not in fedproto, name  # fedavg not trained again
        assert results(out) == reference, name
        assert not list(out.glob(".*.checkpoint")) and not list(out.glob(".*.tmp")), (name, everything_in(out))


@pytest.mark.slow
@pytest.mark.parametrize("how, code", [("--sigint", 130), ("--sigterm", 143)])
def test_ctrl_c_or_sigterm_prints_one_line_exits_and_resumes(cache, tmp_path, how, code):
    """Ctrl-C, and SIGTERM as a cluster stops a job, save where the run is; the driver starts with SIGINT ignored,
    as a background launch inherits it, and the CLI still stops on it."""
    ref = driver(tmp_path / "ref", command(cache, "scaffold"))
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "b" / "runs"
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the driver, as `cmd &` in a script does
    try:
        stopped = driver(out.parent, command(cache, "scaffold"), [how, f"after:{LOCAL_TRAIN}:3:*"])
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert stopped.returncode == code, stopped.stderr
    (line,) = lines(stopped.stderr)
    assert line == (
        "interrupted: scaffold (seeds 0, 1) stopped after round 3 of 6, checkpoint saved: run the same "
        "command again to resume"
    ), line
    again = driver(out.parent, command(cache, "scaffold"))
    assert again.returncode == 0, again.stderr
    assert results(out) == results(tmp_path / "ref" / "runs")


@pytest.mark.slow
def test_a_file_size_limit_on_the_next_checkpoint_keeps_the_last_one(cache, tmp_path):
    """A real kernel refusal (RLIMIT_FSIZE, as `ulimit -f`) of the checkpoint of round 4, in a run resumed from
    round 2: one line, exit code 2, the checkpoint of round 2 unchanged and no temporary left; without the limit the
    same command resumes from round 2 to the undisturbed bytes."""
    import resource

    plain = [a for a in command(cache, "scaffold") if a != "--json"]
    ref = driver(tmp_path / "ref", plain)
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "b" / "runs"
    stopped = driver(out.parent, plain, ["--sigint", f"after:{LOCAL_TRAIN}:2:*"])
    assert stopped.returncode == 130, stopped.stderr
    (kept,) = out.glob(".*.checkpoint")
    before = kept.read_bytes()
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2, len(before) // 2))
    limited = subprocess.run(
        [sys.executable, str(DRIVER), "--", *map(str, plain)],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=out.parent,
        timeout=600,
        preexec_fn=limit,
    )
    assert limited.returncode == 2 and "Traceback" not in limited.stderr, limited.stderr
    line = [x for x in lines(limited.stderr) if not x.startswith(("note:", "progress:"))]
    assert len(line) == 1 and line[0].startswith("error: scaffold (seeds 0, 1): no checkpoint of round 4"), line
    line = line[0]
    assert "ulimit -f" in line and line.endswith("which resumes from the checkpoint of round 2 (kept)"), line
    assert kept.read_bytes() == before and [p.name for p in out.iterdir()] == [kept.name]
    again = driver(out.parent, plain)
    assert again.returncode == 0, again.stderr
    assert "resumed from its checkpoint after round 2" in again.stderr
    assert results(out) == results(tmp_path / "ref" / "runs")


def test_a_resumed_run_says_from_which_round(cache, tmp_path):
    """Without --json the resumed run's first progress note names the round its checkpoint holds."""
    plain = [a for a in command(cache, "scaffold") if a != "--json"]
    stopped = driver(tmp_path, plain, ["--sigint", f"after:{LOCAL_TRAIN}:3:*"])
    assert stopped.returncode == 130, stopped.stderr
    again = driver(tmp_path, plain)
    assert again.returncode == 0, again.stderr
    assert "note: scaffold: resumed from its checkpoint after round 3" in again.stderr, again.stderr
