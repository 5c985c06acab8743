"""Errors a user can cause. Their message says what to do; the CLI and the app show it verbatim."""


class UserError(Exception):
    """Bad input or an environment problem the user can fix (wrong model name, absurd values, ...)."""


class OutOfMemory(UserError):
    """The device ran out of memory; the message suggests a smaller setting."""
