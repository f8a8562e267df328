"""What a training run records beside its result: the per-round mean local training loss, NAME.metrics.csv,
TensorBoard scalars and the saved state (NAME.state.safetensors), each checked against a computation of its own;
and that they are written together with the result or not at all."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import configure
import torch.nn.functional as F
from harness import everything_in, one_line_error, run_cli

from featcache.algorithms import create
from featcache.training.engine import Engine
from featcache.training.schedule import batch_order, participation
from featcache.errors import UserError
from featcache.runs.metrics import CSV_COLUMNS, TENSORBOARD_MISSING
from featcache.runs.states import load_state
from featcache.runs.trees import unflatten
from featcache.runs.train import train
from tests.synthetic import synthetic_clients, write_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache") / "synthetic.h5")


@pytest.fixture(scope="module")
def fedavg_run(cache, tmp_path_factory):
    """FedAvg, 3 rounds evaluated after rounds 2 and 3, two seeds, half the clients per round."""
    out = tmp_path_factory.mktemp("runs")
    return train(
        cache,
        "fedavg",
        rounds=3,
        seeds=[0, 1],
        set=["participation=0.5", "eval_every=2", "lr=0.01"],
        out=out,
        keep_state=True,
        tensorboard=out / "tb",
        save_state=True,
    )


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def head(w: dict, x: torch.Tensor) -> torch.Tensor:
    """FedAvg's head written out: ReLU(x W₁ᵀ + b₁) W₂ᵀ + b₂, in float64."""
    w = {k: v.double() for k, v in w.items()}
    return torch.relu(x.double() @ w["proj0.weight"].T + w["proj0.bias"]) @ w["cls0.weight"].T + w["cls0.bias"]


