"""`reproduce` never falls silent while a job runs: a heartbeat calls the progress callback at least every
HEARTBEAT_S seconds (at most 30), each call a note that names what runs and for how long, and the CLI's plain
progress prints every note as a line."""

from __future__ import annotations

import threading
import time

import pytest

from featcache.cli.app import PLAIN_EVERY_S, plain_progress
from featcache.reproduce import run as R


class Stop(Exception):
    pass


def test_heartbeat_ticks_while_the_block_runs_and_stops_after(tmp_path):
    calls = []
    with R.heartbeat(lambda *a: calls.append(a), "p", 2, 5, "job 3 of 5 (fedavg) training", every=0.02):
        time.sleep(0.15)
    n = len(calls)
    time.sleep(0.06)
    assert n >= 3 and len(calls) == n  # ticks while running, none after
    assert all(c[:3] == ("p", 2, 5) and c[3].startswith("job 3 of 5 (fedavg) training, ") for c in calls)
    assert not any(t.name == "featcache-heartbeat" for t in threading.enumerate())
    with R.heartbeat(None, "p", 0, 1, "x", every=0.01):  # no callback: no thread
        assert not any(t.name == "featcache-heartbeat" for t in threading.enumerate())


def test_heartbeat_is_at_most_30_s_and_plain_progress_prints_every_note():
    assert R.HEARTBEAT_S <= 30 and PLAIN_EVERY_S <= 30
    lines, now = [], [0.0]
    update = plain_progress(lines.append, clock=lambda: now[0])
    update("p", 0, 4)
    for t in (20.0, 40.0):  # no round advanced, but each heartbeat note is a line
        now[0] = t
        update("p", 0, 4, f"job 1 of 4 (fedavg) training, {t:.0f} s")
    assert len(lines) == 3 and lines[-1].endswith("· job 1 of 4 (fedavg) training, 40 s")


def test_reproduce_beats_during_a_long_job_and_an_extraction(monkeypatch, tmp_path):
    """The pipeline's extraction and first job take ~0.3 s each; with a 0.05 s heartbeat both get lines."""
    monkeypatch.setattr(R, "HEARTBEAT_S", 0.05)

    def slow_extract(kwargs, cache, progress):
        time.sleep(0.3)
        return {"cache": "c.h5", "backbones": ["b"], "client_domains": [], "classes": 10, "dims": [8]}

    def slow_job(job, info, out):
        time.sleep(0.3)
        raise Stop  # enough: the job ran long and was watched

    monkeypatch.setattr(R, "_extract", slow_extract)
    monkeypatch.setattr(R, "run_job", slow_job)
    notes = []
    with pytest.raises(Stop):
        R.reproduce("fedpcl-table2", profile="quick", out=tmp_path / "o", cache=tmp_path / "c",
                    progress=lambda label, done, total, note="": notes.append(note))  # fmt: skip
    assert sum(n.startswith("extracting, ") for n in notes) >= 2
    assert sum(n.startswith("job 1 of ") and " training, " in n for n in notes) >= 2
    assert not any(t.name == "featcache-heartbeat" for t in threading.enumerate())  # stopped on the error too
