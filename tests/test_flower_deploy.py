"""A real Flower deployment on 127.0.0.1: one `flower-superlink` and three `flower-supernode` processes (insecure,
free ports, each node reading only its own file of `featcache split`), FedPCL run through `flwr run` on the project
`featcache flower new` writes, equal to `featcache train` within 1e-5; a supernode killed with SIGKILL mid-run ends
the run with a clear error naming the client, within the project's timeout. Every process is started in a session
of its own and killed at the end; every wait is bounded."""

from __future__ import annotations

import json
import os
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

    def wait_for_port(self, timeout: float = 60) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"the superlink did not listen on {self.port} within {timeout} s")

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
    results = sorted(out.glob("*.json"))
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
