"""A `train` run's checkpoint: the round loop's carried state, saved atomically so the same command resumes it.

One file per run in its output folder, `.NAME.checkpoint` (hidden; NAME is the run's `RunSpec.label`: the algorithm
and the content key of what it trains, runs/spec.py). It is a safetensors file holding everything the loop carries
from one round to the next, as the engine hands it over (`Engine.state_dict`; the checkpoint reads nothing else):

    params|buffers|client|server/...   the engine's `State` (models, per-client and server algorithm state)
    optimizer/...                      the local optimizer's parameters, per-element state and step counts (host
                                       counts in the metadata), saved whether or not they persist
    loop/...                           the evaluation records so far, their rounds, upload sizes, round times

each tensor with the memory layout it had (trees.py's `pack`): its strides (a fused optimizer step gives a linear
weight its gradient's transposed layout), broadcast views (stride 0: FedAvg's one model per configuration), which
tensors share memory, and its address modulo 64 bytes: a resumed run computes on the same layouts as the
uninterrupted one.

One metadata key, `featcache`, is a JSON object: the run's identity (what it trains, plus the training code's syntax
hash, library versions, device, CPU/GPU model and torch threads: what makes a resumed run byte-identical to an
uninterrupted one), the round it was taken after, the structure and layouts of the saved trees and a sha256 over all
of it and the tensors. Batch order and participation are hashes of (seed, round, epoch) and the prototype methods'
noise generators are seeded from (seed, round): no random state needs saving.

When: at the start of a round, every `checkpoint_every` rounds (None: whenever 60 s have passed since the last
one; 0: never), and on the first Ctrl-C, which lets the round finish, saves, and stops with `Interrupted` (a second
Ctrl-C stops at once; the run then resumes from the last checkpoint). Written with fsync before the rename.

After the result is written, the checkpoint is replaced by `.NAME.done`, a small JSON record of the identity and
the sha256 of the files written: the same command then finds the run finished and returns its result without
training (as `extract` and `grid` reuse finished work), unless the code, machine or files changed or the trained
state is asked for in memory. A checkpoint written for other code or another machine, one that fails its checksum,
or one whose round, records or shapes do not fit the run (round 999 of 30) is refused in one line and left in place
(delete it to start over): resuming it could not give the uninterrupted bytes. A checkpoint that cannot be written
(a full disk) stops the run in one line and keeps the last one; a folder or other special file in the checkpoint's
place is refused before training.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import signal
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..atomic import write_atomic
from ..errors import UserError, not_a_file
from ..cache.identity import code_identity, content_key, versions
from ..provenance import cpu_model, gpu_name
from .trees import Unsupported, fits, outline, pack, unpack

FORMAT = "2"
EVERY_SECONDS = 60.0  # the default: a checkpoint at most this often
PACKAGE = Path(__file__).resolve().parent.parent  # featcache/
TRAINING_CODE = ("training/*.py", "algorithms/*.py", "cache/*.py", "runs/*.py")  # what turns a cache into a result
ORIGIN = {
    "run": "another run (algorithm, config, seeds, cache or backbones)",
    "code": "other featcache or plug-in code",
    "versions": "other library versions",
    "format": "another checkpoint format",
    "machine": "another machine (device, CPU or GPU model, or torch threads)",
}  # identity field -> refusal


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training; the message says where the run stopped and how to resume it (one line)."""


class Refused(UserError):
    """A checkpoint this run cannot resume: left in place for the user to resume elsewhere or delete."""


class Unsaved(UserError):
    """A checkpoint that could not be written (a full disk): the last one is kept for the same command to resume."""


def check_every(every) -> int | None:
    """`checkpoint_every` checked: None (every ~60 s), 0 (off) or a number of rounds."""
    if every is None or (isinstance(every, int) and not isinstance(every, bool) and every >= 0):
        return every
    raise UserError(
        f"checkpoint_every={every!r}: give a number of rounds >= 0 (0: no checkpoints), or leave it out "
        f"for one every {EVERY_SECONDS:.0f} s"
    )


