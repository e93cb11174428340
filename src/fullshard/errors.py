"""The one exception users see from fullshard, and how its messages are built."""

RESTART = ("Every rank must make the same call at the same point; another rank did not, or died. Restart the job "
           "(fullshard train --max-restarts N resumes from the last checkpoint).")
# what a rank whose collective failed is told to do, Note [named hangs]
DIVERGED = ("Every rank must run the same units in the same order: another rank skipped this unit, took another "
            "branch, or died (model.set_debug_checks(True) names where ranks part). Evaluating on rank 0 alone "
            "does this: run every forward on every rank, or evaluate inside `with fullshard.full_params(model, "
            "rank0_only=True, writeback=False):` (entered by every rank), where rank 0 computes without "
            "communicating. The process group cannot go on; restart the job (fullshard train --max-restarts N "
            "resumes from the last checkpoint).")


class FullShardError(ValueError):
    """Misuse of fullshard, or a collective that failed: the message says what was wrong and how
    to fix it.

    A check of arguments, state or files raises it before any state is changed, so the model is
    still usable after it; a failed collective (Note [named hangs]) raises it mid-step, and the
    process group cannot go on: its message says to restart.
    """


class CollectiveError(RuntimeError):
    """A collective that failed or did not finish within its timeout (runtime.py raises it; a
    unit turns it into its FullShardError, shared.Naming.failed)."""


class EveryRankError(FullShardError):
    """A FullShardError every rank raises with the same message (an agreement found it), so one
    rank saying it is enough."""


def fail(what: str, fix: str) -> FullShardError:
    """Build the error for `what` went wrong, ending with how to `fix` it."""
    return FullShardError(f"{what}. {fix}")


def collective_failed(what: str, error: Exception, fix: str = RESTART, timeout=None) -> FullShardError:
    """Note [named hangs]: the error of a rank whose collective `what` (e.g. "the all-gather of
    unit 'h.0' at step 3") did not finish (within `timeout`, a timedelta, when given) with
    `error`. An error that names the collective itself (runtime.OverdueCollective: another
    collective the hang watch saw overdue) is said as it is."""
    import torch.distributed as dist  # not at the top: the launcher of a run imports this file, and no torch

    rank = dist.get_rank() if dist.is_initialized() else 0
    if getattr(error, "names_the_collective", False):
        return fail(f"rank {rank}: {error}", fix)
    within = f" within {timeout.total_seconds():g} s" if timeout is not None else ""
    return fail(f"rank {rank}: {what} did not finish{within} ({str(error).splitlines()[0] if str(error) else error!r})",
                fix)


def require(ok: bool, what: str, fix: str) -> None:
    """Raise FullShardError(what, fix) unless `ok`: argument checks at the public boundary."""
    if not ok:
        raise fail(what, fix)


def replaced_while_full(fqn: str) -> FullShardError:
    """The error of a parameter assigned in place of its full form (Note [replaced parameters])."""
    return fail(f"parameter {fqn!r} was replaced after sharding, while its unit held its full parameters (e.g. after a "
                f"forward without backward); fullshard would silently put its own back", "Make such changes before "
                "sharding (e.g. crop_block_size or resize_token_embeddings before shard_model), between training "
                "steps (load_state_dict(assign=True) of a sharded or full state dict), or in place inside `with "
                "fullshard.full_params(model):`.")


def in_bytes(nbytes: float) -> str:
    """A size for a message, in the unit that shows it: "1000 B", "12.5 KiB", "65 MiB", "1.50 GiB"."""
    for unit, shift, digits in (("GiB", 30, 2), ("MiB", 20, 0), ("KiB", 10, 1)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):,.{digits}f} {unit}"
    return f"{nbytes:,.0f} B"
