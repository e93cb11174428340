"""What a checkpoint holds, as data: its tensor table and values, and fullshard.json, the
closed schema that writes them down.

# Note [manifest]: fullshard.json tells `load` everything it reads: for every tensor of the
# flattened state dict (DCP's names, e.g. "model.h.0.mlp.c_fc.weight") its dtype, shape
# and chunks (each chunk's offsets and sizes in the whole tensor, and where its values lie:
# the file, the byte of its storage's first element, the storage's length and the chunk's
# storage offset and strides); every other value (optimizer hyperparameters, JSON); the
# step, the user's `extra`, the optimizer's class; and each data file's size and CRC-32.
# `read` checks every field for its type and range before anything is used: names of
# files are one path component (files.name), every chunk lies inside its tensor, its
# bytes inside its file, and the chunks of a tensor do not overlap (Note [chunk layouts]).
# Where a chunk's values lie is read again from its record's own torch.save header when
# the chunk is read, and must agree with the manifest's, as must its dtype.
# Every check is linear, or a sort, in the size of the manifest, and runs under the load's
# deadline. DCP's own .metadata is written beside it for torch.distributed.checkpoint's
# readers; fullshard never reads it back for its own checkpoints.

"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

import torch

from fullshard.errors import fail
from fullshard.state_dict import LOADABLE, dtype_name
from fullshard.checkpoint.files import Overdue, name

FORMAT = 2
MAX_DIMS = 16
MAX_INT = 2**62  # sizes, offsets and steps beyond this are not a real checkpoint's
CHUNK_FIELDS = frozenset({"offsets", "sizes", "file", "start", "length", "data_offset", "storage_numel",
                          "storage_offset", "stride"})
DEADLINE_EVERY = 4096  # chunks checked between looks at the clock


class Layout(NamedTuple):
    """Where a chunk's values lie in its file: a storage of `storage_numel` elements starting at
    byte `data_offset`, and the chunk's view of it. (Tuples: a manifest may list 10^5 of them.)"""

    data_offset: int
    storage_numel: int
    storage_offset: int
    stride: tuple[int, ...]


class Chunk(NamedTuple):
    """A saved piece of a tensor: its place in the whole tensor and its record in a file (DCP's
    storage item: `start`, `length`); `layout` None when only the record's torch.save header
    tells where the values are (a plain DCP directory's)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int
    layout: Layout | None = None


@dataclass(frozen=True)
class SavedTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class SavedValue:
    """A non-tensor item: its value (fullshard.json), or the record holding it as a torch.save
    pickle (a plain DCP directory's), read as data (Note [pickles as data])."""

    value: Any = None
    file: str | None = None
    start: int = 0
    length: int = 0


@dataclass
class Contents:
    tensors: dict[str, SavedTensor] = field(default_factory=dict)
    values: dict[str, SavedValue] = field(default_factory=dict)
    files: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # name: (size, CRC-32); None: unlisted
    step: int | None = None
    extra: Any = None
    optimizer: str | None = None  # the class name of the optimizer saved; None: none, or not recorded
    fullshard: bool = False  # written by fullshard.save (else a plain DCP directory)

    def needed(self) -> dict[str, int]:
        """{data file: how many of its bytes the records reach}."""
        out: dict[str, int] = {}
        records = [(c.file, c.start + c.length) for t in self.tensors.values() for c in t.chunks]
        records += [(v.file, v.start + v.length) for v in self.values.values() if v.file is not None]
        for file, end in records:
            out[file] = max(out.get(file, 0), end)
        return out


def to_json(contents: Contents) -> str:
    tensors = {key: {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                     "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file,
                                 "start": c.start, "length": c.length, "data_offset": c.layout.data_offset,
                                 "storage_numel": c.layout.storage_numel, "storage_offset": c.layout.storage_offset,
                                 "stride": list(c.layout.stride)} for c in t.chunks]}
               for key, t in contents.tensors.items()}
    return json.dumps({"format": FORMAT, "byteorder": sys.byteorder, "step": contents.step, "extra": contents.extra,
                       "optimizer": contents.optimizer,
                       "files": {f: {"size": s, "crc32": c} for f, (s, c) in contents.files.items()},
                       "tensors": tensors, "values": {k: v.value for k, v in contents.values.items()}})


