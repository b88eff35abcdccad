"""User-facing errors: one line that names the problem and the fix."""


class DraftVerifyError(ValueError):
    """Bad input or an unsupported setting. The CLI prints the message alone, without a traceback."""


def require(condition: bool, message: str) -> None:
    """Raise `DraftVerifyError(message)` unless `condition` holds."""
    if not condition:
        raise DraftVerifyError(message)
