"""MkDocs hook: the site shows Markdown files that live next to their code (README.md, bench/README.md, ...), included
by pages under docs/. Their relative links point into the repository, so this hook sends a link to an included file
to the page that includes it, and serves the repository files in ASSETS at the same path below the site; any other
link out of docs/ stays as written, and `mkdocs build --strict` fails on it."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

# repository file -> the docs page that shows it
PAGES = {
    "README.md": "index.md",
    "bench/README.md": "benchmarks.md",
    "featcache/algorithms/README.md": "algorithms.md",
    "tests/README.md": "guides/guarantees.md",
}
ASSETS = ["data/offline_digits.png"]  # repository files the pages show, served at docs/<path>

LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)(#[^)\s]*)?(\))")


def on_files(files, config):
    root = Path(config["config_file_path"]).parent
    for path in ASSETS:
        files.append(
            File(path, src_dir=str(root), dest_dir=config["site_dir"], use_directory_urls=config["use_directory_urls"])
        )
    return files


def on_page_markdown(markdown, page, config, files):
    root = Path(config["config_file_path"]).parent
    docs = Path(config["docs_dir"]).resolve().relative_to(root.resolve()).as_posix()
    page_dir = posixpath.dirname(page.file.src_uri)

    def fix(m):
        prefix, target, anchor, close = m.group(1), m.group(2), m.group(3) or "", m.group(4)
        if re.match(r"^[a-z]+:", target) or target.startswith("/"):
            return m.group(0)
        repo_path = posixpath.normpath(posixpath.join(docs, page_dir, target))
        if repo_path.startswith(docs + "/"):
            return m.group(0)
        goal = PAGES.get(repo_path) or (repo_path if repo_path in ASSETS else None)
        if goal is None:
            return m.group(0)
        return f"{prefix}{posixpath.relpath(goal, page_dir or '.')}{anchor}{close}"

    return LINK.sub(fix, markdown)