class Schema:
    """Field-by-field checks of a parsed fullshard.json, each failure naming the field (Note [manifest])."""

    def __init__(self, where: str) -> None:
        self.where = where

    def bad(self, field_name: str, why: str) -> Exception:
        return fail(f"{self.where} is not a valid fullshard checkpoint manifest: {field_name} {why}",
                    "The checkpoint was damaged or planted; load another one.")

    def object(self, value: Any, field_name: str, keys: set[str], optional: set[str] = frozenset()) -> dict:
        if not isinstance(value, dict):
            raise self.bad(field_name, f"must be an object, not {type(value).__name__}")
        if not keys <= set(value) or not set(value) <= keys | optional:
            raise self.bad(field_name, f"must have the fields {sorted(keys)}, has {sorted(value)}")
        return value

    def mapping(self, value: Any, field_name: str) -> dict:
        if not isinstance(value, dict):
            raise self.bad(field_name, f"must be an object, not {type(value).__name__}")
        return value

    def integer(self, value: Any, field_name: str, low: int = 0, high: int = MAX_INT) -> int:
        if type(value) is not int or not low <= value <= high:
            raise self.bad(field_name, f"must be an integer from {low} to {high}, not {value!r}")
        return value

    def ints(self, value: Any, field_name: str, length: int | None = None, low: int = 0) -> tuple[int, ...]:
        if type(value) is list and len(value) == length:  # the usual case, without a call per element
            good = True
            for v in value:
                good = good and type(v) is int and low <= v <= MAX_INT
            if good:
                return tuple(value)
        if not isinstance(value, list) or len(value) > MAX_DIMS or length is not None and len(value) != length:
            raise self.bad(field_name, f"must be a list of {length if length is not None else 'at most 16'} "
                                       f"integers, not {value!r}"[:300])
        return tuple(self.integer(v, f"{field_name}[{i}]", low) for i, v in enumerate(value))


def read(text: str, where: str, deadline: float = math.inf) -> Contents:
    """Contents of a fullshard.json, every field checked (Note [manifest]) by `deadline` (time.monotonic())."""
    with gc_paused():
        return read_checked(text, where, deadline)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector off inside: a manifest makes millions of objects, none of them
    cycles, and each collection would walk all of them (two thirds of the time of a large one)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_checked(text: str, where: str, deadline: float) -> Contents:
    schema = Schema(where)
    objects = 0

    def counted(obj: dict) -> dict:  # called for every JSON object: parsing a huge file keeps the deadline
        nonlocal objects
        objects += 1
        if objects % DEADLINE_EVERY == 0:
            check_deadline(deadline, f"{where} ({len(text)} bytes)")
        return obj

    try:
        doc = json.loads(text, object_hook=counted)
    except (ValueError, RecursionError) as e:
        raise schema.bad("the file", f"is not JSON ({e})") from None
    doc = schema.object(doc, "the document", {"format", "byteorder", "step", "extra", "optimizer", "files", "tensors",
                                              "values"})
    if doc["format"] != FORMAT:
        raise schema.bad("format", f"is {doc['format']!r}; this fullshard reads format {FORMAT}")
    if doc["byteorder"] != sys.byteorder:
        raise schema.bad("byteorder", f"is {doc['byteorder']!r}; this machine is {sys.byteorder}-endian")
    step = None if doc["step"] is None else schema.integer(doc["step"], "step")
    if doc["optimizer"] is not None and not (isinstance(doc["optimizer"], str) and doc["optimizer"].isidentifier()):
        raise schema.bad("optimizer", f"must be a class name or null, not {doc['optimizer']!r}"[:300])
    files = {}
    for file, info in schema.mapping(doc["files"], "files").items():
        name(file, f"{where}'s files")
        info = schema.object(info, f"files[{file!r}]", {"size", "crc32"})
        files[file] = (schema.integer(info["size"], f"files[{file!r}].size"),
                       schema.integer(info["crc32"], f"files[{file!r}].crc32", high=2**32 - 1))
    contents = Contents(files=files, step=step, extra=doc["extra"], optimizer=doc["optimizer"], fullshard=True)
    for key, entry in schema.mapping(doc["tensors"], "tensors").items():
        contents.tensors[key] = read_tensor(schema, key, entry, files, deadline)
    for key, value in schema.mapping(doc["values"], "values").items():
        if key in contents.tensors:
            raise schema.bad(f"values[{key!r}]", "names a tensor too")
        contents.values[key] = SavedValue(value)
    return contents


