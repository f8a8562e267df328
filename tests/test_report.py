"""`featcache report`: runs labelled by the settings that differ, one cache per table, a title, integer round ticks."""

from __future__ import annotations

import json

import pytest

from featcache.errors import UserError
from featcache.results import report
from featcache.results.tables import labels, markdown_table


def result(algo="fedpcl", key="a" * 64, seeds=(0, 1, 2), **config) -> dict:
    return {
        "algo": algo,
        "config": {"lr": 0.001, "terms": "both", "rounds": 3} | config,
        "seeds": list(seeds),
        "cache": {"key": key, "dataset": "offline-digits", "backbones": ["b"]},
        "mean_acc": 60.0,
        "std_acc": 1.0,
        "best_round_mean_acc": 61.0,
        "best_round_std_acc": 0.5,
        "fairness": {"worst_20": [40.0, 2.0]},
        "params_uploaded_per_round": 2570,
        "curve": {"rounds": [1, 2, 3], "mean_acc": [50.0, 55.0, 60.0]},
    }


def test_labels_name_the_settings_that_differ():
    assert labels([result("fedpcl"), result("fedavg")]) == ["fedpcl", "fedavg"]
    assert labels([result(terms="global"), result(terms="local")]) == ["terms=global", "terms=local"]
    assert labels([result("fedpcl", lr=0.01), result("fedavg")]) == ["fedpcl lr=0.01", "fedavg lr=0.001"]
    assert labels([result(seeds=(0,)), result(seeds=(0, 1))]) == ["seeds=0", "seeds=0,1"]
    assert labels([result(), result()]) == ["fedpcl #1", "fedpcl #2"]


def test_table_has_a_title_naming_cache_and_seeds_and_rows_by_label():
    table = markdown_table([result(terms="global"), result(terms="local")])
    first = table.splitlines()[0]
    assert "offline-digits cache aaaaaaaaaaaaaaaa" in first and "seeds 0,1,2" in first and "ddof=1" in first
    assert "| terms=global | 60.00(1.00) |" in table and "| terms=local |" in table


def test_results_of_caches_that_differ_in_nothing_recorded_are_refused_in_one_line(tmp_path):
    """Two caches, no recorded parameter that tells them apart: no axis for a sweep (test_sweep_report.py has the
    sweeps)."""
    paths = []
    for i, key in enumerate(("a" * 64, "b" * 64)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(result(key=key)))
    with pytest.raises(UserError, match="2 caches that differ in nothing their result files record") as e:
        report(paths)
    assert "\n" not in str(e.value)


