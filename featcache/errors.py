"""User-facing errors: one line that says what is wrong and how to fix it; the CLI turns them into exit code 2."""

import difflib
import os
from pathlib import Path


class UserError(Exception):
    """Bad input from the user (missing data, impossible request, unknown name). The CLI prints it as one line."""


def suggest(name: str, choices) -> str:
    """' (did you mean: a, b?)' for the closest known names, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    return f" (did you mean: {', '.join(close)}?)" if close else ""


def first_line(exc: BaseException | str, limit: int = 300) -> str:
    """The first non-blank line of an exception's message (or of a text), its spaces collapsed and cut at `limit`
    characters, or '(no message)': the detail a one-line error quotes from a library's many-line one."""
    line = next((text for text in str(exc).splitlines() if text.strip()), "")
    return " ".join(line.split())[:limit] or "(no message)"


def as_path(value, name: str) -> Path:
    """`value` as a Path, or one line naming the argument when it is not a path (the Python API's `cache=123`)."""
    if isinstance(value, (str, os.PathLike)) and str(value):
        return Path(value)
    raise UserError(f"{name} must be a path (a str or os.PathLike), not {type(value).__name__} {value!r}")
