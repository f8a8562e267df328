"""One vocabulary: every option of a command is an argument of the same name of the library function it calls, and
vice versa, but for the short list of justified exceptions below. Usage errors are one line, list options refuse
empty items, and `--version` prints the version."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import typer
from harness import one_line_error, run_cli

import featcache
from featcache.cli import COMMANDS, app
from featcache.reproduce import reproduce

# command -> the library function it calls (the public API, and the pipelines' `reproduce`)
API = {
    "extract": featcache.extract,
    "train": featcache.train,
    "grid": featcache.grid,
    "search": featcache.search,
    "report": featcache.report,
    "plot": featcache.plot,
    "reproduce": reproduce,
}
# commands that inspect or maintain files, with no API function of their own beyond the module functions they call
NO_API = {"info", "gc", "verify", "migrate", "datasets", "algos"}
CLI_ONLY = {
    "json": "--json picks the output format; a library call returns the dict itself",
    "noise_scale": "the API's noise=Noise(kind, scale, p) is --noise, --noise-scale and --noise-p",
    "noise_p": "the API's noise=Noise(kind, scale, p) is --noise, --noise-scale and --noise-p",
}
API_ONLY = {
    "progress": "a callback: the command draws it as progress bars or lines",
    "note": "a callback: the command prints each note as a line on stderr",
    "keep_state": "returns the trained tensors, a Python object (the command's --save-state writes them)",
}


def cli_names(name: str) -> set[str]:
    command = typer.main.get_command(app).commands[name]
    return {(p.opts[0].lstrip("-") if p.opts[0].startswith("--") else p.name).replace("-", "_") for p in command.params}


def test_every_command_is_classified():
    assert {c.__name__ for c in COMMANDS} == set(API) | NO_API


@pytest.mark.parametrize("name", sorted(API))
def test_cli_options_and_api_arguments_have_the_same_names(name):
    cli = cli_names(name) - set(CLI_ONLY)
    api = set(inspect.signature(API[name]).parameters) - set(API_ONLY)
    assert cli == api, f"{name}: only on the command line {sorted(cli - api)}; only in the API {sorted(api - cli)}"


@pytest.mark.parametrize("name", sorted(API))
def test_cli_options_default_to_the_api_arguments_defaults(name):
    """A command run without an option does what the library call without the argument does (compared as the
    values they hold: a comma list's string form, lists and tuples, paths and their strings, nothing and [])."""

    def number(x: str):
        for kind in (int, float):
            try:
                return kind(x)
            except ValueError:
                pass
        return x

    def value(v):
        if isinstance(v, str):
            items = tuple(number(x) for x in v.split(","))
            return items if len(items) > 1 else items[0]
        if isinstance(v, (list, tuple)):
            return tuple(value(x) for x in v) or None
        return str(v) if isinstance(v, Path) else v

    api = inspect.signature(API[name]).parameters
    command = typer.main.get_command(app).commands[name]
    differ = {
        p.name: (p.default, api[p.name].default)
        for p in command.params
        if p.name in api and not p.required and value(p.default) != value(api[p.name].default)
    }
    assert not differ, f"{name}: option default vs API default {differ}"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["train", "--cache", "c.h5", "--algo", "fedavg", "--set", "lr", "0.1"], "--set key=value"),
        (["train", "--cache", "c.h5", "--algo", "fedavg", "--bogus"], "No such option"),
        (["train", "--algo", "fedavg"], "Missing option '--cache'"),
        (["report"], "Missing argument"),
        (["train", "--cache", "c.h5", "--algo", "fedavg", "--rounds", "x"], "Invalid value for '--rounds'"),
        (["trian"], "No such command 'trian'"),
        (["train", "--cache", "c.h5", "--algo", "fedavg", "--seeds", "0,,1"], "--seeds '0,,1' has an empty item"),
        (["train", "--cache", "c.h5", "--algo", "fedavg", "--seeds", "0,1,"], "has an empty item"),
        (["extract", "--clients", "5,,10"], "--clients '5,,10' has an empty item"),
        (["extract", "--alpha", "0.1,x"], "--alpha '0.1,x': write comma-separated floats"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args, needle):
    one_line_error(run_cli(*args), needle)


def test_version():
    res = run_cli("--version")
    assert res.code == 0 and res.stdout.strip() == f"featcache {featcache.__version__}"


def test_help_still_exits_0():
    res = run_cli("train", "--help")
    assert res.code == 0 and "--backbones" in res.stdout
