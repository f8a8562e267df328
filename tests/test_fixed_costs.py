"""What costs nothing imports nothing: a cache hit, a re-partition through filled stores and a sweep build no model
and make no tensor, so they import neither torch nor timm nor torchvision (the weights' identity comes from the
store's recorded key; the partition and the cache writer need numpy and h5py), through the API and the `featcache`
command, with `threads` asked for or not (a fill still runs its forward on that count), and a cache's `info` and
`verify` import no torch, checked in fresh interpreters by what `sys.modules` holds; and the memory estimate replays a
cache's clients without importing torch._dynamo. Speed is
bench/store_figures.py's and bench/clients.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import BACKBONES
from synthetic import write_cache

from featcache.devices import _gpu_possible

REPO = Path(__file__).resolve().parent.parent
# what a command that builds no model leaves unloaded; `--device auto` asks torch whether CUDA is there wherever a GPU
# could be (featcache/devices.py), so there torch is loaded
UNLOADED = {"timm", "torchvision"} | (set() if _gpu_possible() else {"torch"})

EXTRACT = """
import json, sys, warnings
warnings.simplefilter("ignore")
import featcache
result = featcache.extract(**json.loads(sys.argv[1]))
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"timm", "torch", "torchvision"})
print(json.dumps({"heavy": heavy, "embedded": result["embedded"], "hit": result["cache_hit"]}))
"""

COMMAND = """
import atexit, json, sys
from featcache.cli import main
heavy = lambda: sorted({m.split(".")[0] for m in sys.modules} & {"timm", "torch", "torchvision"})
atexit.register(lambda: print(json.dumps(heavy())))
sys.argv = ["featcache", *sys.argv[1:]]
main()
"""


FORWARD = """
import json, sys, warnings
from contextlib import contextmanager
warnings.simplefilter("ignore")
import featcache
from featcache.extraction import pipeline as P
seen, original = [], P.forward_threads

@contextmanager
def spy(device):
    with original(device):
        seen.append(P.torch.get_num_threads())
        yield

P.forward_threads = spy
result = featcache.extract(**json.loads(sys.argv[1]))
print(json.dumps({"seen": seen, "embedded": result["embedded"]}))
"""


def extract_fresh(code: str = EXTRACT, **options) -> dict:
    """`featcache.extract(**options)` in a fresh interpreter (`code`; EXTRACT: {heavy (timm/torch/torchvision
    imported), embedded, hit})."""
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(options, default=str)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def filled(images, tmp_path_factory) -> dict:
    """Extract options whose stores hold every image of `images` (the first extraction built the models)."""
    out = tmp_path_factory.mktemp("fixed")
    options = dict(
        dataset="imagefolder",
        data_root=str(images),
        backbone=BACKBONES,
        image_size=32,
        batch_size=4,
        partition="label",
        clients=2,
        alpha=1.0,
        out=str(out / "out"),
        store=str(out / "store"),
    )
    first = extract_fresh(**options)
    assert first["heavy"] and not first["hit"] and sum(first["embedded"].values()) > 0
    return options


@pytest.mark.parametrize(
    "change",
    [{}, {"alpha": 0.5}, {"clients": 3}, {"alpha": [0.5, 5.0]}, {"clients": [3, 4]}, {"threads": 2}]
    + [{"threads": 2, "alpha": 0.25}],
    ids=["cache-hit", "new-alpha", "new-clients", "alpha-sweep", "client-sweep", "threads-hit", "threads-new-alpha"],
)
def test_no_model_built_imports_neither_torch_nor_timm_nor_torchvision(filled, change):
    found = extract_fresh(**(filled | change))
    assert not set(found["heavy"]) & UNLOADED and sum(found["embedded"].values()) == 0, found
    assert found["hit"] == (set(change) <= {"threads"})


def test_a_fill_started_without_torch_runs_its_forward_on_the_threads_asked_for(filled, tmp_path):
    """`threads` loads no torch up front (above); a pass that embeds runs its forward on that count all the same (2:
    not the count the interpreter starts with, OMP_NUM_THREADS=1)."""
    options = filled | {"threads": 2, "out": str(tmp_path / "out"), "store": str(tmp_path / "store")}
    found = extract_fresh(FORWARD, **options)
    assert found["seen"] == [2] and sum(found["embedded"].values()) > 0, found


@pytest.mark.parametrize(
    "change",
    [[], ["--alpha", "0.25,4"], ["--threads", "2"], ["--threads", "2", "--alpha", "0.3"]],
    ids=["cache-hit", "sweep", "threads-hit", "threads-new-alpha"],
)
def test_the_command_through_filled_stores_imports_no_torch(filled, change):
    """`featcache extract` as a user runs it: the CLI's thread policy and device check load no torch either."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in filled.items() if k != "backbone"]
    flags += [f"--backbone={b}" for b in filled["backbone"]]
    done = subprocess.run(
        [sys.executable, "-c", COMMAND, "extract", *flags, *change, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result, heavy = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert not set(heavy) & UNLOADED and sum(result["embedded"].values()) == 0, (heavy, result)
    assert result["cache_hit"] == ("--alpha" not in change)


def test_info_verify_and_migrate_import_no_torch(tmp_path):
    """Reading a cache's metadata, checking it and converting it need numpy and h5py alone."""
    cache = write_cache(tmp_path / "c.h5", C=3, D=8, K=3)
    code = (
        "import sys; from featcache import cache as C; "
        f"C.info({str(cache)!r}); assert C.verify({str(cache)!r})['ok']; print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


ESTIMATE = """
import json, sys
from featcache import cache as C
from featcache.algorithms import create
from featcache.training import footprint
from featcache.training.config import resolve
train, test = C.load_clients(sys.argv[1], "train"), C.load_clients(sys.argv[1], "test")
replayed, original = [], footprint._replay
footprint._replay = lambda algo, cfg, model, data: replayed.append(len(data.counts)) or original(algo, cfg, model, data)
traced = [footprint.estimate(create(n), resolve(create(n), {"rounds": 1}), train, test).traced for n in sys.argv[2:]]
print(json.dumps({"traced": traced, "replayed": sorted(set(replayed)), "dynamo": "torch._dynamo" in sys.modules}))
"""


def test_the_memory_estimate_imports_no_dynamo(tmp_path):
    """The estimate replays the first round of a cache's 40 clients on real tensors and never imports
    torch._dynamo (seconds of a run's start)."""
    cache = write_cache(tmp_path / "c.h5", C=40, D=8, K=3)
    names = ["fedavg", "fedpcl", "fedproto", "fedprox", "moon"]
    done = subprocess.run(
        [sys.executable, "-c", ESTIMATE, str(cache), *names], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"traced": [True] * len(names), "replayed": [40], "dynamo": False}
