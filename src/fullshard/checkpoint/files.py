"""Files in a directory fullshard owns (a checkpoint version, a run's --out), opened so that
nothing planted there reaches outside it.

# Note [confined files]: a checkpoint directory may have been written, or changed, by
# someone else. Every file fullshard reads or writes in one goes through a `Folder`: an
# open descriptor of the directory and names of one path component, checked by `name`
# (no "/", no "." or "..", printable ASCII), opened relative to that descriptor with
# O_NOFOLLOW, so neither an absolute path, a "..", nor a symbolic link (of a file or of
# a subdirectory) leads elsewhere. A file is read only when it is a regular file (a
# FIFO or a /proc file is refused before it is read: they are opened O_NONBLOCK), only
# as many bytes as the caller expects, and within the caller's deadline. New files are
# created with O_EXCL under a fresh random name and renamed into place, so a planted
# link under a temporary name is never written through; the rename replaces a link at
# the final name, it does not follow it.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import shutil
import stat
import time
import zlib
from pathlib import Path

from fullshard.errors import fail

NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
READ_CHUNK = 1 << 24
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
NO_LINK = os.O_NOFOLLOW | os.O_CLOEXEC


class Overdue(OSError):
    """A read that did not finish within its deadline."""


def name(value: object, what: str) -> str:
    """`value` as a file name inside a folder (Note [confined files]), or a FullShardError."""
    if not isinstance(value, str) or not NAME.fullmatch(value) or value in (".", ".."):
        raise fail(f"{what} names {value!r}, which is not a file of the checkpoint's own directory (names are "
                   f"one path component of letters, digits, '_', '-' and '.')",
                   "The checkpoint was damaged or planted; load another one.")
    return value


class Folder:
    """An open directory, and the files in it (Note [confined files])."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def open(cls, path: Path, *, create: bool = False) -> Folder:
        """The directory the caller named (a link there is the caller's own choice, and followed)."""
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return cls(os.open(path, OPEN_DIR), path)

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def sub(self, entry: str, *, create: bool = False) -> Folder:
        """A subdirectory, never through a link; `create`: a new one (it must not exist)."""
        if create:
            os.mkdir(entry, 0o755, dir_fd=self.fd)
        return Folder(os.open(entry, OPEN_DIR | os.O_NOFOLLOW, dir_fd=self.fd), self.path / entry)

    def kind(self, entry: str) -> str | None:
        """"file", "dir" or "other" (a link, a FIFO, ...) for what `entry` is, not following it; None: absent."""
        try:
            mode = os.stat(entry, dir_fd=self.fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None
        return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "other"

    def entries(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def open_read(self, entry: str) -> int:
        """A descriptor of the regular file `entry`; OSError for anything else."""
        return self.open_regular(entry, os.O_RDONLY | os.O_NONBLOCK)

    def open_regular(self, entry: str, flags: int) -> int:
        """`entry` opened with `flags`, never through a link; OSError unless it is a regular file."""
        fd = os.open(entry, flags | NO_LINK, 0o644, dir_fd=self.fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{self.path / entry} is not a regular file")
        return fd

    def size(self, entry: str) -> int:
        fd = self.open_read(entry)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read(self, entry: str, limit: int, deadline: float) -> bytes:
        """The whole of a regular file of at most `limit` bytes."""
        fd = self.open_read(entry)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise OSError(f"{self.path / entry} holds {size} bytes, more than the {limit} it may")
            return read_at(fd, 0, size, deadline)
        finally:
            os.close(fd)

    def crc32(self, entry: str, deadline: float) -> tuple[int, int]:
        """(CRC-32, size) of a regular file, read within `deadline`."""
        fd = self.open_read(entry)
        try:
            crc, offset = 0, 0
            while chunk := os.pread(fd, READ_CHUNK, offset):
                crc, offset = zlib.crc32(chunk, crc), offset + len(chunk)
                check_deadline(deadline, self.path / entry)
            return crc, offset
        finally:
            os.close(fd)

    def create(self, entry: str) -> Writer:
        """A new file `entry`, written through a fresh temporary name and renamed into place by
        Writer.commit (a crash leaves the temporary, never a half-written `entry`)."""
        temp = f".{entry}.{secrets.token_hex(6)}.tmp"
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | NO_LINK, 0o644, dir_fd=self.fd)
        return Writer(self, entry, temp, fd)

    def write_durably(self, entry: str, data: bytes) -> None:
        """Replace `entry` with `data`, flushed to disk with its directory entry."""
        with self.create(entry) as out:
            out.write(data)
            out.commit()

    def remove_tree(self, entry: str) -> None:
        """Delete the subdirectory `entry` and what is in it (a link there is removed, not followed)."""
        kind = self.kind(entry)
        if kind == "dir":
            shutil.rmtree(self.path / entry, ignore_errors=True)  # fd-based on Linux: links inside are not followed
        elif kind is not None:
            os.unlink(entry, dir_fd=self.fd)

    def sync(self) -> None:
        os.fsync(self.fd)


class Writer(io.RawIOBase):
    """A new file being written (Folder.create): CRC-32 and size of what went in, and its own
    positional reads (for a header just written). Small writes (torch.save's headers) are
    gathered into one system call, so a background save holds the interpreter's lock less."""

    SMALL = 1 << 16  # writes below this are gathered
    GATHERED = 1 << 20  # and written once this much is gathered
    SETTLED = 1 << 26  # every this many bytes the file is synced and its pages handed back

    def __init__(self, folder: Folder, entry: str, temp: str, fd: int) -> None:
        super().__init__()
        self.folder, self.entry, self.temp, self.fd = folder, entry, temp, fd
        self.crc, self.size, self.committed = 0, 0, False
        self.gathered = bytearray()
        self.settled = 0  # bytes synced and dropped from the page cache
        self.failure: OSError | None = None  # the first write that failed (torch.save reports it as its own error)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        if len(view) < self.SMALL:
            self.gathered += view
            if len(self.gathered) >= self.GATHERED:
                self.flush()
        else:
            self.flush()
            self.write_all(view)
        if self.size - self.settled >= self.SETTLED:
            self.settle()
        return len(view)

    def settle(self) -> None:
        """Sync what was written and drop it from the page cache: a checkpoint is not read back
        soon, and writing the next part into the pages just freed (instead of memory not
        touched yet) keeps the kernel's share of a save's CPU time small, which a background
        save takes from training (Note [background saves])."""
        self.flush()
        try:
            os.fdatasync(self.fd)  # a full disk or quota may first show here (network filesystems)
        except OSError as e:
            self.failure = self.failure or OSError(e.errno, e.strerror, e.filename)
            raise
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self.settled, self.size - self.settled, os.POSIX_FADV_DONTNEED)
        self.settled = self.size

    def flush(self) -> None:
        """Write what was gathered (before the file is read back or committed)."""
        if self.gathered:
            self.write_all(memoryview(self.gathered))
            self.gathered = bytearray()

    def write_all(self, view: memoryview) -> None:
        written = 0
        try:
            while written < len(view):
                written += os.write(self.fd, view[written:])
        except OSError as e:  # kept without its traceback: torch's C++ writer holds this object, and
            # a traceback through its frames would make a cycle gc cannot see, keeping the tensors alive
            self.failure = self.failure or OSError(e.errno, e.strerror, e.filename)
            raise

    def tell(self) -> int:
        return self.size

    def read_at(self, offset: int, length: int) -> bytes:
        self.flush()
        return read_at(self.fd, offset, length, float("inf"))

    def commit(self) -> None:
        """Flush to disk and rename into place."""
        self.flush()
        os.fsync(self.fd)
        os.replace(self.temp, self.entry, src_dir_fd=self.folder.fd, dst_dir_fd=self.folder.fd)
        self.folder.sync()
        self.committed = True

    def close(self) -> None:
        if not self.closed:
            self.gathered = bytearray()  # a file not committed is removed: nothing more to write
            os.close(self.fd)
            if not self.committed:
                try:
                    os.unlink(self.temp, dir_fd=self.folder.fd)
                except OSError:
                    pass
        super().close()


class View(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a read-only seekable stream (for zipfile),
    every read within `deadline`."""

    def __init__(self, fd: int, start: int, length: int, deadline: float) -> None:
        super().__init__()
        self.fd, self.start, self.length, self.deadline, self.pos = fd, start, length, deadline, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = min(max(0, base + offset), self.length)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.length - self.pos)
        data = read_at(self.fd, self.start + self.pos, n, self.deadline)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def read_range(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.length:
            raise OSError(f"bytes {offset}..{offset + length} lie outside a record of {self.length}")
        return read_at(self.fd, self.start + offset, length, self.deadline)


def read_at(fd: int, offset: int, length: int, deadline: float) -> bytes:
    """Exactly `length` bytes at `offset` (OSError when the file is shorter), within `deadline`."""
    parts, got = [], 0
    while got < length:
        chunk = os.pread(fd, min(READ_CHUNK, length - got), offset + got)
        if not chunk:
            raise OSError(f"the file ends at byte {offset + got}, before the {length} bytes at {offset}")
        parts.append(chunk)
        got += len(chunk)
        check_deadline(deadline, f"descriptor {fd}")
    return b"".join(parts)


def check_deadline(deadline: float, what: object) -> None:
    if time.monotonic() > deadline:
        raise Overdue(f"reading {what} did not finish within the timeout")
