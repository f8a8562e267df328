"""Hostile and careless input to train / grid / report / info / verify. Each bad input is one line
on stderr starting with `error:`, exit code 2, no traceback, and no file created or changed anywhere in the test's
folder (no result, no run folder, no temporary). The table `CASES` is grouped by kind: output locations, grid
values after the first, setting ranges, devices, report inputs, malformed caches, memory. A bug that is not a user
error is one `internal error:` line with exit code 1 (FEATCACHE_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest
import torch
from harness import after_notes, edit_cache, everything_in, lines, one_line_error, run_cli

from featcache import cache as C
from featcache.errors import UserError
from tests.synthetic import write_cache

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory) -> Path:
    return Path(write_cache(tmp_path_factory.mktemp("cache") / "synthetic.h5"))


@pytest.fixture(scope="module")
def good_result(good_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("result")
    res = run_cli(
        "train",
        "--cache",
        good_cache,
        "--algo",
        "fedavg",
        "--rounds",
        "2",
        "--seeds",
        "0",
        "--set",
        "batch_size=8",
        "--out",
        out,
        "--json",
        "--save-state",
    )
    assert res.code == 0, res.stderr
    return Path(json.loads(res.stdout)["result_file"])


class Ctx:
    """What a case builds its arguments from: the test's own folder, a good cache, a good result file."""

    def __init__(self, tmp: Path, cache: Path, result: Path, monkeypatch) -> None:
        self.tmp, self.good_cache, self.result, self.monkeypatch = tmp, cache, result, monkeypatch
        self.out = tmp / "out"

    def cache(self) -> Path:
        return Path(shutil.copy(self.good_cache, self.tmp / "c.h5"))

    def file(self, name: str, content: str | bytes) -> Path:
        p = self.tmp / name
        p.write_bytes(content.encode() if isinstance(content, str) else content)
        return p


def train(*extra: str, algo: str = "fedavg") -> Callable[[Ctx], list]:
    return lambda x: [
        "train",
        "--cache",
        x.cache(),
        "--algo",
        algo,
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--set",
        "batch_size=8",
        "--out",
        x.out,
        *extra,
    ]


def grid(*extra: str, algo: str = "fedavg", axis: str = "lr=0.1,0.01") -> Callable[[Ctx], list]:
    return lambda x: [
        "grid",
        "--cache",
        x.cache(),
        "--algo",
        algo,
        "--grid",
        axis,
        "--seeds",
        "0",
        "--rounds",
        "1",
        "--set",
        "batch_size=8",
        "--out",
        x.out,
        *extra,
    ]


def with_out(make: Callable[[Ctx], list], out: Callable[[Ctx], Path]) -> Callable[[Ctx], list]:
    """A command whose --out is replaced by out(ctx)."""

    def build(x: Ctx) -> list:
        args = make(x)
        args[args.index("--out") + 1] = out(x)
        return args

    return build


def a_file(x: Ctx) -> Path:
    return x.file("taken", "I am a file")


def below_a_file(x: Ctx) -> Path:
    return a_file(x) / "sub" / "runs"


def read_only(x: Ctx) -> Path:
    folder = x.tmp / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: let the permission check see what a user would
        real = os.access
        x.monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if Path(p) == folder else real(p, m, *a, **k))
    return folder / "runs"


def fail_rename(code: int) -> Callable[[Ctx], list]:
    """Any command; the atomic writer's final rename fails with `code` (what a full disk or a size limit does)."""

    def arm(x: Ctx) -> None:
        def refuse(src, dst):
            raise OSError(code, os.strerror(code), str(dst))

        x.monkeypatch.setattr("featcache.atomic.os.replace", refuse)

    return arm


def armed(arm: Callable[[Ctx], None], make: Callable[[Ctx], list]) -> Callable[[Ctx], list]:
    def build(x: Ctx) -> list:
        args = make(x)
        arm(x)
        return args

    return build


def report(*files: Callable[[Ctx], Path], out: bool = False) -> Callable[[Ctx], list]:
    return lambda x: ["report", *[f(x) for f in files], *(["--out", x.out] if out else [])]


def result_edited(edit: Callable[[dict], None]) -> Callable[[Ctx], Path]:
    def make(x: Ctx) -> Path:
        r = json.loads(x.result.read_text())
        edit(r)
        return x.file("edited.json", json.dumps(r))

    return make


def drop(key: str) -> Callable[[dict], None]:
    return lambda r: r.pop(key)


def fifo(x: Ctx) -> Path:
    """A named pipe: opening it for reading would wait for a writer forever."""
    os.mkfifo(x.tmp / "pipe.h5")
    return x.tmp / "pipe.h5"


def folder(x: Ctx) -> Path:
    (x.tmp / "folder.h5").mkdir()
    return x.tmp / "folder.h5"


def long_name(x: Ctx) -> Path:
    return x.tmp / ("n" * 300)  # over NAME_MAX (255 bytes)


def shorter_curve(r: dict) -> None:
    r["curve"]["mean_acc"] = r["curve"]["mean_acc"][:-1]


def wrong_type(r: dict) -> None:
    r["mean_acc"] = "high"


def tampered(edit: Callable[[h5py.File], None], reseal: bool = True) -> Callable[[Ctx], Path]:
    """A copy of the good cache edited in place (checksums rewritten, so only the content checks can tell)."""

    return lambda x: edit_cache(x.cache(), edit, reseal)


