"""User-facing errors: one line that says what is wrong and how to fix it; the CLI turns them into exit code 2."""


class UserError(Exception):
    """Bad input from the user (missing data, impossible request, unknown name). The CLI prints it as one line."""


def suggest(name: str, choices) -> str:
    """' (did you mean: a, b?)' for the closest known names, or '' when nothing is close."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    return f" (did you mean: {', '.join(close)}?)" if close else ""
