"""The text `fullshard train` learns from, as bytes, and the batches cut from it.

Files are split by a hash of their path, about one in 20 to validation, so the split
does not depend on which files sit elsewhere in the tree; a single file, or a tree whose
files all land on one side, gives its last 5% to validation. Batches depend only on the
seed and the step, so every world size trains on the same data.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path


def corpus(data: str | None) -> tuple[bytearray, bytearray, str]:
    """(training bytes, validation bytes, description) of --data (None: Python's standard library),
    each read straight into one buffer (no second copy: the peak memory train reports holds the
    text once)."""
    root, train_files, val_files = split(data)
    train, val = read_all(train_files), read_all(val_files)
    if not train_files or not val_files:  # one file, or one side empty: cut the whole
        train += val
        val = train[cut_at(len(train)):]
        del train[cut_at(len(train)):]
    return train, val, f"{root} ({len(train_files) + len(val_files)} files)"


def read_all(paths: list[Path]) -> bytearray:
    """The files' bytes, one after another, in one buffer sized by their sizes (a file that grew
    meanwhile is cut there)."""
    out = bytearray(sum(path.stat().st_size for path in paths))
    view, at = memoryview(out), 0
    for path in paths:
        with open(path, "rb") as f:
            while at < len(out) and (n := f.readinto(view[at:])):
                at += n
    view.release()
    del out[at:]
    return out


MAX_FILES = 200_000  # --data with more files than this is refused: it is not a corpus, but e.g. "/"


class TooManyFiles(OSError):
    """--data holds more files than MAX_FILES."""


def corpus_sizes(data: str | None) -> tuple[int, int]:
    """The lengths of `corpus(data)`'s training and validation bytes, from the files' sizes
    alone: the argument checks run before any rank reads the text. OSError (TooManyFiles
    among them) when the files cannot be listed or sized."""
    _, train_files, val_files = split(data)
    train = sum(path.stat().st_size for path in train_files)
    val = sum(path.stat().st_size for path in val_files)
    if not train_files or not val_files:
        return cut_at(train + val), train + val - cut_at(train + val)
    return train, val


def split(data: str | None) -> tuple[Path, list[Path], list[Path]]:
    """(root, training files, validation files); a file given alone counts as training."""
    root = Path(data) if data else Path(sysconfig.get_paths()["stdlib"])
    if root.is_file():
        return root, [root], []
    train, val = [], []
    for path in sorted(files_under(root, "*.py" if data is None else "*")):
        if len(train) + len(val) >= MAX_FILES:
            raise TooManyFiles(f"{root} holds more than {MAX_FILES} files")
        (val if zlib.crc32(str(path.relative_to(root)).encode()) % 20 == 0 else train).append(path)
    return root, train, val


def cut_at(length: int) -> int:
    """Where text that is not split by files ends its training part: 95% in."""
    return length * 19 // 20


def files_under(root: Path, pattern: str) -> Iterator[Path]:
    """The files below `root` whose names match `pattern`, except in site-packages folders:
    installed packages are not the standard library, and walking them costs more than
    reading the standard library does."""
    seen = 0
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name != "site-packages"]
        for name in fnmatch.filter(names, pattern):
            seen += 1
            if seen > MAX_FILES:
                raise TooManyFiles(f"{root} holds more than {MAX_FILES} files")
            if (path := Path(folder, name)).is_file():
                yield path


def batch_offsets(data_len: int, step: int, *, seed: int, seq_len: int, batch: int):
    """Where the `batch` sequences of `step` start in the data: the same whatever the world size."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, data_len - seq_len - 1, (batch,), generator=generator)


def batch_rows(data, offsets, seq_len: int, device):
    """(inputs, targets) [len(offsets), seq_len] from byte offsets."""
    import torch

    rows = torch.stack([data[o : o + seq_len + 1] for o in offsets]).long().to(device)
    return rows[:, :-1], rows[:, 1:]