def with_cache(make: Callable[[Ctx], list], cache: Callable[[Ctx], Path]) -> Callable[[Ctx], list]:
    """A command whose --cache is replaced by cache(ctx)."""

    def build(x: Ctx) -> list:
        args = make(x)
        args[args.index("--cache") + 1] = cache(x)
        return args

    return build


def cmd(command: str, make_cache: Callable[[Ctx], Path], *extra: str) -> Callable[[Ctx], list]:
    def build(x: Ctx) -> list:
        path = make_cache(x)
        if command == "train":
            return ["train", "--cache", path, "--algo", "fedavg", "--rounds", "1", "--seeds", "0", "--out", x.out]
        return [command, path, *extra]

    return build


def no_backbones(f: h5py.File) -> None:
    del f["backbones"]


def array_attr(f: h5py.File) -> None:
    f.attrs["classes"] = np.arange(3)


def not_json_attr(f: h5py.File) -> None:
    f.attrs["counts"] = "{not json"


def no_clients(f: h5py.File) -> None:
    del f["train"], f["test"]
    f.attrs["counts"] = json.dumps({"clients": []})
    f.attrs["images"] = 0


def drop_rows(f: h5py.File, split: str, c: int) -> None:
    """Client c's rows of every dataset of `split` removed (and, of train, its validation positions), the split's
    offsets rewritten to agree."""
    names: list[str] = []
    f[split].visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    for name in names:
        by = {"offsets": None, "val_offsets": None, "val_index": "val_offsets"}.get(name, "offsets")
        if by is None:
            continue
        cut = f[f"{split}/{by}"][...]
        x = f[f"{split}/{name}"][...]
        del f[f"{split}/{name}"]
        f[f"{split}/{name}"] = np.concatenate([x[: cut[c]], x[cut[c + 1] :]])
    for name in ("offsets", "val_offsets") if split == "train" else ("offsets",):
        cut = f[f"{split}/{name}"][...]
        f[f"{split}/{name}"][...] = np.concatenate([cut[: c + 1], cut[c + 1 :] - (cut[c + 1] - cut[c])])


def zero_row_client(f: h5py.File) -> None:
    """Client 1 keeps no training rows; the counts are rewritten to agree, so only the zero-row check can tell."""
    meta = C.read_attrs(f)
    drop_rows(f, "train", 1)
    rows = meta["counts"]["clients"]
    meta_images = meta["images"] - rows[1]["train"]
    rows[1]["train"], rows[1]["val"] = 0, 0
    f.attrs["counts"] = json.dumps({"clients": rows}, sort_keys=True)
    f.attrs["images"] = meta_images


def concat_differs(f: h5py.File) -> None:
    f["backbones/synth"].attrs["columns"] = "[1, 17]"


def label_out_of_range(f: h5py.File) -> None:
    f["train/labels"][0] = 99


def feature_value(value: float) -> Callable[[h5py.File], None]:
    """One training feature of client 0 set to `value` (resealed: only the content checks can tell)."""

    def edit(f: h5py.File) -> None:
        f["train/features/concat"][0, 0] = value

    return edit


def no_test_rows(f: h5py.File) -> None:
    """Client 1 keeps no test rows; the counts are rewritten to agree."""
    meta = C.read_attrs(f)
    drop_rows(f, "test", 1)
    rows = meta["counts"]["clients"]
    f.attrs["images"] = meta["images"] - rows[1]["test"]
    rows[1]["test"] = 0
    f.attrs["counts"] = json.dumps({"clients": rows}, sort_keys=True)


def damaged_test_features(f: h5py.File) -> None:
    f["test/features/concat"][f["test/offsets"][2], 0] += 1.0  # client 2's first row, not resealed: the checksum tells


def no_val_rows(x: Ctx) -> Path:
    return Path(write_cache(x.tmp / "noval.h5", val_fraction=0.0))


def plugin(name: str, body: str) -> Callable[[Ctx], str]:
    """A plug-in file in the test's folder: a FedAvg subclass `name` with the methods of `body`."""
    head = (
        "import sys\nimport torch\nfrom featcache.algorithms.base import FedAvg\nfrom featcache.training.config "
        f"import Setting\n\n\nclass P(FedAvg):\n    name = {name!r}\n"
    )
    return lambda x: f"{x.file(name + '.py', head + textwrap.indent(textwrap.dedent(body), '    '))}:P"


CLIENT_HOOK = "fedavg_server = False\n"  # after_local runs: FedAvg's server path would skip it
PREDICT = "def predict(self, params, buffers, x, ctx):\n    s = super().predict(params, buffers, x, ctx)\n"
PLUGINS = {
    "predict-nan": PREDICT + "    return s * float('nan')\n",
    "predict-all-minus-inf": PREDICT + "    return torch.full_like(s, float('-inf'))\n",
    "predict-classes": PREDICT + "    return s[:, :2]\n",
    "loss-not-scalar": "def local_loss(self, params, buffers, x, y, mask, ctx):\n"
    "    loss, new = super().local_loss(params, buffers, x, y, mask, ctx)\n"
    "    return loss * torch.ones(3), new\n",
    "lr-fast": "settings = {'lr': Setting('fast', 'a rate')}\n",
    "exits": CLIENT_HOOK + "def after_local(self, state, rnd):\n    sys.exit(0)\n",
    "interrupts": CLIENT_HOOK + "def after_local(self, state, rnd):\n    raise KeyboardInterrupt\n",
    "ctrl-c": CLIENT_HOOK + "def after_local(self, state, rnd):\n    import os, signal, time\n"
    "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(5)\n",
    "prints": CLIENT_HOOK + "def after_local(self, state, rnd):\n    print('a plug-in talks on stdout')\n"
    "    return super().after_local(state, rnd)\n",
    "raises": CLIENT_HOOK + "def after_local(self, state, rnd):\n    raise ValueError('boom')\n",
}