def identity(impl, cfg: dict, seeds: Sequence[int], cache_key: str, backbones: Sequence[str], device) -> dict:
    """What a checkpoint must match to be resumed: `run` (what is trained, which also names the file) and what
    makes the numbers come out the same (code, versions, machine)."""
    cls = type(impl)
    code = code_identity(TRAINING_CODE, PACKAGE)["sha256"]
    if not cls.__module__.startswith("featcache."):  # a plug-in: its own file is code of the run too
        plugin: dict | str = f"{cls.__module__}:{cls.__qualname__}"  # a class without a file: known by its name
        try:
            file = inspect.getsourcefile(cls)
        except TypeError:  # defined in exec'd text
            file = None
        if file:
            plugin = code_identity((Path(file).name,), Path(file).parent)
        code = content_key({"featcache": code, "plugin": plugin})
    return {
        "run": {
            "algo": impl.name,
            "config": cfg,
            "seeds": list(seeds),
            "cache": cache_key,
            "backbones": list(backbones),
        },
        "code": code,
        "versions": versions(),
        "format": FORMAT,
        "machine": {
            "device": torch.device(device).type,
            "gpu": gpu_name(device),
            "cpu": cpu_model(),
            "torch_threads": torch.get_num_threads(),
        },
    }


def digest(spans: dict, meta: dict) -> str:
    """sha256 over the metadata's identity, round, trees and pads and every span's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps([meta[k] for k in ("identity", "round", "trees", "pads")], sort_keys=True).encode())
    for name in sorted(spans):
        t = spans[name]
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class Checkpoint:
    """The checkpoint of one `train` run: restores the round loop (`restore`), saves it when due (`offer`, at the
    start of each round), turns Ctrl-C into a stop at the round's end (`watch`) and records the finished run
    (`finish`). `name` names its files (`RunSpec.label`)."""

    def __init__(
        self,
        out,
        name: str,
        impl,
        cfg: dict,
        seeds: Sequence[int],
        cache_key: str,
        backbones: Sequence[str],
        device,
        every: int | None = None,
    ):
        self.every = check_every(every)
        self.device = torch.device(device)  # where a restored state goes: the engine's
        self.identity = identity(impl, cfg, seeds, cache_key, backbones, device)
        self.path, self.done_path = Path(out) / f".{name}.checkpoint", Path(out) / f".{name}.done"
        self.label = f"{impl.name} (seeds {', '.join(map(str, seeds))})"
        self.rounds, self.eval_every = cfg["rounds"], cfg["eval_every"]
        self.saved = 0  # the round the newest checkpoint was taken after (0: none)
        self.current = 0  # the round being trained (0-based)
        self.resumed = 0  # the round this run resumed after (0: from the start)
        self.stop = False  # a Ctrl-C asked to stop at the end of the round
        self.last = time.monotonic()
        if self.every != 0:
            for path in (self.path, self.done_path):
                why = os.path.lexists(path) and not_a_file(path)
                if why:
                    raise Refused(
                        f"{path} {why}: featcache keeps a run's checkpoint under that name; move it away "
                        "or pass another --out"
                    )

    # -- the round loop (Engine.run) --------------------------------------------------------------------------
    def restore(self, get: Callable[[], dict], put: Callable[[dict], None]) -> int:
        """Hand the checkpoint's tree, when there is one, to `put` (`Engine.load_state_dict`), once it is found to fit
        `get()` (the `state_dict` of the engine not yet run); returns the round to start at (0: none). A checkpoint of
        other code, another machine, another run's shapes or rounds, or a damaged one is refused."""
        if self.every == 0 or not self.path.is_file():
            return 0
        meta, spans = self._read()
        fix = "delete it to train from round 1"
        try:
            saved = unpack(meta["trees"], spans, meta["pads"], self.device)
        except Exception as e:  # a layout that does not fit its span: torch's own error types
            raise Refused(f"{self.path} is damaged ({type(e).__name__}): {fix}") from None
        problem = self._misfit(meta["round"], saved, get())
        if problem:
            raise Refused(f"{self.path} {problem}: it is not a checkpoint of this run; {fix}")
        put(saved)
        self.saved = self.resumed = self.current = meta["round"]
        return meta["round"]

    def _misfit(self, rnd, saved, ours: dict) -> str | None:
        """What in a checkpoint (round `rnd`, unpacked tree `saved`) does not fit this run (`ours`: the state_dict of
        its engine not yet run), or None: a round it never saves at (1 .. rounds - 1), loop records that do not hold
        exactly that many rounds and their evaluations, or a state of other names or shapes."""
        if type(rnd) is not int or not 0 < rnd < self.rounds:
            return f"claims round {rnd!r} of a {self.rounds}-round run"
        loop = saved.get("loop") if isinstance(saved, dict) else None
        evals = [r for r in range(1, rnd + 1) if r % self.eval_every == 0]
        if not (
            isinstance(loop, dict)
            and loop.keys() == ours["loop"].keys()
            and loop["eval_rounds"] == evals
            and all(isinstance(v, list) for v in loop.values())
            and len(loop["records"]) == len(evals)
            and len(loop["upload_floats"]) == rnd
            and len(loop["round_seconds"]) == rnd
        ):
            return f"holds records that do not fit its round {rnd}"
        if not fits(outline({k: v for k, v in ours.items() if k != "loop"}), outline(saved)):
            return "holds a state of other names or shapes than this run's"
        return None

    def offer(self, rnd: int, get: Callable[[], dict]) -> None:
        """At the start of round `rnd` (0-based: `rnd` rounds are done): save `get()` (the engine's state_dict) when
        due, and stop when Ctrl-C asked."""
        self.current = rnd
        if self.every == 0 or rnd == self.saved:
            return
        due = (time.monotonic() - self.last >= EVERY_SECONDS) if self.every is None else rnd % self.every == 0
        if due or self.stop:
            self.save(get(), rnd)
        if self.stop:
            raise Interrupted(
                f"{self.label} stopped after round {rnd} of {self.rounds}, checkpoint saved: run the "
                "same command again to resume"
            )

    def save(self, tree: dict, rnd: int) -> None:
        """Write `tree` (the engine's state_dict) as the checkpoint of round `rnd`, replacing the last one only once
        it is written: a failed write (a full disk) keeps the last one and stops the run."""
        try:
            skeleton, spans, pads = pack(tree)
        except Unsupported as e:
            raise UserError(
                f"cannot checkpoint {e.name} (a {e.kind}): an algorithm's state holds tensors, numbers and strings; "
                "train it with checkpoint_every=0 (--checkpoint-every 0)"
            ) from None
        meta = {"identity": self.identity, "round": rnd, "trees": skeleton, "pads": pads}
        meta["sha256"] = digest(spans, meta)
        try:
            write_atomic(self.path, save(spans, metadata={"featcache": json.dumps(meta)}), durable=True)
        except UserError as e:  # the output layer's line: what failed, and "... run the same command again"
            kept = (
                f"resumes from the checkpoint of round {self.saved} (kept)"
                if self.saved
                else "starts it again from round 1 (no checkpoint was written)"
            )
            raise Unsaved(f"{self.label}: no checkpoint of round {rnd}: {e}, which {kept}") from None
        self.saved, self.last = rnd, time.monotonic()

    def _read(self) -> tuple[dict, dict]:
        """(metadata, spans) of the checkpoint file, checked against this run's identity and its checksum."""
        fix = "delete it to train from round 1"
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = json.loads((f.metadata() or {})["featcache"])
                spans = {k: f.get_tensor(k) for k in f.keys()}
            theirs = meta["identity"]
            differ = [ORIGIN[k] for k in self.identity if theirs.get(k) != self.identity[k]]
            ok = not differ and digest(spans, meta) == meta["sha256"]
        except Exception as e:  # safetensors, json and a missing key each raise their own error types
            raise Refused(f"{self.path} is damaged ({type(e).__name__}): {fix}") from None
        if differ:
            raise Refused(f"{self.path} comes from {' and '.join(differ)}: resume it where it was written, or {fix}")
        if not ok:
            raise Refused(f"{self.path} is damaged (its checksum does not match): {fix}")
        return meta, spans

    # -- around the run (train.py) ----------------------------------------------------------------------------
    @contextmanager
    def watch(self):
        """Around the engine run: the first Ctrl-C or SIGTERM (a cluster stopping the job) lets the round finish and
        stops at the next round's start (with a checkpoint); a second one, or one where no handler could be
        installed, stops at once and is re-raised as `Interrupted` saying which checkpoint the run resumes from. A
        `UserError` (a refused run) removes the checkpoint: the same command would fail the same way."""
        main = threading.current_thread() is threading.main_thread()
        own = self.every != 0 and main and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        term = signal.getsignal(signal.SIGTERM) if main else None  # the handler a second SIGTERM meets

        def first_stop(signum, frame):
            self.stop = True
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the next one stops at once
            signal.signal(signal.SIGTERM, term)

        if own:
            signal.signal(signal.SIGINT, first_stop)
            signal.signal(signal.SIGTERM, first_stop)
        try:
            yield self
        except Interrupted:
            raise
        except KeyboardInterrupt:
            where = (
                f"the checkpoint holds round {self.saved}: run the same command again to resume from there"
                if self.saved
                else "no checkpoint yet: the same command starts it again from round 1"
            )
            raise Interrupted(f"{self.label} stopped in round {self.current + 1} of {self.rounds}; {where}") from None
        except UserError as e:
            if not isinstance(e, (Refused, Unsaved)):
                self.path.unlink(missing_ok=True)
            raise
        finally:
            if own:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGTERM, term)

    def finish(self, paths: dict) -> None:
        """The result and its sidecars are written (`paths`: write_run's result_file, timing_file, metrics_csv,
        state_file, tensorboard; None: not written): record the finished run in place of the checkpoint. A Ctrl-C
        during the last round stops here, the result written."""
        if self.every != 0:
            files = [Path(paths[k]) for k in ("result_file", "timing_file", "metrics_csv", "state_file") if paths[k]]
            record = {
                "identity": self.identity,
                "paths": {k: v and Path(v).name for k, v in paths.items()},
                "tensorboard": paths["tensorboard"],
                "sha256": {p.name: _sha256(p) for p in files},
            }
            write_atomic(self.done_path, json.dumps(record, sort_keys=True, indent=1), durable=True)
            self.path.unlink(missing_ok=True)
        if self.stop:
            raise Interrupted(
                f"{self.label} stopped after its last round, result written: run the same command "
                "again to go on with the next"
            )

    def finished(self, save_state: bool, tensorboard) -> dict | None:
        """What `train` returns for a run the same command finished before, with this code on this machine, whose
        files are still as written (and include the state file or TensorBoard run now asked for); else None."""
        if self.every == 0 or not self.done_path.is_file():
            return None
        folder = self.done_path.parent
        try:
            record = json.loads(self.done_path.read_text())
            paths, sums = record["paths"], record["sha256"]
            board = str(Path(tensorboard) / Path(paths["result_file"]).stem) if tensorboard is not None else None
            same = (
                record["identity"] == self.identity
                and all(_sha256(folder / n) == h for n, h in sums.items())
                and (paths["state_file"] is not None or not save_state)
                and (board is None or record["tensorboard"] == board and Path(board).is_dir())
            )
            if not same:
                return None
            result = json.loads((folder / paths["result_file"]).read_text())
            timing = json.loads((folder / paths["timing_file"]).read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self.path.unlink(missing_ok=True)  # left by a run killed between the record and the removal
        written = {k: str(folder / paths[k]) if paths[k] else None for k in ("result_file", "metrics_csv")}
        return (
            result
            | timing
            | written
            | {
                "state_file": str(folder / paths["state_file"]) if save_state else None,
                "tensorboard": board,
                "finished_earlier": True,
            }
        )


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None
