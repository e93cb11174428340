"""The one exception users see from fullshard."""


class FullShardError(ValueError):
    """Misuse of fullshard: the message says what was wrong and how to fix it.

    Raised before any state is changed, so the model is still usable after it.
    """


class EveryRankError(FullShardError):
    """A FullShardError every rank raises with the same message (an agreement found it), so one
    rank saying it is enough."""


def fail(what: str, fix: str) -> FullShardError:
    """Build the error for `what` went wrong, ending with how to `fix` it."""
    return FullShardError(f"{what}. {fix}")


def require(ok: bool, what: str, fix: str) -> None:
    """Raise FullShardError(what, fix) unless `ok`: argument checks at the public boundary."""
    if not ok:
        raise fail(what, fix)