def with_plugin(make: Callable, key: str, command: str = "train") -> Callable[[Ctx], list]:
    """`make` (train or grid) with --algo the plug-in PLUGINS[key] (registered under a name of its own per command)."""
    spec = plugin(f"{key}-{command}", PLUGINS[key])

    def build(x: Ctx) -> list:
        args = make(x)
        args[args.index("--algo") + 1] = spec(x)
        return args

    return build


def result_copy(x: Ctx, edit: Callable[[dict], None] | None = None, metrics: str | None = None) -> Path:
    """The good result (edited) in the test's folder, with `metrics` as its metrics.csv when given."""
    r = json.loads(x.result.read_text())
    if edit:
        edit(r)
    path = x.file("copy.json", json.dumps(r))
    if metrics is not None:
        x.file("copy.metrics.csv", metrics)
    return path


def set_curve(key: str, value) -> Callable[[dict], None]:
    return lambda r: r["curve"].__setitem__(key, value)


def state_edited(edit: Callable[[dict, dict], None]) -> Callable[[Ctx], Path]:
    """A copy of the good saved state with its tensors and metadata edited by edit(tensors, meta)."""

    def make(x: Ctx) -> Path:
        from safetensors.torch import save_file

        from featcache.runs.states import load_state

        tensors, meta = load_state(x.result.with_suffix("").with_suffix(".state.safetensors"))
        edit(tensors, meta)
        path = x.tmp / "edited.state.safetensors"
        save_file(tensors, str(path), metadata={"featcache": json.dumps(meta, sort_keys=True)})
        return path

    return make


def wider(tensors: dict, meta: dict) -> None:
    tensors["params/cls0.bias"] = torch.zeros(*tensors["params/cls0.bias"].shape[:2], 7)


def other_algo(tensors: dict, meta: dict) -> None:
    meta["algo"] = meta["algo_spec"] = "fedpcl"


def nan_params(tensors: dict, meta: dict) -> None:
    tensors["params/proj0.weight"][0, 0, 0, 0] = float("nan")


def plot(state: Callable[[Ctx], Path]) -> Callable[[Ctx], list]:
    return lambda x: ["plot", state(x), "--cache", x.good_cache, "--method", "pca", "--out", x.out / "f.png"]


HUGE = str(2**63)

