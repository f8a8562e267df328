"""A real Flower deployment on 127.0.0.1: one `flower-superlink` and three `flower-supernode` processes (insecure,
free ports, each node reading only its own file of `featcache split`), FedPCL run through `flwr run` on the project
`featcache flower new` writes, equal to `featcache train` within 1e-5; a supernode killed with SIGKILL mid-run ends
the run with a clear error naming the client, within the project's timeout; and docs/guides/flower.md's own commands,
its simulation and its localhost deployment, to `featcache train`'s numbers with no package index. Every process is
started in a session of its own and killed at the end; every wait is bounded."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from synthetic import write_cache

import featcache
from featcache.cache.split import split
from featcache.flower.project import new_project

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
SETTINGS = ["batch_size=16", "proj_dim=8", "drop_last=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the superlink did not listen on {port} within {timeout} s")


class Federation:
    """A superlink and one supernode per file, their logs in `folder`; `stop` kills every process group."""

    def __init__(self, folder: Path, files: list[str]):
        self.folder, self.procs = folder, []
        self.port = free_port()
        self.env = os.environ | {
            "FLWR_HOME": str(folder / "home"),
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "OMP_NUM_THREADS": "1",
        }
        (folder / "home").mkdir()
        (folder / "home" / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        self.start(
            "superlink",
            "flower-superlink",
            "--insecure",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
        )
        self.wait_for_port()
        for c, path in enumerate(files):
            self.start(
                f"supernode{c}",
                "flower-supernode",
                "--insecure",
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--port",
                str(free_port()),
                "--node-config",
                f'cache="{path}"',
            )

    def start(self, name: str, *cmd: str) -> None:
        log = open(self.folder / f"{name}.log", "w")
        self.procs.append(
            subprocess.Popen(
                [str(BIN / cmd[0]), *cmd[1:]],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        )

    def wait_for_port(self) -> None:
        wait_for_port(self.port)

    def run(self, project: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "flwr"), "run", project, "local", "--stream"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def kill(self, index: int) -> None:
        """SIGKILL supernode `index` and its process group (its ClientApp processes)."""
        os.killpg(self.procs[1 + index].pid, signal.SIGKILL)

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.folder.glob("*.log")))


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deploy")
    cache = write_cache(folder / "c3.h5", C=3)
    files = split(cache, folder / "split")["files"]
    fed = Federation(folder, files)
    try:
        yield fed, cache
    finally:
        fed.stop()


def test_fedpcl_through_flwr_run_on_a_localhost_deployment_equals_train(federation, tmp_path):
    fed, cache = federation
    out = tmp_path / "flower"
    project = new_project("fedpcl-deploy", "fedpcl", cache, 2, 0, SETTINGS, tmp_path, str(out), timeout=240)
    done = fed.run(project["project"], timeout=600)
    results = [p for p in sorted(out.glob("*.json")) if not p.name.endswith(".timing.json")]  # beside it: timing
    assert results, f"no result file: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    flower = json.loads(results[0].read_text())
    sim = featcache.train(cache, "fedpcl", rounds=2, seeds=[0], set=SETTINGS, out=tmp_path / "sim")
    assert flower["runtime"] == "flower" and flower["params_uploaded_per_round"] == sim["params_uploaded_per_round"]
    for key in ("mean_acc", "final_acc"):
        if key in sim:
            assert flower[key] == pytest.approx(sim[key], abs=1e-3), key  # percent, 1e-5 of a fraction
    report = featcache.report([str(out), str(tmp_path / "sim")])
    assert report["table"].count("fedpcl") >= 2


def test_a_supernode_killed_mid_run_ends_the_run_with_a_clear_error(federation, tmp_path):
    fed, cache = federation
    project = new_project("fedpcl-kill", "fedpcl", cache, 50, 0, SETTINGS, tmp_path, str(tmp_path / "out"), timeout=60)
    run = subprocess.Popen(
        [str(BIN / "flwr"), "run", project["project"], "local", "--stream"],
        env=fed.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        time.sleep(45)  # the run has started its rounds
        fed.kill(2)
        output, _ = run.communicate(timeout=400)  # the server's 60 s reply timeout, then Flower's shutdown
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    said = output + fed.logs()
    assert "did not answer" in said or "failed on" in said, output[-3000:]
    assert not list((tmp_path / "out").glob("*.json"))


GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "flower.md"


def guide_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", GUIDE.read_text(), re.S)


def local_superlinks(home: Path) -> list[int]:
    """The pids of the local SuperLinks `flwr run` started with FLWR_HOME=home (detached, a session of their own)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if proc.name.isdigit() and b"flower-superlink" in cmd and str(home).encode() in cmd:
            pids.append(int(proc.name))
    return pids


def test_the_guide_s_commands_run_a_simulation_and_a_localhost_deployment_to_train_s_numbers(tmp_path):
    """The guide's bash and toml blocks as written, in a folder holding the cache, with the cache's path and the
    rounds (and the test cache's small-batch settings) put in, and free ports for the guide's; no index reachable
    (UV_OFFLINE). Each run's status from `flwr ls` and its result file against `featcache train`'s."""
    from test_flower import assert_same, per_client, written

    sim_block, start_block, run_block = guide_blocks("bash")
    (toml,) = guide_blocks("toml")
    cache = write_cache(tmp_path / "c4.h5", C=4)
    settings = " ".join(f"--set {s}" for s in SETTINGS)
    sim_block = re.sub(r"(?m)^CACHE=\S+", f"CACHE={cache}", sim_block).replace("--rounds 50", f"--rounds 2 {settings}")
    link, node = free_port(), free_port()
    start_block = start_block.replace("8000", str(link)).replace("9094", str(node))
    home = tmp_path / "home"
    env = os.environ | {
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "UV_OFFLINE": "1",
        "COLUMNS": "300",
        "OMP_NUM_THREADS": "1",
    }
    sim = featcache.train(cache, "fedpcl", rounds=2, seeds=[0], set=SETTINGS, out=tmp_path / "sim")
    sim |= {"per_client": per_client(sim["metrics_csv"])}

    def bash(script: str, timeout: float) -> str:
        done = subprocess.run(
            ["bash", "-ec", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    def result(out: Path, said: str) -> dict:
        assert "finished:completed" in said and "finished:failed" not in said, said[-3000:]
        (path,) = (p for p in out.glob("*.json") if not p.name.endswith(".timing.json"))
        return written(str(path))

    deployment = None
    try:
        said = bash(sim_block, timeout=600)
        assert_same(result(tmp_path / "runs", said), sim)
        shutil.rmtree(tmp_path / "runs")
        with open(tmp_path / "deployment.log", "w") as log:
            deployment = subprocess.Popen(
                ["bash", "-ec", start_block], cwd=tmp_path, env=env, stdout=log, stderr=log, start_new_session=True
            )
        with open(home / "config.toml", "a") as f:
            f.write("\n" + toml.replace("8000", str(link)))
        wait_for_port(link)
        said = bash(run_block, timeout=600)
        assert_same(result(tmp_path / "runs", said), sim)
    finally:
        for pid in local_superlinks(home):
            os.killpg(pid, signal.SIGKILL)
        if deployment is not None:
            os.killpg(deployment.pid, signal.SIGKILL)
            deployment.wait(timeout=30)
