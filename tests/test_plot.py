"""`featcache plot`: the learned features of a saved state, projected with PCA or t-SNE, one panel per client.

The states are real trained heads (`train(..., save_state=True)` on the synthetic cache: tensors `params/<name>`,
`buffers/<name>` [S, C, ...]); the embeddings and the PCA are recomputed here from the cache file and the raw
tensors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import one_line_error, run_cli  # noqa: E402
from synthetic import write_cache  # noqa: E402

from featcache import cache as C  # noqa: E402
from featcache.errors import UserError  # noqa: E402
from featcache.results.features import plot, project  # noqa: E402

SEEDS = [0, 3]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cache, {algo: state file}) for a few algorithms trained 3 rounds on a 5-client, 6-class synthetic cache."""
    from featcache.runs.train import train

    root = tmp_path_factory.mktemp("plot")
    cache = write_cache(root / "synthetic.h5", C=5, K=6)
    states = {}
    for algo in ("fedavg", "fedproto", "fedrep", "pfedgate"):
        run = train(
            cache, algo, rounds=3, seeds=SEEDS, set={"batch_size": 8}, out=root / "runs", device="cpu", save_state=True
        )
        states[algo] = Path(run["state_file"])
    return Path(cache), states


def fedavg_embeddings(cache: Path, state: Path, s: int, split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """FedAvg's learned features by hand: relu(x W^T + b) of each client's own head on its rows read with h5py;
    (z [P, d], client [P])."""
    from safetensors.numpy import load_file

    t = load_file(str(state))
    zs, who = [], []
    with h5py.File(cache, "r") as f:
        for c in range(len(f[f"{split}/offsets"]) - 1):
            x = C.client_rows(f, split, c)  # [n, D]
            z = np.maximum(x @ t["params/proj0.weight"][s, c].T + t["params/proj0.bias"][s, c], 0)  # [n, d]
            zs.append(z)
            who.append(np.full(len(x), c))
    return np.concatenate(zs), np.concatenate(who)


def pca_by_svd(z: np.ndarray) -> np.ndarray:
    centred = z - z.mean(0)
    _, _, vt = np.linalg.svd(centred.astype(np.float64), full_matrices=False)
    return centred @ vt[:2].T  # [P, 2]


def same_up_to_sign(a: np.ndarray, b: np.ndarray) -> None:
    signs = np.sign((a * b).sum(0))  # [2]: a principal axis has no preferred direction
    np.testing.assert_allclose(a * signs, b, atol=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
def test_pca_coordinates_equal_an_svd_of_the_embeddings_computed_by_hand(trained, seed):
    cache, states = trained
    p = project(states["fedavg"], cache, method="pca", seed=seed, max_points=10_000)
    z, who = fedavg_embeddings(cache, states["fedavg"], SEEDS.index(seed))
    np.testing.assert_allclose(p.feats.z, z, atol=1e-5)
    assert (p.feats.client == who).all() and len(p.keep) == len(z)
    same_up_to_sign(p.xy, pca_by_svd(z))
    assert p.axes[0].startswith("PC 1 (") and "% of variance" in p.axes[0]


def test_the_two_seeds_are_different_models(trained):
    cache, states = trained
    a, b = (project(states["fedavg"], cache, method="pca", seed=s).feats.z for s in SEEDS)
    assert a.shape == b.shape and not np.allclose(a, b)


def test_the_subsample_is_seeded_and_keeps_real_rows(trained):
    cache, states = trained
    p = project(states["fedavg"], cache, method="pca", max_points=40)
    again = project(states["fedavg"], cache, method="pca", max_points=40)
    other = project(states["fedavg"], cache, method="pca", seed=3, max_points=40)
    assert len(p.keep) == 40 and len(set(p.keep)) == 40 and (p.keep == again.keep).all()
    assert not (p.keep == other.keep).all()
    same_up_to_sign(p.xy, pca_by_svd(p.feats.z[p.keep]))
    same_up_to_sign(p.xy, again.xy)


def test_the_figure_draws_every_point_once_in_its_clients_panel(trained, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    cache, states = trained
    saved, real = [], plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), real(fig, *a, **k))[1])
    out = plot(states["fedavg"], cache, method="pca", max_points=60, out=tmp_path / "f.png")
    p = project(states["fedavg"], cache, method="pca", max_points=60)
    panels = [ax for ax in saved[0].axes if ax.get_visible() and ax.collections]
    assert len(panels) == 5 and out["points"] == 60 and out["clients"] == 5 and out["classes"] == 6
    for c, ax in enumerate(panels):
        background, mine = (coll.get_offsets() for coll in ax.collections)  # grey: the others; coloured: client c
        np.testing.assert_allclose(np.asarray(mine), p.xy[p.feats.client[p.keep] == c], atol=1e-6)
        assert len(background) + len(mine) == 60 and ax.get_title().startswith(f"client {c}")
    assert "% of variance" in panels[0].get_ylabel()
    legend = [t.get_text() for t in saved[0].legends[0].get_texts()]
    assert legend == [str(k) for k in range(6)] + ["other clients"]
    heading = saved[0]._suptitle.get_text()
    assert "fedavg" in heading and "seed 0" in heading and "synthetic cache" in heading and "PCA" in heading


