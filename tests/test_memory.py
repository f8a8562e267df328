"""The `featcache` command's allocator setting (featcache/memory.py): kept by the commands that train, not by the
others."""

import pytest
from typer.testing import CliRunner

import featcache.cli as cli
from featcache.errors import UserError


@pytest.mark.parametrize(
    "argv, keeps",
    [
        (["train", "--cache", "missing.h5", "--algo", "fedavg"], True),
        (["grid", "--cache", "missing.h5", "--algo", "fedavg", "--grid", "lr=0.1,0.01"], True),
        (["search", "--cache", "missing.h5", "--algo", "fedavg", "--space", "lr=0.1,0.01"], True),
        (["reproduce", "no-such-pipeline"], True),
        (["info", "missing.h5"], False),
        (["extract", "--dataset", "no-such-dataset", "--backbone", "efficientnet_lite0"], False),
        (["verify", "missing.h5"], False),
    ],
)
def test_only_the_training_commands_keep_freed_memory(monkeypatch, tmp_path, argv, keeps):
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.app, argv)
    assert isinstance(result.exception, UserError), result.output  # each refuses its missing input
    assert bool(calls) == keeps
    assert set(cli.TRAINING) <= {c.__name__ for c in cli.COMMANDS}