# -- the per-round training loss ------------------------------------------------------------------------------
def test_round_loss_is_the_mean_minibatch_loss_of_the_steps_each_model_took():
    """A plain loop per client (torch.optim.Adam, the engine's batch order, cross-entropy by hand) gives the mean of
    its minibatch losses; clients that sit the round out have none (NaN)."""
    train_data, test = synthetic_clients(seed=0), synthetic_clients(seed=1)
    algo = create("fedavg")
    cfg = configure(algo, proj_dim=8, batch_size=16, drop_last=False, lr=0.01)
    eng = Engine(algo, [cfg, cfg | {"seed": 3}], train_data, test)
    state = eng.init_state()
    start = {k: v.clone() for k, v in state.params.items()}
    part = [[True, False, True, True], [False, True, True, False]]
    got = eng.read_round(eng.local_train(state, 0, part), 0)  # [H, C] on the host
    B = cfg["batch_size"]
    for h in range(2):
        order = batch_order(eng.seeds[h : h + 1], 0, 0, train_data.counts, train_data.features.shape[1])[0]
        for c in range(4):
            if not part[h][c]:
                assert torch.isnan(got[h, c])
                continue
            w = {k: v[h, c].clone().requires_grad_(True) for k, v in start.items()}
            opt = torch.optim.Adam(list(w.values()), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
            n, losses = int(train_data.counts[c]), []
            for s in range(0, n, B):
                rows = order[c, s : min(s + B, n)]
                loss = F.cross_entropy(head(w, train_data.features[c, rows]), train_data.labels[c, rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            assert got[h, c].item() == pytest.approx(sum(losses) / len(losses), rel=1e-5)


# -- metrics.csv ----------------------------------------------------------------------------------------------
def test_metrics_csv_rows_equal_the_trained_models_by_hand(fedavg_run):
    """Every (round, seed, client, split) row once; the final round's losses and accuracies are the final state's
    own predictions, recomputed; train loss empty exactly for the clients that sat the round out."""
    r = fedavg_run
    rows = read_csv(r["metrics_csv"])
    assert tuple(rows[0]) == CSV_COLUMNS and Path(r["metrics_csv"]).read_text().startswith(",".join(CSV_COLUMNS))
    assert len(rows) == 2 * 2 * 4 * 2 and {int(row["round"]) for row in rows} == {2, 3}
    for row in rows:  # every cell pandas would parse: a number or empty
        for key in ("loss", "accuracy", "global_accuracy"):
            assert row[key] == "" or float(row[key]) == float(row[key])
    trained = r["trained"]
    cell = {(int(x["round"]), int(x["seed"]), int(x["client"]), x["split"]): x for x in rows}
    for s, seed in enumerate([0, 1]):
        for c in range(4):
            w = {k: v[s, c] for k, v in trained.state.params.items()}
            for split, data in (("test", trained.test), ("train", trained.train)):
                n = int(data.counts[c])
                logits = head(w, data.features[c, :n])
                acc = 100 * (logits.argmax(-1) == data.labels[c, :n]).double().mean().item()
                row = cell[(3, seed, c, split)]
                assert float(row["accuracy"]) == pytest.approx(acc, abs=1e-3)
                if split == "test":
                    ce = F.cross_entropy(logits, data.labels[c, :n]).item()
                    assert float(row["loss"]) == pytest.approx(ce, rel=1e-4)
        for rnd in (2, 3):
            took_part = participation(torch.tensor([seed]), rnd - 1, 4, 0.5)[0].tolist()
            assert [cell[(rnd, seed, c, "train")]["loss"] != "" for c in range(4)] == took_part


def test_metrics_csv_agrees_with_the_result_curves_and_is_deterministic(fedavg_run, cache, tmp_path):
    r = fedavg_run
    rows = read_csv(r["metrics_csv"])
    mean = lambda v: sum(v) / len(v)
    for i, rnd in enumerate(r["curve"]["rounds"]):
        per_seed_loss, per_seed_glob = [], []
        for seed in (0, 1):
            mine = [x for x in rows if int(x["round"]) == rnd and int(x["seed"]) == seed]
            per_seed_loss.append(mean([float(x["loss"]) for x in mine if x["split"] == "train" and x["loss"]]))
            (glob,) = {x["global_accuracy"] for x in mine}
            per_seed_glob.append(float(glob))
        assert r["curve"]["train_loss"][i] == pytest.approx(mean(per_seed_loss), abs=1e-4)
        assert r["curve"]["global_acc"][i] == pytest.approx(mean(per_seed_glob), abs=1e-3)
    assert r["global_per_seed"] == pytest.approx(per_seed_glob, abs=1e-3)
    again = train(
        cache, "fedavg", rounds=3, seeds=[0, 1], set=["participation=0.5", "eval_every=2", "lr=0.01"], out=tmp_path
    )
    assert Path(again["metrics_csv"]).read_bytes() == Path(r["metrics_csv"]).read_bytes()
    assert again["state_file"] is None and again["tensorboard"] is None


def test_global_model_by_hand_and_null_without_one(fedavg_run, cache, tmp_path):
    """FedAvg's global accuracy: every client holds the server's model after the download; one count over all
    clients' test rows. FedPCL's server holds prototypes only: null keys, empty CSV cells."""
    trained = fedavg_run["trained"]
    for s in range(2):
        w = {k: v[s, 0] for k, v in trained.state.params.items()}
        correct = sum(
            int((head(w, trained.test.features[c, : int(n)]).argmax(-1) == trained.test.labels[c, : int(n)]).sum())
            for c, n in enumerate(trained.test.counts)
        )
        assert fedavg_run["global_per_seed"][s] == pytest.approx(
            100 * correct / int(trained.test.counts.sum()), abs=1e-3
        )
    pcl = train(cache, "fedpcl", rounds=1, seeds=[0, 1], out=tmp_path)
    assert pcl["global_mean_acc"] is pcl["global_std_acc"] is pcl["global_per_seed"] is None
    assert pcl["curve"]["global_acc"] is None and len(pcl["curve"]["train_loss"]) == 1
    saved = json.loads(Path(pcl["result_file"]).read_text())
    assert saved["global_mean_acc"] is None and "global_per_seed" in saved
    assert {row["global_accuracy"] for row in read_csv(pcl["metrics_csv"])} == {""}


def test_files_are_written_together_or_not_at_all(cache, tmp_path, monkeypatch):
    """The result file is written last; when it fails, the sidecars and the TensorBoard run already written go."""
    import featcache.atomic as A

    real = A._stage

    def full_disk(path, body):
        if Path(path).name.endswith(".json") and not Path(path).name.endswith(".timing.json"):
            raise UserError(f"cannot write {path}: No space left on device")
        return real(path, body)

    monkeypatch.setattr(A, "_stage", full_disk)  # under write_together, which train writes its files with
    with pytest.raises(UserError, match="No space left"):
        train(cache, "fedavg", rounds=1, seeds=[0], out=tmp_path / "runs", tensorboard=tmp_path / "tb", save_state=True)
    assert everything_in(tmp_path / "runs") == [] and everything_in(tmp_path / "tb") == []


# -- TensorBoard ----------------------------------------------------------------------------------------------
def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_per_seed_curves(fedavg_run, cache):
    r = fedavg_run
    board = Path(r["tensorboard"])
    assert board.name == Path(r["result_file"]).stem and sorted(p.name for p in board.iterdir()) == ["seed-0", "seed-1"]
    rows = read_csv(r["metrics_csv"])
    for seed in (0, 1):
        logged = scalars(board / f"seed-{seed}")
        assert set(logged) == {"test/accuracy", "train/loss", "global/accuracy"}
        for tag, split, column in (("test/accuracy", "test", "accuracy"), ("train/loss", "train", "loss")):
            expected = []
            for rnd in (2, 3):
                cells = [
                    float(x[column])
                    for x in rows
                    if int(x["round"]) == rnd and int(x["seed"]) == seed and x["split"] == split and x[column]
                ]
                expected.append((rnd, pytest.approx(sum(cells) / len(cells), abs=1e-3)))
            assert logged[tag] == expected
        assert logged["global/accuracy"][-1] == (3, pytest.approx(r["global_per_seed"][seed], abs=1e-3))
    events = sorted(p.name for p in board.rglob("events.*"))
    train(
        cache,
        "fedavg",
        rounds=3,
        seeds=[0, 1],
        set=["participation=0.5", "eval_every=2", "lr=0.01"],
        out=Path(r["result_file"]).parent,
        tensorboard=board.parent,
    )  # the same run again: its folder replaced
    assert len(sorted(p.name for p in board.rglob("events.*"))) == len(events) == 2
    assert [p.name for p in board.parent.iterdir()] == [board.name]  # no temporary left beside it


def test_missing_tensorboard_is_one_line_before_any_work(cache, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when not installed
    with pytest.raises(UserError) as refused:
        train(cache, "fedavg", rounds=1, seeds=[0], out=tmp_path / "runs", tensorboard=tmp_path / "tb")
    assert str(refused.value) == TENSORBOARD_MISSING
    res = run_cli(
        "train",
        "--cache",
        cache,
        "--algo",
        "fedavg",
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--out",
        tmp_path / "runs",
        "--tensorboard",
        tmp_path / "tb",
    )
    one_line_error(res, "--tensorboard needs TensorBoard: pip install 'featcache[tensorboard]'")
    assert everything_in(tmp_path) == []


# -- the saved state ------------------------------------------------------------------------------------------
def test_saved_state_round_trips_nested_algorithm_state(cache, tmp_path):
    """SCAFFOLD keeps nested server state (x, c) and per-client control variates: every tensor comes back under
    its group and name, [S, C, ...] or [S, ...], with the run's metadata; the same run gives the same bytes (the
    metadata is one JSON key: safetensors writes several keys in a random order)."""
    r = train(cache, "scaffold", rounds=2, seeds=[0, 1], out=tmp_path / "a", keep_state=True, save_state=True)
    tensors, meta = load_state(r["state_file"])
    state = r["trained"].state
    assert Path(r["state_file"]).name == Path(r["result_file"]).stem + ".state.safetensors"
    expected = (
        {f"params/{k}": v for k, v in state.params.items()}
        | {f"client/control/{k}": v for k, v in state.client["control"].items()}
        | {f"server/{g}/{k}": v for g in ("global", "control") for k, v in state.server[g].items()}
    )
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(tensors[name], value, rtol=0, atol=0)
    assert tensors["params/cls0.weight"].shape[:2] == (2, 4) and tensors["server/global/cls0.weight"].shape[0] == 2
    assert unflatten(tensors, "server")["control"].keys() == state.server["control"].keys()
    assert meta["algo"] == "scaffold" and meta["config"] == r["config"] and meta["seeds"] == [0, 1]
    assert meta["cache_key"] == r["cache"]["key"] and meta["backbones"] == r["backbones"]
    assert meta["result"] == Path(r["result_file"]).name
    again = train(cache, "scaffold", rounds=2, seeds=[0, 1], out=tmp_path / "b", save_state=True)
    tensors_again, meta_again = load_state(again["state_file"])
    assert meta_again == meta and tensors_again.keys() == tensors.keys()
    assert Path(again["state_file"]).read_bytes() == Path(r["state_file"]).read_bytes()


def test_load_state_refuses_what_is_not_a_featcache_state(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(UserError, match="no such state file"):
        load_state(tmp_path / "none.state.safetensors")
    (tmp_path / "text.safetensors").write_text("{}")
    with pytest.raises(UserError, match="is not a safetensors file"):
        load_state(tmp_path / "text.safetensors")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"), metadata={"algo": "fedavg"})
    with pytest.raises(UserError, match="is not a featcache state .metadata lacks config, seeds"):
        load_state(tmp_path / "foreign.safetensors")


# -- the command ----------------------------------------------------------------------------------------------
def test_cli_train_writes_every_log_and_shows_the_global_column(cache, tmp_path):
    res = run_cli(
        "train",
        "--cache",
        cache,
        "--algo",
        "fedavg",
        "--algo",
        "fedpcl",
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--out",
        tmp_path / "runs",
        "--tensorboard",
        tmp_path / "tb",
        "--save-state",
    )
    assert res.code == 0, res.stderr
    assert "global" in res.stdout and "n/a" in res.stdout
    everything = everything_in(tmp_path / "runs")
    names = [n for n in everything if not n.startswith(".")]  # hidden: each run's done record (checkpoint.py)
    stems = {n.split(".")[0] for n in names}
    assert len(stems) == 2 and names == sorted(
        f"{stem}{suffix}"
        for stem in stems
        for suffix in (".json", ".timing.json", ".metrics.csv", ".state.safetensors")
    )
    assert sorted(n.split("-")[0] for n in everything if n.startswith(".")) == [".fedavg", ".fedpcl"]
    assert len(list((tmp_path / "tb").iterdir())) == 2
    js = run_cli(
        "train",
        "--cache",
        cache,
        "--algo",
        "fedavg",
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--out",
        tmp_path / "runs",
        "--json",
    )
    res = json.loads(js.stdout)
    assert Path(res["metrics_csv"]).is_file() and res["state_file"] is None and res["tensorboard"] is None
    assert isinstance(res["global_mean_acc"], float) and len(res["curve"]["train_loss"]) == 1
