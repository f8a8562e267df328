"""`--help` names every option whole at any width: click's plain help in a pipe, a log or a narrow terminal; rich's
boxed help on a terminal of at least RICH_HELP_COLUMNS, where its table still fits every name."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from featcache.cli import app
from featcache.cli.app import RICH_HELP_COLUMNS

COMMANDS = typer.main.get_command(app).commands


def option_names(command: str) -> list[str]:
    params = COMMANDS[command].params
    return [o for p in params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]


def cut(text: str, names: list[str]) -> list[str]:
    """The names that do not appear whole in `text` (followed by neither a letter, a digit nor a hyphen)."""
    return [n for n in names if not re.search(re.escape(n) + r"(?![\w-])", text)]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def help_text(command: str, columns: int, monkeypatch, tty: bool) -> str:
    """`featcache COMMAND --help` run in this process with COLUMNS=columns, stdout a terminal or not."""
    from featcache import cli

    monkeypatch.setenv("COLUMNS", str(columns))
    stdout = Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "argv", ["featcache", command, "--help"])
    with contextlib.redirect_stdout(stdout), pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 0
    return re.sub(r"\x1b\[[0-9;]*m", "", stdout.getvalue())  # rich colours a terminal's help


def test_help_in_a_pipe_at_40_columns_names_every_option_whole():
    """The user's case: `COLUMNS=40 featcache extract --help | cat`."""
    exe = Path(sys.executable).with_name("featcache")
    res = subprocess.run(
        f"{exe} extract --help | cat",
        shell=True,
        capture_output=True,
        text=True,
        env=os.environ | {"COLUMNS": "40"},
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "--classes-per-client" in res.stdout and "…" not in res.stdout
    assert cut(res.stdout, option_names("extract")) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("columns,tty", [(40, False), (200, False), (40, True), (RICH_HELP_COLUMNS, True)])
def test_every_command_names_every_option_whole(command, columns, tty, monkeypatch):
    text = help_text(command, columns, monkeypatch, tty)
    assert cut(text, option_names(command)) == [], text
    assert ("╭" in text) == (tty and columns >= RICH_HELP_COLUMNS)  # rich's boxes only where they fit


def test_featcache_alone_prints_its_help_and_no_error_line(monkeypatch, capsys):
    from featcache import cli

    monkeypatch.setattr(sys, "argv", ["featcache"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.err == ""
    assert captured.out.startswith("Usage: ") and "  report " in captured.out


def test_help_in_a_pipe_shows_no_markup_escape_and_no_lambda():
    """`featcache COMMAND --help | cat` for every command: `[default: ...]`, never typer's `\\[default: ...]`, and a
    path option's metavar PATH, never `<LAMBDA>`."""
    exe = Path(sys.executable).with_name("featcache")
    commands = [*sorted(COMMANDS), "flower new"]
    script = "; ".join(f"{exe} {c} --help | cat" for c in commands)
    res = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("Usage: ") == len(commands)
    assert "\\[" not in res.stdout and "LAMBDA" not in res.stdout
    assert "[default: " in res.stdout and "--cache PATH" in res.stdout
