"""User-facing errors.

Anything the user can fix (a bad path, flag, schedule, file) raises
:class:`GemmdriftError`. The CLI prints its message as one line and exits with
status 2; every other exception is a bug and keeps its traceback.
"""


class GemmdriftError(Exception):
    """A problem with the user's input, reported as one line (exit status 2)."""