# name -> (arguments built in the test's folder, text the one stderr line contains)
CASES: dict[str, tuple[Callable[[Ctx], list], str]] = {
    # 1. output locations (train, grid, report)
    "train-out-is-a-file": (with_out(train(), a_file), "is a file, not a folder"),
    "grid-out-is-a-file": (with_out(grid(), a_file), "is a file, not a folder"),
    "report-out-is-a-file": (lambda x: ["report", x.result, "--out", a_file(x)], "is a file, not a folder"),
    "train-out-below-a-file": (with_out(train(), below_a_file), "is below the file"),
    "grid-out-below-a-file": (with_out(grid(), below_a_file), "is below the file"),
    "report-out-below-a-file": (lambda x: ["report", x.result, "--out", below_a_file(x)], "is below the file"),
    "train-out-read-only": (with_out(train(), read_only), "not writable"),
    "grid-out-read-only": (with_out(grid(), read_only), "not writable"),
    "report-out-read-only": (lambda x: ["report", x.result, "--out", read_only(x)], "not writable"),
    "train-disk-full": (armed(fail_rename(errno.ENOSPC), train()), "disk full"),
    "train-file-size-limit": (armed(fail_rename(errno.EFBIG), train()), "file size limit"),
    "grid-permission-at-write": (armed(fail_rename(errno.EACCES), grid()), "permission denied"),
    "report-eperm-at-write": (
        armed(fail_rename(errno.EPERM), lambda x: ["report", x.result, "--out", x.out]),
        "permission denied",
    ),
    "train-out-name-too-long": (with_out(train(), long_name), "is 300 bytes, over the file system's limit of 255"),
    "grid-out-name-too-long": (with_out(grid(), long_name), "is 300 bytes, over the file system's limit of 255"),
    "report-out-name-too-long": (lambda x: ["report", x.result, "--out", long_name(x)], "is 300 bytes, over the"),
    "train-out-empty": (with_out(train(), lambda x: ""), "--out is an empty path"),
    "report-out-empty": (lambda x: ["report", x.result, "--out", ""], "--out is an empty path"),
    # cache and result paths that exist but are no file: said as what they are, never opened (a pipe would hang)
    "train-cache-fifo": (with_cache(train(), fifo), "pipe.h5 is a named pipe, not a file"),
    "train-cache-folder": (with_cache(train(), folder), "folder.h5 is a folder, not a file"),
    "train-cache-dev-zero": (with_cache(train(), lambda x: Path("/dev/zero")), "/dev/zero is a character device"),
    "train-cache-empty": (with_cache(train(), lambda x: ""), "--cache is an empty path"),
    "grid-cache-fifo": (with_cache(grid(), fifo), "pipe.h5 is a named pipe, not a file"),
    "info-fifo": (lambda x: ["info", fifo(x)], "pipe.h5 is a named pipe, not a file"),
    "info-dev-zero": (lambda x: ["info", "/dev/zero"], "/dev/zero is a character device, not a file"),
    "info-empty": (lambda x: ["info", ""], "CACHE is an empty path"),
    "verify-fifo": (lambda x: ["verify", fifo(x)], "pipe.h5 is a named pipe, not a file"),
    "verify-folder": (lambda x: ["verify", folder(x)], "folder.h5 is a folder, not a file"),
    "migrate-fifo": (lambda x: ["migrate", fifo(x)], "pipe.h5 is a named pipe, not a file"),
    "report-fifo": (report(fifo), "pipe.h5 is a named pipe, not a file"),
    "report-empty": (lambda x: ["report", ""], "RESULTS is an empty path"),
    # 2. grid values after the first, and the grid's own options
    "grid-batch-size-0": (grid(axis="batch_size=32,0"), "batch_size=0 out of range"),
    "grid-rounds-0": (grid(axis="rounds=2,0"), "rounds=0 out of range"),
    "grid-proj-dim-0": (grid(algo="fedpcl", axis="proj_dim=16,0"), "proj_dim=0 out of range"),
    "grid-optimizer-bogus": (grid(axis="optimizer=adam,bogus"), "optimizer must be one of adam, sgd (got 'bogus')"),
    "grid-participation-2": (grid(axis="participation=0.5,2"), "participation=2.0 out of range"),
    "grid-chunk-0": (grid("--chunk", "0"), "--chunk 0"),
    "grid-chunk-negative": (grid("--chunk", "-1"), "--chunk -1"),
    "grid-axis-twice": (grid("--grid", "lr=0.5"), "--grid lr is given twice"),
    "grid-value-twice": (grid(axis="lr=0.1,0.1"), "lists 0.1 twice"),
    "grid-axis-and-set": (grid("--set", "lr=0.5"), "lr is both a --grid axis and --set lr"),
    "grid-axis-and-rounds": (grid(axis="rounds=1,2"), "rounds is both a --grid axis and --rounds"),
    "grid-empty-value": (grid(axis="lr=0.1,"), "empty value"),
    "grid-fedpft-heads": (grid(algo="fedpft", axis="heads=1,3"), "must be a multiple of heads=3"),
    # 3. settings out of their declared ranges, conflicts, seeds
    "lr-negative": (train("--set", "lr=-1"), "lr=-1.0 out of range"),
    "lr-nan": (train("--set", "lr=nan"), "lr=nan is not a finite number"),
    "fedprox-mu-negative": (train("--set", "mu=-100", algo="fedprox"), "mu=-100.0 out of range"),
    "fedpcl-tau-negative": (train("--set", "tau=-1", algo="fedpcl"), "tau=-1.0 out of range"),
    "fedcac-tau-above-one": (train("--set", "tau=2", algo="fedcac"), "tau=2.0 out of range: tau must satisfy 0 <= tau"),
    "momentum-negative": (train("--set", "momentum=-5"), "momentum=-5.0 out of range"),
    "momentum-one": (train("--set", "momentum=1"), "momentum=1.0 out of range"),
    "participation-selects-nobody": (train("--set", "participation=1e-9"), "selects no client"),
    "rounds-twice": (train("--set", "rounds=3"), "--rounds 1 and --set rounds=3 both given"),
    "set-key-twice": (train("--set", "lr=0.1", "--set", "lr=0.2"), "--set lr is given twice"),
    "seeds-duplicate": (lambda x: train()(x) + ["--seeds", "0,0"], "lists seed 0 twice"),
    "seeds-huge": (lambda x: train()(x) + ["--seeds", HUGE], f"seed {HUGE} is out of range"),
    "seeds-negative": (lambda x: train()(x) + ["--seeds", "-1"], "seed -1 is out of range"),
    "grid-seeds-huge": (lambda x: grid()(x) + ["--seeds", "1" + HUGE], "is out of range"),
    "algo-twice": (lambda x: train()(x) + ["--algo", "fedavg"], "--algo fedavg is given twice"),
    "setting-of-one-algo-unscoped": (
        lambda x: train("--set", "mu=-1")(x) + ["--algo", "fedprox"],
        "mu is a setting of fedprox only: write fedprox.mu=-1",
    ),
    "scoped-setting-out-of-range": (
        lambda x: train("--set", "fedprox.mu=-1")(x) + ["--algo", "fedprox"],
        "fedprox: mu=-1.0 out of range",
    ),
    "scope-not-chosen": (train("--set", "fedprox.mu=1"), "fedprox is not the algorithm of this run (fedavg)"),
    "scope-not-among-chosen": (
        lambda x: train("--set", "fedprx.mu=1")(x) + ["--algo", "fedprox"],
        "fedprx is not among the chosen algorithms (did you mean: fedprox",
    ),
    "scoped-unknown-setting": (train("--set", "fedavg.mu=1"), "unknown setting 'mu' for fedavg"),
    "grid-scope-not-chosen": (grid(axis="fedprox.mu=0.1,1"), "--grid fedprox.mu: fedprox is not the algorithm"),
    "grid-scoped-axis-and-set": (grid("--set", "fedavg.lr=0.5"), "lr is both a --grid axis and --set lr"),
    "rounds-twice-scoped": (train("--set", "fedavg.rounds=3"), "--rounds 1 and --set rounds=3 both given"),
    "grid-rounds-twice-scoped": (grid("--set", "fedavg.rounds=3"), "--rounds 1 and --set fedavg.rounds=3 both given"),
    "int-setting-huge": (train("--set", "eval_every=" + HUGE), "too large"),
    "set-scope-empty": (train("--set", ".lr=1"), "--set .lr=1: the algorithm name before the '.' is empty"),
    "set-scoped-key-empty": (train("--set", "fedavg.=1"), "--set fedavg.=1: the setting name after the '.' is empty"),
    "set-key-empty": (train("--set", "=1"), "--set '=1' has no key before '='"),
    "set-setting-with-a-dot": (
        train("--set", "fedprox.mu.x=1", algo="fedprox"),
        "fedprox has no setting 'mu.x' (did you mean: mu?)",
    ),
    "grid-scope-empty": (grid(axis=".lr=0.1,0.01"), "--grid .lr=: the algorithm name before the '.' is empty"),
    "participation-of-the-second-algo-selects-nobody": (
        lambda x: train("--set", "fedprox.participation=1e-9")(x) + ["--algo", "fedprox"],
        "selects no client of 4",
    ),
    # 4. devices
    "train-device-foo": (train("--device", "foo"), "is not a device"),
    "grid-device-foo": (grid("--device", "foo"), "is not a device"),
    "train-device-cuda": (train("--device", "cuda"), "CUDA is not available"),
    "grid-device-cuda-9": (grid("--device", "cuda:9"), "CUDA"),
    # 5. report inputs (a single bad file is refused; see the multi-file test for skipping)
    "report-timing-sidecar": (report(lambda x: x.result.with_suffix(".timing.json")), ".timing.json sidecar"),
    "report-grid-json": (
        report(lambda x: x.file("grid.json", json.dumps({"axes": {}, "selection": []}))),
        "a grid summary",
    ),
    "report-empty-object": (report(lambda x: x.file("e.json", "{}")), "no algorithm name"),
    "report-list": (report(lambda x: x.file("l.json", "[1, 2]")), "a JSON list"),
    "report-null": (report(lambda x: x.file("n.json", "null")), "a JSON null"),
    "report-wrong-type": (report(result_edited(wrong_type)), "'mean_acc' is missing or not a finite number"),
    "report-no-curve": (report(result_edited(drop("curve")), out=True), "no accuracy 'curve'"),
    "report-curve-lengths": (report(result_edited(shorter_curve), out=True), "of the same length"),
    "report-binary": (report(lambda x: x.file("b.json", bytes(range(256)))), "not JSON"),
    "report-the-cache": (report(lambda x: x.cache()), "not JSON"),
    "report-missing": (report(lambda x: x.tmp / "none.json"), "does not exist"),
    "report-only-non-results": (
        lambda x: ["report", x.result.with_suffix(".timing.json"), x.file("e.json", "{}")],
        "none of the 2 inputs is a featcache result file",
    ),
    # 6. malformed caches reaching info / verify / train
    "info-no-backbones": (cmd("info", tampered(no_backbones)), "no backbones group"),
    "info-array-attribute": (cmd("info", tampered(array_attr)), "attribute 'classes' is an array"),
    "info-not-json-attribute": (cmd("info", tampered(not_json_attr)), "an attribute is not valid JSON"),
    "verify-no-clients": (cmd("verify", tampered(no_clients)), "no clients"),
    "train-no-clients": (cmd("train", tampered(no_clients)), "no clients"),
    "verify-zero-row-client": (cmd("verify", tampered(zero_row_client)), "client 001 has no training rows"),
    "train-zero-row-client": (cmd("train", tampered(zero_row_client)), "client 001 has no training rows"),
    "verify-concat-differs": (
        cmd("verify", tampered(concat_differs)),
        "backbones/synth: columns [1, 17] do not follow the backbones before it",
    ),
    "verify-label-out-of-range": (cmd("verify", tampered(label_out_of_range)), "labels: values outside 0..4"),
    "train-features-huge": (cmd("train", tampered(feature_value(1e36))), "values of magnitude 1e+36"),
    "train-features-inf": (cmd("train", tampered(feature_value(float("inf")))), "NaN or Inf values"),
    "train-client-without-test-rows": (cmd("train", tampered(no_test_rows)), "client 001 of cache"),
    "grid-without-validation-rows": (with_cache(grid(), no_val_rows), "has no validation rows"),
    "grid-test-split-damaged": (
        with_cache(grid(), tampered(damaged_test_features, reseal=False)),
        "failed verification",
    ),
    # 7. plug-ins: outputs checked at the first round, exits and exceptions in a hook
    "plugin-predict-nan": (with_plugin(train(), "predict-nan"), "predict returned NaN scores"),
    "plugin-predict-all-minus-inf": (with_plugin(train(), "predict-all-minus-inf"), "predict returned -inf"),
    "plugin-predict-classes": (with_plugin(train(), "predict-classes"), "not [N, 5]"),
    "plugin-loss-not-scalar": (with_plugin(train(), "loss-not-scalar"), "local_loss returned a loss of shape [3]"),
    "plugin-lr-fast": (with_plugin(train(), "lr-fast"), "lr is a float"),
    "plugin-sys-exit": (with_plugin(train(), "exits"), "in after_local (sys.exit(0))"),
    "plugin-raises-keyboard-interrupt": (
        with_plugin(train(), "interrupts"),
        "in after_local: it raised KeyboardInterrupt with no Ctrl-C pressed",
    ),
    "grid-plugin-raises-keyboard-interrupt": (
        with_plugin(grid(), "interrupts", "grid"),
        "it raised KeyboardInterrupt with no Ctrl-C pressed",
    ),
    "plugin-name-250-characters": (
        lambda x: train()(x) + ["--algo", plugin("p" * 250, PLUGINS["raises"])(x)],
        "(250 characters) cannot name an algorithm: use 1 to 64 letters",
    ),
    "grid-plugin-sys-exit": (with_plugin(grid(), "exits", "grid"), "in after_local (sys.exit(0))"),
    "grid-plugin-raises": (with_plugin(grid(), "raises", "grid"), "in after_local: ValueError: boom"),
    # 8. a loss that diverges names the setting
    "huge-weight-decay": (
        lambda x: train("--set", "weight_decay=1e8", "--set", "optimizer=sgd")(x) + ["--rounds", "5"],
        "weight_decay=1e+08 (default 0.0001) is the likely cause",
    ),
    "huge-mu": (
        train("--set", "mu=1e15", "--set", "optimizer=sgd", algo="fedprox"),
        "mu=1e+15 (default 0.01) is the likely cause",
    ),
    # 9. what report and plot read
    "report-metrics-garbage": (
        report(lambda x: result_copy(x, metrics="a,b\n1,2\n"), out=True),
        "copy.metrics.csv is not a metrics.csv",
    ),
    "report-metrics-types": (
        report(
            lambda x: result_copy(
                x, metrics=x.result.with_suffix(".metrics.csv").read_text().replace("\n2,", "\ntwo,", 1)
            ),
            out=True,
        ),
        "is not round,seed,client as integers",
    ),
    "report-global-curve-length": (
        report(lambda x: result_copy(x, set_curve("global_acc", [50.0] * 9)), out=True),
        "'curve.global_acc' is not null or a list of 2 numbers",
    ),
    "report-loss-curve-length": (
        report(lambda x: result_copy(x, set_curve("train_loss", [1.0])), out=True),
        "'curve.train_loss' is not null or a list of 2 numbers",
    ),
    "report-mean-acc-1e308": (
        report(lambda x: result_copy(x, lambda r: r.__setitem__("mean_acc", 1e308))),
        "'mean_acc' is 1e+308, not an accuracy in %",
    ),
    "plot-state-shapes": (plot(state_edited(wider)), "params/cls0.bias has shape [1, 4, 7]"),
    "plot-state-other-algo": (plot(state_edited(other_algo)), "does not hold fedpcl's model"),
    "plot-state-nan": (plot(state_edited(nan_params)), "params/proj0.weight holds NaN"),
    "train-diverges-after-a-checkpoint": (  # the checkpoint's folder, made for it, was left empty
        train("--rounds", "12", "--set", "optimizer=sgd", "--set", "lr=10", "--checkpoint-every", "1"),
        "loss became NaN/Inf in round 4",
    ),
    # 10. memory
    "train-memory-proj-dim": (train("--set", "proj_dim=10000000", algo="fedpcl"), "lower proj_dim"),
    "grid-memory-proj-dim": (grid(algo="fedpcl", axis="proj_dim=16,10000000"), "lower proj_dim"),
}