@pytest.mark.parametrize("algo", ["fedproto", "fedrep", "pfedgate"])
def test_tsne_of_other_algorithms_writes_a_real_png(trained, algo):
    from PIL import Image

    cache, states = trained
    out = plot(states[algo], cache, method="tsne", split="train", max_points=80)
    assert Path(out["figure"]) == states[algo].with_name(
        states[algo].name.replace(".state.safetensors", ".tsne-train.png")
    )
    with Image.open(out["figure"]) as im:
        pixels = np.asarray(im.convert("RGB"), dtype=np.float64)
        assert im.text.get("Software") == "featcache plot"
    assert pixels.shape[0] > 300 and pixels.std() > 5 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20


def test_cli_plot_json_and_the_validation_split(trained, tmp_path):
    cache, states = trained
    res = run_cli(
        "plot",
        states["fedavg"],
        "--cache",
        cache,
        "--method",
        "pca",
        "--split",
        "val",
        "--seed",
        "3",
        "--out",
        tmp_path / "v.png",
        "--json",
    )
    assert res.code == 0, res.stderr
    out = json.loads(res.stdout)
    with h5py.File(cache, "r") as f:
        val_rows = len(f["train/val_index"])
    assert out["rows"] == val_rows and out["seed"] == 3 and out["split"] == "val"
    assert (tmp_path / "v.png").stat().st_size > 10_000


# -- refusals --------------------------------------------------------------------------------------------------------


def test_a_state_of_another_cache_is_refused(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    cache, states = trained
    other = tmp_path / "other.state.safetensors"
    with open(states["fedavg"], "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    meta = json.loads(header["__metadata__"]["featcache"]) | {"cache_key": "0" * 64}
    save_file(load_file(str(states["fedavg"])), str(other), metadata={"featcache": json.dumps(meta)})
    one_line_error(run_cli("plot", other, "--cache", cache), "was trained on cache 0000000000000000")
    assert not list(tmp_path.glob("*.png"))


def test_files_that_are_not_states_are_refused(trained, tmp_path):
    from safetensors.torch import save_file

    cache, states = trained
    (tmp_path / "r.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "bare.safetensors"))
    save_file(
        {"w": torch.zeros(2)},
        str(tmp_path / "noparams.safetensors"),
        metadata={
            "algo": "fedavg",
            "config": "{}",
            "seeds": "[0]",
            "cache_key": "k",
            "backbones": "[]",
            "result": "r.json",
        },
    )
    one_line_error(run_cli("plot", tmp_path / "r.json", "--cache", cache), "not a safetensors file")
    one_line_error(run_cli("plot", tmp_path / "bare.safetensors", "--cache", cache), "metadata lacks algo")
    one_line_error(run_cli("plot", tmp_path / "noparams.safetensors", "--cache", cache), "no params/ tensors")
    one_line_error(run_cli("plot", tmp_path / "none.safetensors", "--cache", cache), "no such state file")
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--seed", "7"], "--seed 7 is not one of 0, 3"),
        (["--method", "umap"], "--method umap is not one of tsne, pca"),
        (["--split", "tests"], "--split tests is not one of train, val, test (did you mean: test?)"),
        (["--max-points", "2"], "--max-points 2 is too few"),
        (["--out", "f.jpg"], "name it FILE.png"),
    ],
)
def test_bad_options_are_one_line(trained, tmp_path, args, needle):
    cache, states = trained
    args = [str(tmp_path / a) if a.endswith(".jpg") else a for a in args]
    one_line_error(run_cli("plot", states["fedavg"], "--cache", cache, *args), needle)


def test_a_users_file_is_never_overwritten_but_its_own_figure_is(trained, tmp_path):
    cache, states = trained
    mine = tmp_path / "holiday.png"
    mine.write_bytes(b"\x89PNG not a featcache figure")
    one_line_error(
        run_cli("plot", states["fedavg"], "--cache", cache, "--method", "pca", "--out", mine),
        "was not written by `featcache plot`",
    )
    assert mine.read_bytes() == b"\x89PNG not a featcache figure"
    ours = tmp_path / "ours.png"
    for max_points in (30, 40):  # the second run replaces the first one's figure
        plot(states["fedavg"], cache, method="pca", max_points=max_points, out=ours)
    with pytest.raises(UserError, match="is a folder"):
        plot(states["fedavg"], cache, method="pca", out=tmp_path)


def test_a_plugin_state_plots_without_registering_the_plugin_first(tmp_path):
    """The state names its plug-in's file (`algo_spec`), so `plot` in a fresh process imports it itself."""
    import subprocess
    import sys

    from featcache.algorithms.registry import _ALGOS
    from featcache.runs.train import train
    from tests.synthetic import write_cache

    cache = write_cache(tmp_path / "c.h5")
    (tmp_path / "myalgo.py").write_text(
        "from featcache.algorithms.base import FedAvg\n\n\nclass MyAvg(FedAvg):\n    name = 'myavg-plot'\n"
    )
    r = train(cache, f"{tmp_path / 'myalgo.py'}:MyAvg", rounds=1, seeds=[0], out=tmp_path / "runs", save_state=True)
    code = (
        f"from featcache.results import plot; print(plot({r['state_file']!r}, {str(cache)!r}, method='pca', "
        f"out={str(tmp_path / 'f.png')!r})['algo'])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "myavg-plot" and (tmp_path / "f.png").stat().st_size > 1000
    _ALGOS.pop("myavg-plot", None)  # registered in this process by train: forgotten for the other tests
