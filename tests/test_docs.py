"""The README stays a short overview whose Layout is true to the tree, and generated tables match what generates them
(the docs site itself is checked by `make docs`, a strict build: a broken link or reference fails it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def layout_lines() -> list[str]:
    section = README.split("## Layout", 1)[1]
    return re.search(r"```\n(.*?)```", section, re.S).group(1).splitlines()


def test_readme_is_at_most_200_lines():
    assert len(README.splitlines()) <= 200


def test_layout_names_existing_paths_and_every_package():
    folder, top, named = None, None, set()
    for line in layout_lines():
        head = re.match(r"^( *)(\S+/)\s", line)
        if head and len(head.group(1)) < 4:  # a folder entry: top level, or two spaces in under the last top
            top = head.group(2) if not head.group(1) else top
            folder = head.group(2) if not head.group(1) else top + head.group(2)
            line = line[head.end() :]
        for name in re.findall(r"(?<![\w{/.-])([\w-]+(?:\.(?:py|md|txt)|/))(?![\w{])", line):
            path = ROOT / folder / name
            assert path.exists(), f"README Layout names {folder}{name}, which does not exist"
            named.add((ROOT / folder / name).resolve())
        named.add((ROOT / folder).resolve())
    packages = {p.parent.resolve() for p in (ROOT / "featcache").rglob("__init__.py")}
    missing = sorted(str(p.relative_to(ROOT)) for p in packages - named)
    assert not missing, f"README Layout omits {missing}"


def test_every_make_target_the_readme_names_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", README))
    assert named and named <= targets, f"README names make targets the Makefile lacks: {sorted(named - targets)}"


def test_algorithms_table_is_the_generated_one():
    from featcache.cli.training import algos_markdown

    text = (ROOT / "featcache/algorithms/README.md").read_text()
    committed = re.search(r"<!-- algos:begin -->\n(.*?)<!-- algos:end -->", text, re.S).group(1).strip()
    assert committed == algos_markdown().strip(), (
        "featcache/algorithms/README.md's registry table differs from the registry: run `make algos-table` "
        "(it writes `featcache algos --markdown` between the algos:begin/end markers)"
    )


def test_the_peers_table_lists_every_registered_algorithm_and_only_those():
    from featcache.algorithms import list_algorithms

    text = (ROOT / "featcache/algorithms/README.md").read_text()
    section = text.split("## Beside PFLlib, FL-bench and Flower", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    named = [n for row in rows for n in re.findall(r"`([a-z0-9-]+)`", row[-1])]
    assert len(named) == len(set(named)) and set(named) == set(list_algorithms())


def test_algos_markdown_prints_the_table():
    from harness import one_line_error, run_cli

    from featcache.cli.training import algos_markdown

    shown = run_cli("algos", "--markdown")
    assert shown.code == 0 and shown.stdout == algos_markdown()
    assert "| `pfedpt` | — | — | not available: " in shown.stdout
    one_line_error(run_cli("algos", "fedavg", "--markdown"), "--markdown prints the whole registry")