def snapshot(folder: Path) -> dict[str, str]:
    """Every path below `folder` with its content hash (folders: 'dir'; a named pipe, never read: its mode), hidden
    files included."""

    def digest(p: Path) -> str:
        mode = p.lstat().st_mode
        if stat.S_ISDIR(mode):
            return "dir"
        return hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(mode) else oct(mode)

    return {p: digest(folder / p) for p in everything_in(folder)}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input_is_one_line_exit_2_and_changes_nothing(good_cache, good_result, tmp_path, monkeypatch, case):
    make, needle = case
    x = Ctx(tmp_path, good_cache, good_result, monkeypatch)
    args = make(x)
    if "cuda" in map(str, args) and torch.cuda.is_available():  # cuda:9 stays refused where a GPU exists
        pytest.skip("CUDA is available on this machine")
    before, result_before = snapshot(tmp_path), snapshot(good_result.parent)
    one_line_error(run_cli(*args), needle)
    after = snapshot(tmp_path)
    created = sorted(set(after) - set(before))
    assert created == [], created  # not even an empty --out folder
    assert {k: v for k, v in after.items() if k in before} == before
    assert snapshot(good_result.parent) == result_before


def test_report_skips_non_result_files_with_a_note_and_writes_both_files(good_result, tmp_path):
    folder = good_result.parent
    (tmp_path / "grid.json").write_text(json.dumps({"axes": {}, "selection": []}))
    visible = [p for p in sorted(folder.iterdir()) if not p.name.startswith(".")]  # as `runs/*` expands
    res = run_cli("report", *visible, tmp_path / "grid.json", "--out", tmp_path / "rep")
    assert res.code == 0, res.stderr
    notes = lines(res.stderr)
    assert len(notes) == 2 and all(n.startswith("note: skipped") for n in notes), notes
    assert any(".timing.json" in n for n in notes) and any("grid.json" in n for n in notes)
    assert "| fedavg |" in res.stdout
    assert everything_in(tmp_path / "rep") == ["clients.png", "curves.png", "report.md"]


