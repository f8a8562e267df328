"""`featcache report` over several caches: a sweep keyed by the cache parameter that differs (read from each result
file's own record of its cache), one row per point, `sweep.png` of final accuracy against it; `--x` picks the axis
when several differ. The figures' fixes: bands and error bars within 0-100 %, the global curve's note where it equals
the personal one, domain names on clients, legends outside the axes."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import lines, one_line_error, run_cli, write_folders  # noqa: E402

from featcache.errors import UserError  # noqa: E402
from featcache.results import report  # noqa: E402
from featcache.results.figures import clients_png, curves_png, sweep_png  # noqa: E402
from featcache.results.load import Run  # noqa: E402
from featcache.results.sweep import choose_x, sweep  # noqa: E402

PARTITION = {
    "alpha": 0.5,
    "classes_per_client": 2,
    "clients": 4,
    "domains": None,
    "order": "shuffled",
    "per_class": None,
    "scheme": "label",
    "seed": 0,
    "test_per_class": None,
    "val_fraction": 0.2,
}


def result(algo="fedavg", acc=60.0, std=1.0, glob=(61.0, 0.5), seeds=(0, 1, 2), clients=4, **partition) -> dict:
    """A result file's content on the cache the partition describes (its key derived from the partition)."""
    part = PARTITION | {"clients": clients} | partition
    key = f"{abs(hash(json.dumps(part, sort_keys=True))):064d}"[:64]
    return {
        "algo": algo,
        "config": {"lr": 0.001, "rounds": 3},
        "seeds": list(seeds),
        "cache": {"key": key, "dataset": "offline-digits", "backbones": ["b"], "partition": part},
        "backbones": ["b"],
        "clients": clients,
        "mean_acc": acc,
        "std_acc": std,
        "global_mean_acc": glob[0] if glob else None,
        "global_std_acc": glob[1] if glob else None,
        "best_round_mean_acc": acc,
        "best_round_std_acc": std,
        "fairness": {"worst_20": [acc - 10, 2.0]},
        "params_uploaded_per_round": 2570,
        "curve": {"rounds": [1, 2, 3], "mean_acc": [acc - 10, acc - 5, acc]},
    }


