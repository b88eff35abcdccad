"""Drafters: what proposes candidates for the shared round (`round.decode`). The contract is in `base`.

One file per drafter. A drafter that needs no draft model registers itself as a method with
`base.standalone` and is listed here, so that importing the package registers it.
"""

from draftverify.drafters import prompt_lookup  # noqa: F401  (registration)
