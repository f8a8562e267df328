"""The checks of `featcache.testing` that test an algorithm's mathematics, as the training guide documents them
(docs/guides/training.md, "Check its mathematics"): its FedAvgM plug-in passes every check it shows; a copy broken
on purpose (the server momentum never kept) passes the vectorization check and the reduction, as the guide says, and
fails the check against the loop written from the equations."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from featcache.testing import assert_matches_equations, assert_matches_plain_loop, assert_reduces_to

ROOT = Path(__file__).resolve().parents[1]
KEPT = '        state.server["m"] = server["m"]  # the momentum the next round continues from\n'


def guide_code() -> tuple[str, str]:
    """(the plug-in, the checks): the two Python blocks of the guide's "Check its mathematics"."""
    guide = (ROOT / "docs/guides/training.md").read_text()
    section = guide.split("**Check its mathematics.**", 1)[1].split("**Declare what the engine may rely on.**")[0]
    plugin, checks = re.findall(r"```python\n(.*?)```", section, re.S)
    return plugin, checks


def write(tmp_path: Path, name: str, code: str) -> str:
    (tmp_path / f"{name}.py").write_text(code)
    return str(tmp_path / f"{name}.py")


def test_the_guides_plugin_passes_the_checks_the_guide_shows(tmp_path, monkeypatch):
    plugin, checks = guide_code()
    write(tmp_path, "my_avgm", plugin)
    monkeypatch.chdir(tmp_path)
    exec(compile(checks, "docs/guides/training.md", "exec"), {})


def test_a_fedavgm_whose_momentum_is_never_kept_fails_the_documented_check(tmp_path):
    plugin, checks = guide_code()
    assert plugin.count(KEPT) == 1
    broken = plugin.replace(KEPT, "").replace('name = "myavgm"', 'name = "myavgm-forgets"')
    spec = write(tmp_path, "forgets", broken) + ":MyAvgM"
    equations = {}
    exec(compile(checks.split("\n\n\nassert_")[0], "docs/guides/training.md", "exec"), equations)
    assert_matches_plain_loop(spec)  # the same hooks on both sides: blind to it
    assert_reduces_to(spec, "fedavg", server_momentum=0.0)  # a momentum never kept vanishes at β = 0
    with pytest.raises(AssertionError, match="differs from the loop written from its equations"):
        assert_matches_equations(spec, server=equations["fedavgm"], server_momentum=0.9)


def test_the_local_loss_written_from_the_equations_checks_fedprox():
    """`loss=`: FedProx's eq. 2 written out (the head's cross-entropy plus μ/2 ||w − w^t||²) matches `fedprox`, with
    FedAvg's server written out too; μ read as μ/2 does not."""

    def eq2(mu):
        def loss(params, x, y, start):
            z = torch.relu(x @ params["proj0.weight"].T + params["proj0.bias"])
            ce = torch.nn.functional.cross_entropy(z @ params["cls0.weight"].T + params["cls0.bias"], y)
            return ce + mu / 2 * sum(((params[k] - start[k]) ** 2).sum() for k in params)

        return loss

    def fedavg(x, clients, n, memory, cfg):
        return {k: sum(n_k * c[k] for c, n_k in zip(clients, n)) / sum(n) for k in x}

    assert_matches_equations("fedprox", loss=eq2(0.5), server=fedavg, mu=0.5)
    with pytest.raises(AssertionError, match="differs from the loop written from its equations"):
        assert_matches_equations("fedprox", loss=eq2(0.25), mu=0.5)
