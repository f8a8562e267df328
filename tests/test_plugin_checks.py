"""The checks of `featcache.testing` that test an algorithm's mathematics, as the training guide documents them
(docs/guides/training.md, "Check its mathematics"): its FedAvgM plug-in passes every check it shows; a copy broken
on purpose (the server momentum never kept) passes the vectorization check and the reduction, as the guide says, and
fails the check against the loop written from the equations."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