def read_tensor(schema: Schema, key: str, entry: Any, files: dict[str, tuple[int, int]],
                deadline: float) -> SavedTensor:
    where = f"tensors[{key!r}]"
    check_deadline(deadline, where)
    entry = schema.object(entry, where, {"dtype", "shape", "chunks"})
    if entry["dtype"] not in LOADABLE:
        raise schema.bad(f"{where}.dtype", f"is not a dtype fullshard loads: {entry['dtype']!r} (it loads "
                                           f"{', '.join(LOADABLE)})"[:400])
    dtype = LOADABLE[entry["dtype"]]
    shape = schema.ints(entry["shape"], f"{where}.shape")
    if not isinstance(entry["chunks"], list):
        raise schema.bad(f"{where}.chunks", "must be a list")
    chunks = []
    for i, raw in enumerate(entry["chunks"]):
        if i % DEADLINE_EVERY == DEADLINE_EVERY - 1:
            check_deadline(deadline, f"{where}'s {len(entry['chunks'])} chunks")
        if type(raw) is not dict or raw.keys() != CHUNK_FIELDS:
            schema.object(raw, f"{where}.chunks[{i}]", CHUNK_FIELDS)  # raises, naming the fields
        chunk = fast_chunk(raw, shape, files, dtype.itemsize)
        chunks.append(chunk or checked_chunk(schema, f"{where}.chunks[{i}]", raw, shape, files, dtype.itemsize))
    if problem := overlap_problem(chunks) or coverage_problem(chunks, shape):
        raise schema.bad(where, problem)
    return SavedTensor(dtype, shape, tuple(chunks))


def fast_chunk(raw: dict, shape: tuple[int, ...], files: dict[str, tuple[int, int]], itemsize: int) -> Chunk | None:
    """A chunk entry of the usual kind, all of whose checks pass, without a call per field;
    None when any check fails (checked_chunk then says which)."""
    offsets, sizes, stride, file = raw["offsets"], raw["sizes"], raw["stride"], raw["file"]
    start, length, data_offset, numel, storage_offset = (raw["start"], raw["length"], raw["data_offset"],
                                                         raw["storage_numel"], raw["storage_offset"])
    ndim = len(shape)
    if not (type(offsets) is list and type(sizes) is list and type(stride) is list and len(offsets) == ndim
            and len(sizes) == ndim and len(stride) == ndim and type(file) is str and file in files):
        return None
    count, last = 1, storage_offset
    for o, z, d, n in zip(offsets, sizes, stride, shape):
        if not (type(o) is int and type(z) is int and type(d) is int and 0 <= o and 0 <= z and 0 <= d <= MAX_INT
                and o + z <= n):
            return None
        count *= z
        last += (z - 1) * d
    for v in (start, length, data_offset, numel, storage_offset):
        if not (type(v) is int and 0 <= v <= MAX_INT):
            return None
    if start + length > files[file][0] or data_offset + numel * itemsize > length or count > numel or \
            count and last >= numel:
        return None
    return Chunk(tuple(offsets), tuple(sizes), file, start, length,
                 Layout(data_offset, numel, storage_offset, tuple(stride)))


