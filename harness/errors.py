"""Errors that are the user's to fix: the CLIs print them as one line and exit non-zero."""


class UserError(Exception):
    """Bad input (a path, a flag, a file): shown as one line, never as a traceback."""