def test_legitimate_edges_still_run(good_cache, tmp_path):
    """Values at the edge of their range are accepted: participation=1/C rounds to one client, momentum 0, mu 0."""
    res = run_cli(
        "train",
        "--cache",
        good_cache,
        "--algo",
        "fedprox",
        "--rounds",
        "1",
        "--seeds",
        "0,4294967295",
        "--set",
        "participation=0.25",
        "--set",
        "momentum=0",
        "--set",
        "mu=0",
        "--set",
        "batch_size=8",
        "--out",
        tmp_path,
        "--json",
    )
    assert res.code == 0, res.stderr


def test_unexpected_exception_is_one_internal_error_line_exit_1(good_cache, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("simulated bug\nsecond line")

    monkeypatch.setattr("featcache.runs.train.run_configs", boom)
    args = ["train", "--cache", good_cache, "--algo", "fedavg", "--rounds", "1", "--seeds", "0", "--out", tmp_path]
    monkeypatch.delenv("FEATCACHE_DEBUG", raising=False)
    res = run_cli(*args)
    assert res.code == 1 and "Traceback" not in res.stderr
    (line,) = lines(after_notes(res).stderr)
    assert line.startswith("internal error: RuntimeError: simulated bug;") and "FEATCACHE_DEBUG=1" in line
    assert "please report it" in line
    monkeypatch.setenv("FEATCACHE_DEBUG", "1")
    with pytest.raises(RuntimeError, match="simulated bug"):
        run_cli(*args)


def test_real_file_size_limit_in_a_subprocess(good_cache, tmp_path):
    """RLIMIT_FSIZE (ulimit -f) reached while writing the result: EFBIG from the kernel, one line, no temporary."""
    out = tmp_path / "runs"
    code = (
        f"ulimit -f 1; exec {sys.executable} -m featcache.cli train --cache {good_cache} --algo fedavg "
        f"--rounds 2 --seeds 0 --set batch_size=8 --out {out}"
    )
    proc = subprocess.run(
        ["bash", "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=os.environ | {"PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = lines(proc.stderr)
    assert line.startswith("error:") and "file size limit" in line, line
    assert not out.exists()  # the --out folder it made is removed again


def test_out_of_memory_at_run_time_is_one_line_exit_2(good_cache, tmp_path, monkeypatch):
    """Should the up-front estimate be too low, the allocator's failure is still one line naming what to lower."""

    def oom(*a, **k):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
            "tried to allocate 43000000000 bytes"
        )

    monkeypatch.setattr("featcache.runs.train.run_configs", oom)
    res = run_cli(
        "train", "--cache", good_cache, "--algo", "fedavg", "--rounds", "1", "--seeds", "0", "--out", tmp_path
    )
    one_line_error(after_notes(res), "out of memory")
    assert everything_in(tmp_path) == []


def test_a_real_ctrl_c_in_a_plugin_hook_is_an_interruption_exit_130(good_cache, tmp_path):
    """A SIGINT that lands in a plug-in's hook is the user's Ctrl-C (exit code 130), not the plug-in's error; a
    KeyboardInterrupt the hook raises itself is its error (CASES: plugin-raises-keyboard-interrupt, exit code 2)."""
    before_handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite started with SIGINT ignored
    try:
        x = Ctx(tmp_path, good_cache, Path(), None)
        args = with_plugin(train(), "ctrl-c")(x)
        before = snapshot(tmp_path)
        res = run_cli(*args)
    finally:
        signal.signal(signal.SIGINT, before_handler)
    assert res.code == 130 and "Traceback" not in res.stderr
    (line,) = lines(res.stderr)
    assert line.startswith("interrupted:"), line
    assert snapshot(tmp_path) == before


def test_a_plugin_printing_to_stdout_leaves_json_stdout_one_object(good_cache, tmp_path):
    x = Ctx(tmp_path, good_cache, Path(), None)
    res = run_cli(*with_plugin(train(), "prints")(x), "--json")
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["algo"] == "prints-train"  # the whole of stdout is the one object
    assert "a plug-in talks on stdout" in res.stderr


def test_many_foreign_json_files_are_one_note_with_their_count(good_result, tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    shutil.copy(good_result, folder)
    for i in range(3000):
        (folder / f"other{i:04d}.json").write_text(json.dumps({"id": i}))
    res = run_cli("report", folder)
    assert res.code == 0, res.stderr
    (note,) = lines(res.stderr)
    assert note.startswith("note: skipped 3000 files that are not results, the first 3: ") and "other0000.json" in note
    assert "| fedavg |" in res.stdout


def test_a_stdout_that_cannot_be_written_is_one_line():
    """A full disk under `featcache ... --json > file` ends in one error line, not a cut object and exit code 0."""
    from featcache.cli.app import write_stdout

    with open("/dev/full", "w") as full:  # every write: ENOSPC
        with pytest.raises(UserError, match="cannot write standard output: No space left on device; disk full"):
            write_stdout(json.dumps({"runs": [1] * 5000}), full)


@pytest.mark.slow
def test_json_stdout_cut_by_a_file_size_limit_is_exit_2_in_a_subprocess(good_cache, tmp_path):
    """ulimit -f caps stdout redirected to a file: Python's buffered writer drops what a short write left over
    without an error, so only a write that checks each count sees it."""
    code = (
        f"ulimit -f 6; exec {sys.executable} -m featcache.cli train --cache {good_cache} --algo fedavg --algo "
        f"fedprox --algo moon --rounds 1 --seeds 0 --set batch_size=8 --out {tmp_path / 'runs'} --json "
        f"> {tmp_path / 'out.json'}"
    )
    proc = subprocess.run(
        ["sh", "-c", code], capture_output=True, text=True, cwd=REPO, env=os.environ | {"PYTHONDONTWRITEBYTECODE": "1"}
    )
    assert (tmp_path / "out.json").stat().st_size > 0, proc.stderr  # the object was larger than the limit
    assert proc.returncode == 2, proc.stderr
    (line,) = lines(proc.stderr)
    assert line.startswith("error: cannot write standard output") and "ulimit -f" in line, line


# name -> (a train or grid command, the Python call with the same arguments)
API_CASES = {
    "features-huge": (cmd("train", tampered(feature_value(1e36))), {}),
    "no-test-rows": (cmd("train", tampered(no_test_rows)), {}),
    "plugin-predict-nan": (with_plugin(train(), "predict-nan", "api"), {}),
    "plugin-loss-not-scalar": (with_plugin(train(), "loss-not-scalar", "api"), {}),
    "plugin-sys-exit": (with_plugin(train(), "exits", "api"), {}),
    "huge-mu": (train("--set", "mu=1e15", "--set", "optimizer=sgd", algo="fedprox"), {}),
}


def api_call(args: list) -> Callable[[], object]:
    """`featcache train ...` (the options API_CASES use) as the call of featcache.train with the same arguments."""
    import featcache

    opts, sets = {}, []
    for flag, value in zip(args[1::2], args[2::2]):
        if flag == "--set":
            sets.append(str(value))
        else:
            opts[flag.lstrip("-")] = value
    return lambda: featcache.train(
        cache=opts["cache"],
        algo=str(opts["algo"]),
        rounds=int(opts["rounds"]),
        seeds=[int(opts["seeds"])],
        set=sets,
        out=opts["out"],
    )


@pytest.mark.parametrize("case", API_CASES.values(), ids=API_CASES.keys())
def test_the_python_api_raises_the_same_line(good_cache, tmp_path, monkeypatch, case):
    make, _ = case
    x = Ctx(tmp_path, good_cache, Path(), monkeypatch)
    args = make(x)
    line = one_line_error(run_cli(*args), "")
    before = snapshot(tmp_path)
    with pytest.raises(UserError) as e:
        api_call(args)()
    assert f"error: {e.value}" == line
    assert snapshot(tmp_path) == before


def test_report_and_plot_api_raise_the_same_line(good_cache, good_result, tmp_path, monkeypatch):
    import featcache

    x = Ctx(tmp_path, good_cache, good_result, monkeypatch)
    bad = result_copy(x, lambda r: r.__setitem__("mean_acc", 1e308))
    line = one_line_error(run_cli("report", bad), "not an accuracy")
    with pytest.raises(UserError) as e:
        featcache.report([bad])
    assert f"error: {e.value}" == line
    state = state_edited(nan_params)(x)
    line = one_line_error(run_cli(*plot(lambda _: state)(x)), "holds NaN")
    with pytest.raises(UserError) as e:
        featcache.plot(state, good_cache, method="pca", out=x.out / "f.png")
    assert f"error: {e.value}" == line and not x.out.exists()


def test_train_killed_while_writing_its_outputs_leaves_no_finished_looking_file(good_cache, tmp_path):
    """kill -9 once every output is staged (the state's temporary written): no result, metrics or timing file
    appears, only hidden temporaries; the rerun writes all of them and removes those temporaries."""
    out = tmp_path / "runs"
    args = [
        "train",
        "--cache",
        good_cache,
        "--algo",
        "fedavg",
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--set",
        "batch_size=8",
        "--out",
        out,
        "--save-state",
    ]
    crash = [
        sys.executable,
        str(REPO / "tests" / "crashpoint.py"),
        "--kill",
        "after:pathlib.Path.write_bytes:1:*.state.safetensors.*.tmp",
        "--",
        *map(str, args),
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    killed = subprocess.run(crash, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert killed.returncode == -9, killed.stderr
    left = everything_in(out)
    assert left and all(name.startswith(".") and name.endswith(".tmp") for name in left), left
    again = run_cli(*args)
    assert again.code == 0, again.stderr
    names = everything_in(out)
    assert not [n for n in names if n.endswith(".tmp")], names
    visible = [Path(n).name for n in names if not Path(n).name.startswith(".")]  # (the hidden record of a finished run)
    assert sorted(n.split(".", 1)[1] for n in visible) == ["json", "metrics.csv", "state.safetensors", "timing.json"]
