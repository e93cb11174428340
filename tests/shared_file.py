"""A file every rank of a job reads, rewritten by one: the ranks meet before rank 0 writes (all
have read the old text) and after (all read the new one), so no rank reads it half-written."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist


def rewrite(path: Path, text: str) -> None:
    """Rank 0 replaces `path`'s text with `text`, between two barriers of the default group."""
    dist.barrier()
    if dist.get_rank() == 0:
        path.write_text(text)
    dist.barrier()
