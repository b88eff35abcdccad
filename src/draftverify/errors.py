"""User-facing errors: one line that names the problem and the fix."""


class DraftVerifyError(ValueError):
    """Bad input or an unsupported setting. The CLI prints the message alone, without a traceback."""


class MissingDrafts(DraftVerifyError):
    """A method needs drafts never built for this target (`loading.store.missing` says how to build them)."""


def require(condition: bool, message: str) -> None:
    """Raise `DraftVerifyError(message)` unless `condition` holds."""
    if not condition:
        raise DraftVerifyError(message)
