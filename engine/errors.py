"""Errors a user can cause. Their message says what to do; the CLI and the app show it verbatim."""

from contextlib import contextmanager


class UserError(Exception):
    """Bad input or an environment problem the user can fix (wrong model name, absurd values, ...).

    `field` names the setting at fault (a Settings field name, or "prompt"), so a UI can mark that
    field; None when no single field is to blame (a busy device, a server that died). `detail` is what a
    reader may want after the message, such as the end of a crashed server's log: the CLI prints it below
    the message, the app folds it away under the one-line message."""

    def __init__(self, message: str, field: str | None = None, detail: str = ""):
        super().__init__(message)
        self.field = field
        self.detail = detail


class OutOfMemory(UserError):
    """The device ran out of memory; the message suggests a smaller setting."""


@contextmanager
def blame(field: str):
    """A UserError without a field, raised while handling `field`, is about that field."""
    try:
        yield
    except UserError as exc:
        if exc.field is None:
            exc.field = field
        raise
