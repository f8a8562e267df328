"""User-facing errors: one line that says what is wrong and how to fix it; the CLI turns them into exit code 2."""

import difflib
import os
import stat
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
    """`value` as a Path, or one line naming the argument when it is not a path (the Python API's `cache=123`) or
    is empty ('' would silently mean the current folder)."""
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return Path(value)
    if isinstance(value, (str, os.PathLike)):
        raise UserError(f"{name} is an empty path: pass a file or folder path ('.' for the current folder)")
    raise UserError(f"{name} must be a path (a str or os.PathLike), not {type(value).__name__} {value!r}")


def as_list(value, name: str, kind: type | tuple[type, ...] = str) -> list | None:
    """A list argument of the Python API as a list: a lone `kind` value (a str where a list of str is expected,
    `domains="mnist"`) is a one-item list, never read character by character; None stays None; anything else but
    a list or tuple of `kind` values is one line naming the argument."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    fits = lambda v: isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
    if value is None:
        return None
    if fits(value):
        return [value]
    if isinstance(value, (list, tuple)) and all(fits(v) for v in value):
        return list(value)
    what = " or ".join(k.__name__ for k in kinds)
    raise UserError(f"{name} must be a {what} or a list of them, not {type(value).__name__} {value!r}")


def comma_values(value, kind: type, name: str):
    """The command line's form of a list option, a comma string ('0,1,2', '0.1,0.5'), as the list of `kind` it
    means, so the Python API takes the option as the command does; any other value is returned unchanged. An empty
    item, or one that is not a `kind`, is one line naming `name`."""
    if not isinstance(value, str):
        return value
    items = [t.strip() for t in value.split(",")]
    example = "0,1,2" if kind is int else "0.1,0.5,1" if kind is float else "a,b"
    if "" in items:
        raise UserError(f"{name} {value!r} has an empty item: write comma-separated values, e.g. {name} {example}")
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise UserError(f"{name} {value!r}: write comma-separated {kind.__name__}s, e.g. {name} {example}") from None


_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a named pipe",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def not_a_file(path: str | Path) -> str | None:
    """Why `path` cannot be read as a file, as the end of a sentence ('does not exist', 'is a folder', 'is a named
    pipe', 'is a character device', ...), or None for a regular file (after symbolic links). Decided from its
    metadata without opening it, so a named pipe cannot hang the caller and a device is never read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "is a broken symbolic link" if os.path.islink(path) else "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISREG(st.st_mode):
        return None
    return f"is {_KINDS.get(stat.S_IFMT(st.st_mode), 'not a regular file')}, not a file"
