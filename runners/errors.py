"""The one error type users see: a single line saying what is wrong and what to do."""


class ElxError(Exception):
    """A user-facing failure. ``str(err)`` is one line; the CLI prints it and exits with status 2."""

    def __init__(self, message: str):
        message = " ".join(str(message).split())  # always a single line
        super().__init__(message)