def checked_chunk(schema: Schema, at: str, raw: dict, shape: tuple[int, ...], files: dict[str, tuple[int, int]],
                  itemsize: int) -> Chunk:
    """A chunk entry checked field by field, raising for the first that is wrong (Note [manifest])."""
    ndim = len(shape)
    offsets = schema.ints(raw["offsets"], f"{at}.offsets", ndim)
    sizes = schema.ints(raw["sizes"], f"{at}.sizes", ndim)
    if any(o + z > n for o, z, n in zip(offsets, sizes, shape)):
        raise schema.bad(at, f"lies outside the tensor's shape {list(shape)}")
    file = name(raw["file"], f"{at}.file")
    if file not in files:
        raise schema.bad(f"{at}.file", f"names {file!r}, which the manifest's files do not list")
    start, length = schema.integer(raw["start"], f"{at}.start"), schema.integer(raw["length"], f"{at}.length")
    if start + length > files[file][0]:
        raise schema.bad(at, f"reaches byte {start + length} of {file!r}, which holds {files[file][0]}")
    layout = Layout(schema.integer(raw["data_offset"], f"{at}.data_offset"),
                    schema.integer(raw["storage_numel"], f"{at}.storage_numel"),
                    schema.integer(raw["storage_offset"], f"{at}.storage_offset"),
                    schema.ints(raw["stride"], f"{at}.stride", ndim))
    if problem := layout_problem(layout, sizes, itemsize, length):
        raise schema.bad(at, problem)
    return Chunk(offsets, sizes, file, start, length, layout)


def check_deadline(deadline: float, what: str) -> None:
    """Overdue (an OSError) once `deadline` (time.monotonic()) has passed: checking `what` took too long."""
    if time.monotonic() > deadline:
        raise Overdue(f"checking {what} did not finish within the load's timeout")


def layout_problem(layout: Layout, sizes: tuple[int, ...], itemsize: int, length: int) -> str | None:
    """Why a chunk's layout does not fit inside its record of `length` bytes, if it does not."""
    if layout.data_offset + layout.storage_numel * itemsize > length:
        return f"has a storage of {layout.storage_numel} elements that does not fit in its record of {length} bytes"
    if math.prod(sizes) > layout.storage_numel:
        return f"has {math.prod(sizes)} elements, more than its storage's {layout.storage_numel}"
    if math.prod(sizes) and layout.storage_offset + sum((s - 1) * d for s, d in zip(sizes, layout.stride)) \
            >= layout.storage_numel:
        return "reads past the end of its storage"
    return None


def coverage_problem(chunks: list[Chunk], shape: tuple[int, ...]) -> str | None:
    """Why the chunks of one tensor (which do not overlap) do not cover all of it, if they do not."""
    covered = sum(math.prod(c.sizes) for c in chunks)
    return None if covered == math.prod(shape) else f"has chunks of {covered} of its {math.prod(shape)} elements"


# Note [chunk layouts]: the chunks of a tensor must not overlap (each place saved once, so a
# rank that counts the elements it read knows it read all of its part). Checking every pair
# is quadratic, so the check is a sort: dims along which every chunk spans the same extent are
# left out; along one dim left, the chunks sorted by offset must each end before the next
# begins; along several, they must form a grid: along each dim, any two chunks' extents are
# the same or apart, and no two chunks have the same extent along every dim. Every layout a
# DTensor's placements give has this form (row shards, tensor-parallel column shards, both at
# once); a manifest of another is refused as one fullshard does not read.


def overlap_problem(chunks: list[Chunk]) -> str | None:
    """Why the chunks of one tensor overlap, or are not laid out as Note [chunk layouts] says."""
    boxes = [(c.offsets, c.sizes) for c in chunks if math.prod(c.sizes)]
    if len(boxes) < 2:
        return None
    dims = [d for d in range(len(boxes[0][0])) if len({(offsets[d], sizes[d]) for offsets, sizes in boxes}) > 1]
    if not dims:
        return f"has {len(boxes)} chunks at {list(boxes[0][0])} that overlap"
    if len(dims) == 1:
        d = dims[0]
        spans = sorted((offsets[d], offsets[d] + sizes[d], offsets) for offsets, sizes in boxes)
        for (_, end, offsets), (start, _, other) in zip(spans, spans[1:]):
            if start < end:
                return f"has chunks at {list(offsets)} and {list(other)} that overlap"
        return None
    for d in dims:
        spans = sorted({(offsets[d], offsets[d] + sizes[d]) for offsets, sizes in boxes})
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                return f"has chunks whose extents along dim {d} ({end - start} elements) partly overlap"
    places = {tuple((offsets[d], sizes[d]) for d in dims) for offsets, sizes in boxes}
    if len(places) < len(boxes):
        return "has two chunks at the same place that overlap"
    return None
