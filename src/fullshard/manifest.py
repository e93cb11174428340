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
# bytes inside its file, and the chunks of a tensor do not overlap. DCP's own .metadata is
# written beside it for torch.distributed.checkpoint's readers; fullshard never reads it
# back for its own checkpoints.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from fullshard.errors import fail
from fullshard.files import name

FORMAT = 2
MAX_DIMS = 16
MAX_INT = 2**62  # sizes, offsets and steps beyond this are not a real checkpoint's
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in
          (getattr(torch, attr) for attr in dir(torch)) if isinstance(dtype, torch.dtype)}


@dataclass(frozen=True)
class Layout:
    """Where a chunk's values lie in its file: a storage of `storage_numel` elements starting at
    byte `data_offset`, and the chunk's view of it."""

    data_offset: int
    storage_numel: int
    storage_offset: int
    stride: tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
        if not isinstance(value, list) or len(value) > MAX_DIMS or length is not None and len(value) != length:
            raise self.bad(field_name, f"must be a list of {length if length is not None else 'at most 16'} "
                                       f"integers, not {value!r}"[:300])
        return tuple(self.integer(v, f"{field_name}[{i}]", low) for i, v in enumerate(value))


def read(text: str, where: str) -> Contents:
    """Contents of a fullshard.json, every field checked (Note [manifest])."""
    schema = Schema(where)
    try:
        doc = json.loads(text)
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
        contents.tensors[key] = read_tensor(schema, key, entry, files)
    for key, value in schema.mapping(doc["values"], "values").items():
        if key in contents.tensors:
            raise schema.bad(f"values[{key!r}]", "names a tensor too")
        contents.values[key] = SavedValue(value)
    return contents


def read_tensor(schema: Schema, key: str, entry: Any, files: dict[str, tuple[int, int]]) -> SavedTensor:
    where = f"tensors[{key!r}]"
    entry = schema.object(entry, where, {"dtype", "shape", "chunks"})
    if entry["dtype"] not in DTYPES:
        raise schema.bad(f"{where}.dtype", f"is not a torch dtype: {entry['dtype']!r}"[:300])
    dtype = DTYPES[entry["dtype"]]
    shape = schema.ints(entry["shape"], f"{where}.shape")
    if not isinstance(entry["chunks"], list):
        raise schema.bad(f"{where}.chunks", "must be a list")
    chunks = []
    for i, raw in enumerate(entry["chunks"]):
        at = f"{where}.chunks[{i}]"
        raw = schema.object(raw, at, {"offsets", "sizes", "file", "start", "length", "data_offset", "storage_numel",
                                      "storage_offset", "stride"})
        offsets = schema.ints(raw["offsets"], f"{at}.offsets", len(shape))
        sizes = schema.ints(raw["sizes"], f"{at}.sizes", len(shape))
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
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
                        schema.ints(raw["stride"], f"{at}.stride", len(shape)))
        if problem := layout_problem(layout, sizes, dtype.itemsize, length):
            raise schema.bad(at, problem)
        chunks.append(Chunk(offsets, sizes, file, start, length, layout))
    if problem := overlap_problem(chunks) or coverage_problem(chunks, shape):
        raise schema.bad(where, problem)
    return SavedTensor(dtype, shape, tuple(chunks))


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


def overlap_problem(chunks: list[Chunk]) -> str | None:
    """Why the chunks of one tensor overlap, if they do (each place of it saved once)."""
    boxes = sorted((c.offsets, c.sizes) for c in chunks if math.prod(c.sizes))
    for i, (offsets, sizes) in enumerate(boxes):
        for other_offsets, other_sizes in boxes[i + 1 :]:
            if other_offsets[:1] and other_offsets[0] >= offsets[0] + sizes[0]:
                break  # sorted by the first offset: no later chunk reaches back into this one
            if all(o < p + t and p < o + s for o, s, p, t in zip(offsets, sizes, other_offsets, other_sizes)):
                return f"has chunks at {list(offsets)} and {list(other_offsets)} that overlap"
    return None
