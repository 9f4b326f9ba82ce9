"""The one exception type the CLI turns into a one-line message."""


class BriskError(Exception):
    """A problem the user can fix (bad path, bad flag, unsupported model): no traceback."""