def test_curves_have_integer_round_ticks(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = tmp_path / "r.json"
    path.write_text(json.dumps(result()))
    shown = []
    real = plt.Figure.savefig

    def spy(fig, *a, **k):
        shown.extend(fig.axes[0].get_xticks())
        return real(fig, *a, **k)

    plt.Figure.savefig = spy
    try:
        report([path], out=tmp_path / "rep")
    finally:
        plt.Figure.savefig = real
    assert shown and all(float(t).is_integer() for t in shown)


def test_algorithm_defaults_do_not_name_runs():
    """fedpcl and fedavg at their defaults differ in bn, tau, ...: only the algorithm names them."""
    from featcache.algorithms import create
    from featcache.training.config import resolve

    runs = [result(a) | {"config": resolve(create(a))} for a in ("fedpcl", "fedavg", "fedproto")]
    assert labels(runs) == ["fedpcl", "fedavg", "fedproto"]
    runs[0]["config"] = runs[0]["config"] | {"terms": "global"}
    assert labels(runs) == ["fedpcl terms=global", "fedavg terms=—", "fedproto terms=—"]


# -- real result files, folders, figures -------------------------------------------------------------------------------

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from harness import lines, one_line_error, run_cli  # noqa: E402
from synthetic import write_cache  # noqa: E402

from featcache.results.figures import clients_png, curves_png  # noqa: E402
from featcache.results.load import Run, load_inputs  # noqa: E402
from featcache.results.tables import series  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A folder of real `featcache train` output: two algorithms on one synthetic cache, two seeds each."""
    from featcache.runs.train import train

    root = tmp_path_factory.mktemp("report")
    cache = write_cache(root / "synthetic.h5")
    for algo in ("fedavg", "local"):
        train(cache, algo, rounds=3, seeds=[0, 1], set={"batch_size": 8}, out=root / "runs", device="cpu")
    return root / "runs"


def result_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if not p.name.endswith(".timing.json"))


def png_ok(path: Path, min_size=(400, 300)) -> None:
    """A real picture: a PNG of at least min_size pixels that is not one flat colour."""
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= min_size[0] and im.size[1] >= min_size[1]
        pixels = np.asarray(im.convert("RGB"), dtype=np.float64)
    assert pixels.std() > 5 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20


def test_a_folder_mixing_results_sidecars_and_other_json_reports_the_results(runs, tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    for p in runs.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    stem = result_files(folder)[0].with_suffix("")
    (folder / f"{stem.name}.metrics.csv").write_text("round,seed,client,split,loss,accuracy,global_accuracy\n")
    (folder / f"{stem.name}.state.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (folder / "package.json").write_text(json.dumps({"name": "not featcache", "version": "1.0"}))
    (folder / "deeper").mkdir()  # one level: a result in a subfolder is not reported
    (folder / "deeper" / "copy.json").write_bytes(result_files(runs)[0].read_bytes())
    rendered = report([folder], out=tmp_path / "rep")

    rows = [r for r in rendered["table"].splitlines() if r.startswith("| ") and not r.startswith("| run")]
    assert [r.split(" | ")[0] for r in rows] == ["| fedavg", "| local"]
    sidecars = [n for n in rendered["skipped"] if "sidecar" in n]
    assert len(sidecars) == 1 and ".timing.json x2" in sidecars[0] and ".state.safetensors" not in sidecars[0]
    assert any("package.json" in n and "no algorithm name" in n for n in rendered["skipped"])
    assert len(rendered["skipped"]) == 2  # only *.json in a folder: the csv and safetensors files are not inputs
    for name in ("curves.png", "clients.png"):
        png_ok(tmp_path / "rep" / name)
    assert (tmp_path / "rep" / "report.md").read_text().startswith("<!-- featcache report -->\n" + rendered["table"])
    assert "![per-client accuracy](clients.png)" in (tmp_path / "rep" / "report.md").read_text()


def test_a_glob_of_every_file_notes_sidecars_once_and_a_path_twice_counts_once(runs):
    files = sorted(p for p in runs.iterdir() if not p.name.startswith("."))  # as `runs/*` expands (no done records)
    notes = []
    rendered = report([*files, runs, files[0]], note=notes.append)
    sidecars = [p for p in files if p.name.endswith((".timing.json", ".metrics.csv", ".state.safetensors"))]
    assert len(sidecars) >= 2 and len(files) == len(sidecars) + 2
    assert rendered["skipped"] == notes and len(notes) == 1
    assert notes[0].startswith(f"skipped {len(sidecars)} sidecar file(s)")
    assert rendered["table"].count("| fedavg |") == 1 and rendered["table"].count("| local |") == 1


def test_cli_report_of_a_folder_prints_notes_and_the_table(runs, tmp_path):
    res = run_cli("report", runs, "--out", tmp_path / "rep")
    assert res.code == 0, res.stderr
    (note,) = lines(res.stderr)
    assert note.startswith("note: skipped 2 sidecar file(s)")
    assert "| fedavg |" in res.stdout and "| local |" in res.stdout
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == ["clients.png", "curves.png", "report.md"]
    as_json = run_cli("report", runs, "--json")
    assert as_json.code == 0, as_json.stderr
    got = json.loads(as_json.stdout)
    assert got["table"].rstrip("\n") == res.stdout.rstrip("\n") and got["skipped"] == [note.removeprefix("note: ")]
    (tmp_path / "empty").mkdir()
    one_line_error(run_cli("report", tmp_path / "empty"), "no .json files in")


def test_global_column_shows_the_global_model_or_n_a():
    runs_ = [
        result(lr=0.1) | {"global_mean_acc": 71.25, "global_std_acc": 0.5},
        result(lr=0.2) | {"global_mean_acc": None, "global_std_acc": None},
        result(lr=0.3),
    ]  # a result from before the metric
    table = markdown_table(runs_).splitlines()
    header = [c.strip() for c in table[2].strip("|").split("|")]
    column = header.index("global acc %")
    cells = [[c.strip() for c in row.strip("|").split("|")][column] for row in table[4:]]
    assert cells == ["71.25(0.50)", "n/a", "n/a"]


def write_metrics(path: Path, acc: np.ndarray, rounds: list[int], seeds: list[int], scale: float = 1.0) -> None:
    """A metrics.csv with test accuracies acc [R, S, C] (in %, written times scale/100) and train losses."""
    rows = ["round,seed,client,split,loss,accuracy,global_accuracy"]
    for i, r in enumerate(rounds):
        for j, s in enumerate(seeds):
            for c in range(acc.shape[2]):
                rows.append(f"{r},{s},{c},train,{1.0 / r + j:.6f},0.9,")
                rows.append(f"{r},{s},{c},test,0.5,{acc[i, j, c] * scale / 100:.8f},")
    path.write_text("\n".join(rows) + "\n")


@pytest.mark.parametrize("scale", [1.0, 100.0])  # accuracies as fractions or in %
def test_curve_band_is_the_std_over_seeds_of_the_client_means_from_metrics_csv(tmp_path, scale):
    rounds, seeds = [1, 2, 3, 4], [0, 1, 2]
    acc = np.random.default_rng(0).uniform(20, 90, (4, 3, 5))  # [R, S, C] in %
    r = result(seeds=seeds) | {
        "curve": {
            "rounds": rounds,
            "mean_acc": [round(v, 4) for v in acc.mean((1, 2))],
            "train_loss": [1.0 / x + 1.0 for x in rounds],
        }
    }
    path = tmp_path / "fedpcl-abc.json"
    path.write_text(json.dumps(r))
    write_metrics(path.with_suffix(".metrics.csv"), acc, rounds, seeds, scale)

    got = series(Run(path, r))
    client_means = acc.mean(2)  # [R, S]
    np.testing.assert_allclose(got["accuracy"].std, client_means.std(1, ddof=1), atol=1e-4)
    np.testing.assert_allclose(got["accuracy"].mean, client_means.mean(1), atol=1e-4)
    np.testing.assert_allclose(got["loss"].std, np.full(4, np.std([0, 1, 2], ddof=1)), atol=1e-6)
    assert "global" not in got  # no curve.global_acc: no global line


def test_a_stale_or_missing_metrics_csv_gives_no_band(tmp_path):
    rounds, seeds = [1, 2], [0, 1]
    acc = np.random.default_rng(1).uniform(20, 90, (2, 2, 3))
    r = result(seeds=seeds) | {"curve": {"rounds": rounds, "mean_acc": list(acc.mean((1, 2)) + 5.0)}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(r))
    assert series(Run(path, r))["accuracy"].std is None  # no csv
    write_metrics(path.with_suffix(".metrics.csv"), acc, rounds, seeds)
    assert series(Run(path, r))["accuracy"].std is None  # its means are not the result's curve


def figure_spy(monkeypatch) -> list:
    """Collect every figure saved (its axes' artists are inspected after the save)."""
    import matplotlib.pyplot as plt

    saved, real = [], plt.Figure.savefig

    def spy(fig, *a, **k):
        saved.append(fig)
        return real(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    return saved


def test_curves_figure_draws_bands_labels_and_a_legend(tmp_path, monkeypatch):
    from matplotlib.collections import PolyCollection

    rounds, seeds = [1, 2, 3], [0, 1]
    acc = np.random.default_rng(2).uniform(20, 90, (3, 2, 4))
    banded = result(seeds=seeds, lr=0.1) | {
        "curve": {"rounds": rounds, "mean_acc": list(acc.mean((1, 2))), "global_acc": [30.0, 40.0, 50.0]}
    }
    plain = result(seeds=seeds, lr=0.2)
    (tmp_path / "a.json").write_text(json.dumps(banded))
    write_metrics(tmp_path / "a.metrics.csv", acc, rounds, seeds)
    saved = figure_spy(monkeypatch)
    curves_png([Run(tmp_path / "a.json", banded), Run(tmp_path / "b.json", plain)], tmp_path / "c.png")
    (ax,) = saved[0].axes
    assert ax.get_ylabel() == "test accuracy (%)" and "round" in ax.get_xlabel()
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1  # the accuracy of the run with a metrics.csv; the global line has no per-seed values
    top = bands[0].get_paths()[0].vertices[:, 1].max()
    std = acc.mean(2).std(1, ddof=1)
    assert top == pytest.approx((acc.mean((1, 2)) + std).max(), abs=1e-3)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["lr=0.1", "lr=0.1 (global model)", "lr=0.2"]
    assert "seeds 0,1" in saved[0]._suptitle.get_text() and "offline-digits cache" in saved[0]._suptitle.get_text()
    png_ok(tmp_path / "c.png")


def test_clients_figure_bars_are_client_means_with_std_over_seeds(tmp_path, monkeypatch):
    per = np.random.default_rng(3).uniform(10, 95, (3, 4))  # [S, C]
    runs_ = [
        Run(tmp_path / f"{i}.json", result(seeds=(0, 1, 2), lr=lr) | {"per_client_per_seed": (per + i).tolist()})
        for i, lr in enumerate((0.1, 0.2))
    ]
    saved = figure_spy(monkeypatch)
    clients_png(runs_)
    (ax,) = saved[0].axes
    heights = [p.get_height() for p in ax.patches]
    np.testing.assert_allclose(heights, np.concatenate([per.mean(0), per.mean(0) + 1]))
    caps = [seg for coll in ax.collections for seg in coll.get_segments()]  # the error bars' vertical lines
    spans = sorted(round(float(s[1, 1] - s[0, 1]), 6) for s in caps)
    assert spans == sorted(np.round(np.tile(2 * per.std(0, ddof=1), 2), 6))
    assert ax.get_ylabel() == "final test accuracy (%)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["lr=0.1", "lr=0.2"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"client {c}" for c in range(4)]


def test_a_single_sidecar_is_still_refused_and_inputs_sort_out(runs):
    timing = sorted(runs.glob("*.timing.json"))[0]
    with pytest.raises(UserError, match="is not a featcache result file: a .timing.json sidecar"):
        report([timing])
    inputs = load_inputs([runs])
    assert [run.path for run in inputs.runs] == result_files(runs) and len(inputs.sidecars) == 2


def test_real_runs_get_bands_that_match_their_per_seed_results(runs):
    """The band at the last round is the std over the seeds' final accuracies the result file itself records."""
    with_global = []
    for path in result_files(runs):
        r = json.loads(path.read_text())
        got = series(Run(path, r))
        assert got["accuracy"].std is not None and len(got["loss"].std) == len(r["curve"]["rounds"])
        assert got["accuracy"].std[-1] == pytest.approx(np.std(r["per_seed"], ddof=1), abs=1e-3)
        if r.get("global_per_seed") is not None:
            with_global.append(r["algo"])
            assert got["global"].std[-1] == pytest.approx(np.std(r["global_per_seed"], ddof=1), abs=1e-3)
        else:
            assert "global" not in got
    assert with_global == ["fedavg"]  # Local has no global model


def test_report_never_overwrites_a_file_it_did_not_write(runs, tmp_path):
    """A user's report.md (or PNG) in --out is refused in one line and left as it was; the report's own files are
    replaced by the next report."""
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("my notes\n")
    one_line_error(run_cli("report", runs, "--out", out), "report.md exists and was not written by `featcache report`")
    assert (out / "report.md").read_text() == "my notes\n" and sorted(p.name for p in out.iterdir()) == ["report.md"]
    (out / "report.md").unlink()
    for _ in range(2):  # the second run replaces the first run's files
        assert run_cli("report", runs, "--out", out).code == 0
    assert (out / "report.md").read_text().startswith("<!-- featcache report -->")
    (out / "curves.png").write_bytes((out / "clients.png").read_bytes()[:100])  # damaged: not provably ours
    one_line_error(run_cli("report", runs, "--out", out), "curves.png exists and was not written")


def test_the_title_states_partition_backbones_rounds_and_shared_settings():
    part = {"scheme": "label", "alpha": 0.5, "per_class": 10, "test_per_class": 50, "domains": ["mnist"]}
    runs = [result("fedavg", lr=0.01) | {"clients": 10, "backbones": ["b0", "b1"]}, result("fedprox", lr=0.01, mu=1.0)]
    for r in runs:
        r["cache"] = r["cache"] | {"partition": part}
        r["clients"] = 10
    first = markdown_table(runs).splitlines()[0]
    assert (
        "offline-digits cache aaaaaaaaaaaaaaaa: label partition α=0.5, 10 clients, 10 train / 50 test images per "
        "class per client, domains mnist"
    ) in first
    assert "backbones b / b0, b1" in first and "; 3 rounds;" in first
    assert "shared settings lr=0.01 terms=both;" in first and "mu=" not in first  # mu: fedprox's only


def test_each_algorithm_gets_its_own_loss_panel_and_runs_stay_distinct(tmp_path, monkeypatch):
    loss = {"fedavg": [1.0, 0.5, 0.2], "fedpcl": [-25.0, -900.0, -5277.0]}
    runs_ = [
        Run(
            tmp_path / f"{i}.json",
            result(algo, lr=0.1 * (i + 1))
            | {"curve": {"rounds": [1, 2, 3], "mean_acc": [50.0, 60.0, 70.0], "train_loss": loss[algo]}},
        )
        for i, algo in enumerate(["fedavg"] * 5 + ["fedpcl"] * 5)
    ]
    saved = figure_spy(monkeypatch)
    curves_png(runs_)
    acc_ax, avg_ax, pcl_ax = saved[0].axes
    assert "fedavg" in avg_ax.get_title() and "unbounded below" in pcl_ax.get_title()
    assert [list(line.get_ydata()) for line in avg_ax.get_lines()] == [loss["fedavg"]] * 5
    assert [list(line.get_ydata()) for line in pcl_ax.get_lines()] == [loss["fedpcl"]] * 5
    lines_ = acc_ax.get_lines()  # ten equal accuracy curves: each its own colour and marker, thinner and thinner
    assert (
        len({line.get_color() if isinstance(line.get_color(), str) else tuple(line.get_color()) for line in lines_})
        == 10
    )
    assert len({line.get_marker() for line in lines_}) == 10
    widths = [line.get_linewidth() for line in lines_]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    box, legend = acc_ax.get_window_extent(), acc_ax.get_legend().get_window_extent()
    assert legend.y1 <= box.y0  # under the axes, not over the curves


def test_clients_figure_is_zoomed_to_the_data(monkeypatch, tmp_path):
    per = np.array([[85.0, 90.0, 98.0], [86.0, 91.0, 97.0]])
    saved = figure_spy(monkeypatch)
    clients_png([Run(tmp_path / "a.json", result() | {"per_client_per_seed": per.tolist()})])
    lo, hi = saved[0].axes[0].get_ylim()
    assert 80 < lo < 85 and 98 < hi <= 100