def write(folder: Path, results: list[dict]) -> list[Path]:
    folder.mkdir(exist_ok=True)
    paths = []
    for i, r in enumerate(results):
        paths.append(folder / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    return paths


def rows(table: str) -> list[list[str]]:
    """The table's cells, header first."""
    body = [line for line in table.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in body]


def test_a_sweep_over_alpha_is_one_row_per_cache_sorted_by_alpha(tmp_path):
    paths = write(tmp_path / "runs", [result(alpha=a, acc=50 + a) for a in (10.0, 0.1, 1.0)])
    got = report(paths)
    head, *body = rows(got["table"])
    assert head[:3] == ["α", "run", "personal acc %"] and "global acc %" in head and "cache" in head
    assert [r[0] for r in body] == ["0.1", "1", "10"] and [r[2] for r in body] == [
        "50.10(1.00)",
        "51.00(1.00)",
        "60.00(1.00)",
    ]
    assert got["x"] == "alpha" and [p["x"] for p in got["points"]] == [0.1, 1.0, 10.0]
    assert got["points"][0]["global_mean_acc"] == 61.0 and got["points"][0]["result_file"] == str(paths[1])
    first = got["table"].splitlines()[0]
    assert first.startswith("**final accuracy vs α: offline-digits, 3 caches: label partition, 4 clients;")


def test_several_differing_parameters_need_x_and_the_others_split_the_lines(tmp_path):
    runs = [result(alpha=a, clients=c, acc=50 + a + c) for a in (0.1, 1.0) for c in (4, 8)]
    paths = write(tmp_path / "runs", runs)
    with pytest.raises(UserError) as e:
        report(paths)
    assert str(e.value) == (
        "the results' caches differ in alpha (0.1, 1) and clients (4, 8): pass --x alpha (or another of them) for "
        "the axis; the others draw one line per value"
    )
    got = report(paths, x="clients")
    head, *body = rows(got["table"])
    assert head[:3] == ["clients", "α", "run"]
    assert [(r[0], r[1]) for r in body] == [("4", "0.1"), ("4", "1"), ("8", "0.1"), ("8", "1")]
    assert {p["line"] for p in got["points"]} == {"α=0.1 · fedavg", "α=1 · fedavg"}


def test_algorithms_are_lines_and_a_missing_global_model_is_n_a(tmp_path):
    runs = [
        result(algo, alpha=a, glob=None if algo == "local" else (55.0, 1.0))
        for algo in ("fedavg", "local")
        for a in (0.1, 1.0)
    ]
    got = report(write(tmp_path / "runs", runs))
    head, *body = rows(got["table"])
    g = head.index("global acc %")
    assert [(r[1], r[g]) for r in body] == [("fedavg", "55.00(1.00)"), ("local", "n/a")] * 2


@pytest.mark.parametrize(
    "x,results,needle",
    [
        ("alpah", [result(alpha=0.1), result(alpha=1.0)], "--x alpah is not a cache parameter (did you mean: alpha"),
        (
            "clients",
            [result(alpha=0.1), result(alpha=1.0)],
            "--x clients: every result has clients 4: the caches differ in alpha (0.1, 1); pass --x alpha",
        ),
        (
            "alpha",
            [result(alpha=0.1), result("local", alpha=0.1)],
            "--x alpha: every result comes from one cache (alpha 0.1)",
        ),
    ],
)
def test_a_wrong_x_is_one_line_naming_the_fix(tmp_path, x, results, needle):
    with pytest.raises(UserError) as e:
        report(write(tmp_path / "runs", results), x=x)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_two_results_for_one_point_are_refused_naming_both(tmp_path):
    paths = write(tmp_path / "runs", [result(alpha=0.1), result(alpha=1.0), result(alpha=0.1, acc=70.0)])
    with pytest.raises(UserError, match=r"two results for one point \(alpha 0.1, fedavg\): .*r0.json and .*r2.json"):
        report(paths)


def test_alpha_of_a_feature_partition_is_no_value():
    """α means nothing for a feature partition: a sweep over the partition shows it as —, not 0.5."""
    runs = [Run(Path(f"{s}.json"), result(scheme=s, alpha=0.1 if s == "label" else 0.5)) for s in ("feature", "label")]
    assert choose_x([r.result for r in runs], "partition") == "partition"
    s = sweep(runs, "partition")
    assert [(p.x, p.others) for p in s.points] == [("feature", {"alpha": None}), ("label", {"alpha": 0.1})]


# -- figures -----------------------------------------------------------------------------------------------------------


def figure_spy(monkeypatch) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    saved, real = [], plt.Figure.savefig

    def spy(fig, *a, **k):
        saved.append(fig)
        return real(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    return saved


def band_limits(ax) -> tuple[float, float]:
    from matplotlib.collections import PolyCollection

    ys = [v for c in ax.collections if isinstance(c, PolyCollection) for v in c.get_paths()[0].vertices[:, 1]]
    return min(ys), max(ys)


def outside(legend, ax) -> bool:
    a, b = legend.get_window_extent(), ax.get_window_extent()
    return a.x0 >= b.x1 or a.y1 <= b.y0 or a.x1 <= b.x0 or a.y0 >= b.y1


def test_sweep_figure_log_alpha_axis_bands_within_100_and_the_equal_global_noted(tmp_path, monkeypatch):
    runs_ = [
        Run(tmp_path / f"{i}.json", result(alpha=a, acc=acc, std=5.0, glob=(acc, 5.0)))
        for i, (a, acc) in enumerate([(0.1, 40.0), (1.0, 80.0), (10.0, 98.0)])
    ] + [Run(tmp_path / "p.json", result("local", alpha=1.0, acc=30.0, std=0.0, glob=None))]
    saved = figure_spy(monkeypatch)
    sweep_png(sweep(runs_, "alpha"), tmp_path / "s.png")
    (ax,) = saved[0].axes
    assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_xticklabels()] == ["0.1", "1", "10"]
    assert ax.get_xlabel() == "α (log scale)" and ax.get_ylabel() == "final test accuracy (%)"
    lo, hi = band_limits(ax)
    assert lo == pytest.approx(30.0) and hi == 100.0  # 98 + 5 drawn up to 100, not 103
    legend = [t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts()]  # long labels wrap
    assert legend == ["fedavg: personal", "fedavg: global = personal at every α: drawn on it", "local: personal"]
    assert outside(ax.get_legend(), ax) and ax.get_ylim()[1] <= 101
    title = saved[0]._suptitle.get_text()
    assert title.startswith("final accuracy vs α: offline-digits, 3 caches") and "within 0-100 %" in title
    from PIL import Image

    with Image.open(tmp_path / "s.png") as im:
        assert im.format == "PNG" and im.size[0] > 600


def test_categorical_axis_and_a_partial_equality_note(tmp_path, monkeypatch):
    runs_ = [
        Run(tmp_path / "a.json", result(scheme="feature", acc=70.0, glob=(70.0, 1.0))),
        Run(tmp_path / "b.json", result(scheme="iid", acc=80.0, glob=(75.0, 1.0))),
    ]
    saved = figure_spy(monkeypatch)
    sweep_png(sweep(runs_, "partition"))
    (ax,) = saved[0].axes
    assert ax.get_xscale() == "linear" and [t.get_text() for t in ax.get_xticklabels()] == ["feature", "iid"]
    legend = [t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts()]
    assert legend[1] == "fedavg: global = personal at partition feature"
    assert all(line.get_linestyle() == "None" for line in ax.get_lines())  # categories: points, no line between


def test_curve_bands_stop_at_100_and_an_equal_global_curve_is_noted(tmp_path, monkeypatch):
    from test_report import write_metrics

    rounds, seeds = [1, 2, 3], [0, 1, 2]
    acc = np.array([[[90.0, 100.0], [100.0, 100.0], [80.0, 100.0]]] * 3)  # [R, S, C]: std 10/3 around ~95
    mean = [round(v, 4) for v in acc.mean((1, 2))]
    r = result(seeds=seeds) | {"curve": {"rounds": rounds, "mean_acc": mean, "global_acc": mean}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(r))
    write_metrics(path.with_suffix(".metrics.csv"), acc, rounds, seeds)
    saved = figure_spy(monkeypatch)
    curves_png([Run(path, r)])
    ax = saved[0].axes[0]
    assert band_limits(ax)[1] == 100.0
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["fedavg", "fedavg (global model = personal at every round: drawn on it)"]


def test_clients_are_named_by_their_domains_and_error_bars_stop_at_100(tmp_path, monkeypatch):
    per = np.array([[100.0, 80.0, 90.0, 70.0], [90.0, 70.0, 80.0, 60.0]])  # [S, C]
    r = result(scheme="feature", domains=["amazon", "caltech"]) | {"per_client_per_seed": per.tolist()}
    saved = figure_spy(monkeypatch)
    clients_png([Run(tmp_path / "a.json", r)])
    (ax,) = saved[0].axes
    names = [t.get_text() for t in ax.get_legend().get_texts()]
    assert names == ["client 0: amazon", "client 1: caltech", "client 2: amazon", "client 3: caltech"]
    tops = [seg[1, 1] for coll in ax.collections for seg in coll.get_segments()]
    assert max(tops) == pytest.approx(100.0) and outside(ax.get_legend(), ax)
    one_domain = result(domains=["mnist"]) | {"per_client_per_seed": per.tolist()}  # label: every client mnist
    clients_png([Run(tmp_path / "b.json", one_domain)])
    assert [t.get_text() for t in saved[1].axes[0].get_legend().get_texts()] == [f"client {c}" for c in range(4)]


def test_held_out_domains_are_points_and_clients_say_their_domain_on_each_bar(tmp_path, monkeypatch):
    """Categories (held-out domains) are points with error bars, never a line or a band between them; long labels
    wrap so no legend is wider than its axes; a client of a later run is named too, and where the runs disagree on
    a client's domain each bar says it."""
    from matplotlib.collections import PolyCollection

    pacs = ["art", "cartoon", "photo", "sketch"]
    runs_ = [
        Run(
            tmp_path / f"{i}.json",
            result(scheme="feature", clients=3 + i % 2, holdout_domain=d, domains=[x for x in pacs if x != d])
            | {"per_client_per_seed": [[60.0 + i] * (3 + i % 2)] * 2, "config": {"lr": 0.001, "rounds": 3}},
        )
        for i, d in enumerate(pacs)
    ]
    saved = figure_spy(monkeypatch)
    long = [r | {"config": {"lr": 0.001, "rounds": 3, "a_setting_with_a_long_name": f"value-{i}" * 6}}
            for i, r in enumerate(p.result for p in runs_)]  # fmt: skip
    s = sweep([Run(p.path, r) for p, r in zip(runs_, long)], "holdout_domain")
    sweep_png(s)
    (ax,) = saved[0].axes
    assert [t.get_text() for t in ax.get_xticklabels()] == pacs
    assert all(line.get_linestyle() == "None" for line in ax.get_lines() if line.get_label().endswith("personal"))
    assert ax.containers and not any(isinstance(c, PolyCollection) for c in ax.collections)  # error bars, no band
    assert ax.get_legend().get_window_extent().width <= ax.get_window_extent().width
    names = [f"held-out test domain={d} · " + "a long description of what this run trains " * 3 for d in pacs]
    curves_png(runs_, names=names)
    acc = saved[1].axes[0]
    assert acc.get_legend().get_window_extent().width <= acc.get_window_extent().width
    clients_png(runs_, names=pacs)
    (bars,) = saved[2].axes
    assert [t.get_text() for t in bars.get_legend().get_texts()] == [f"client {c}" for c in range(4)]
    assert [t.get_text() for t in bars.texts][:3] == ["cartoon", "photo", "sketch"]  # run 0 holds out art


# -- the user's loop: extract a sweep, train every cache, report -------------------------------------------------------


def test_extract_sweep_train_it_and_report_draws_accuracy_against_alpha(tmp_path):
    """`extract --alpha 0.1,1,10` (its --json names each cache's α), one `train` over the three caches, then one
    `report` of the runs folder: three points over α, sweep.png written, each client's domain read from the cache
    where known."""
    from PIL import Image

    root = write_folders(tmp_path / "data", domains=("d1",), classes=("a", "b", "c"), per_class=12)
    args = (
        "extract", "--dataset", "imagefolder", "--data-root", root, "--backbone", "test_resnet=random",
        "--image-size", "32", "--alpha", "0.1,1,10", "--partition", "label", "--clients", "4",
        "--out", tmp_path / "cache",
    )  # fmt: skip
    res = run_cli(*args, "--json")
    assert res.code == 0, res.stderr
    caches = json.loads(res.stdout)["caches"]
    assert [(c["partition"]["alpha"], c["partition"]["clients"]) for c in caches] == [(0.1, 4), (1.0, 4), (10.0, 4)]
    table = re.sub(r"[\s│]+", "", run_cli(*args).stdout)  # the sweep again (a hit): its table, cells unwrapped
    assert all(f"images,alpha={a})" in table for a in ("0.1", "1.0", "10.0"))  # each cache with its α
    each = [arg for c in caches for arg in ("--cache", c["cache"])]  # the sweep trained in one command
    trained = run_cli(
        "train", *each, "--algo", "fedavg", "--rounds", "2", "--seeds", "0,1", "--set", "batch_size=4",
        "--out", tmp_path / "runs",
    )  # fmt: skip
    assert trained.code == 0, trained.stderr
    names = sorted(p.name for p in (tmp_path / "runs").glob("*.json") if not p.name.endswith(".timing.json"))
    assert [re.sub(r"-[0-9a-f]{12}\.json$", "", n) for n in names] == [  # one folder: each run says its cache's α
        f"fedavg-rounds2-batch_size4-clients4-alpha{a}-seed0_1" for a in ("0.1", "1", "10")
    ]
    res = run_cli("report", tmp_path / "runs", "--out", tmp_path / "rep", "--json")
    assert res.code == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["x"] == "alpha" and [p["x"] for p in got["points"]] == [0.1, 1.0, 10.0]
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == [
        "clients.png",
        "curves.png",
        "report.md",
        "sweep.png",
    ]
    assert "![accuracy vs the swept parameter](sweep.png)" in (tmp_path / "rep" / "report.md").read_text()
    with Image.open(tmp_path / "rep" / "sweep.png") as im:
        assert im.format == "PNG" and im.size[0] > 600
    (note,) = lines(res.stderr)
    assert note.startswith("note: skipped 3 sidecar file(s)")
    one_line_error(run_cli("report", tmp_path / "runs", "--x", "clients"), "--x clients: every result has clients 4")
    one = next(p for p in sorted((tmp_path / "runs").glob("*.json")) if not p.name.endswith(".timing.json"))
    assert run_cli("report", one, "--out", tmp_path / "rep").code == 0  # one cache: the sweep's figure goes with it
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == ["clients.png", "curves.png", "report.md"]
    Image.new("RGB", (4, 4)).save(tmp_path / "rep" / "sweep.png")  # a user's own file of that name stays
    assert run_cli("report", one, "--out", tmp_path / "rep").code == 0
    assert (tmp_path / "rep" / "sweep.png").is_file()


def test_a_sweep_trained_in_one_call_is_one_figure_over_its_caches(tmp_path, monkeypatch):
    """`train` over several caches and algorithms writes one folder; `report` of it draws one figure over what the
    caches differ in (α here, on a log axis), one labelled line per algorithm, each point its cache's result."""
    from featcache.runs.train import train
    from tests.synthetic import write_cache

    caches = [
        write_cache(tmp_path / f"alpha{a}.h5", spread=s, partition={"scheme": "label", "alpha": a, "clients": 4})
        for a, s in ((10.0, 2.0), (0.1, 1.0), (1.0, 1.5))
    ]
    runs = train(caches, ["fedavg", "local"], rounds=1, seeds=[0], out=tmp_path / "runs")["runs"]
    saved = figure_spy(monkeypatch)
    got = report([tmp_path / "runs"], out=tmp_path / "rep")
    assert got["x"] == "alpha" and [(p["x"], p["line"]) for p in got["points"]] == [
        (a, algo) for a in (0.1, 1.0, 10.0) for algo in ("fedavg", "local")
    ]
    by_file = {r["result_file"]: r["mean_acc"] for r in runs}
    assert all(p["mean_acc"] == by_file[p["result_file"]] for p in got["points"])
    (ax,) = next(f for f in saved if f.axes[0].get_xlabel().startswith("α")).axes
    assert ax.get_xlabel() == "α (log scale)" and [t.get_text() for t in ax.get_xticklabels()] == ["0.1", "1", "10"]
    legend = [t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts()]
    assert legend[0] == "fedavg: personal" and legend[-1] == "local: personal"  # local has no global model
    assert (tmp_path / "rep" / "sweep.png").is_file()
