"""torch.distributed.checkpoint's files, written as DCP writes them and read as data.

A DCP directory is a `.metadata` pickle (every item's name, shape, dtype and chunks, and
the byte range of each chunk's record) and data files whose records are torch.save
archives: a zip of a small pickle (data.pkl: which storage, its dtype and the tensor's
view of it) and the storage's raw bytes. fullshard writes these with torch's own pickler
and torch.save, so torch's readers take them, and reads them with pickle_data.parse
(Note [pickles as data]), matching each tree against the shapes below and building its
own objects (manifest.Contents); nothing outside those shapes is admitted.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import struct
import sys
import zipfile
from typing import Any

import torch

from fullshard.checkpoint.files import View, name
from fullshard.state_dict import LOADABLE
from fullshard.checkpoint.manifest import (DEADLINE_EVERY, MAX_INT, Chunk, Contents, Layout, SavedTensor, SavedValue,
                                check_deadline, coverage_problem, gc_paused, layout_problem, overlap_problem)
from fullshard.checkpoint.pickle_data import Budget, Call, Dict, Global, Object, Persistent, PickleDataError, parse, plain

METADATA_MODULE = "torch.distributed.checkpoint.metadata"
STORAGE_INFO = Global("torch.distributed.checkpoint.filesystem", "_StorageInfo")
STORAGE_DTYPES = {storage: dtype for dtype, storage in torch.storage._dtype_to_storage_type_map().items()}
MAX_HEADER = 1 << 20  # a record's data.pkl: a tensor's is ~150 bytes, a value's a few KB
MAX_VALUE = 1 << 24


class FormatError(ValueError):
    """A DCP file that is not of the shapes fullshard reads."""


# ---- reading ----------------------------------------------------------------------------------


def is_class(node: Any, cls: Global) -> bool:
    return isinstance(node, Global) and node == cls


def meta_class(name_: str) -> Global:
    return Global(METADATA_MODULE, name_)


def fields_of(node: Any, cls: Global, required: set[str], optional: set[str], budget: Budget) -> dict[str, Any]:
    """The fields of a dataclass instance as the pickle made it (NEWOBJ of `cls`, then BUILD with a
    dict), checked against the names it may have."""
    budget.spend()
    if not (isinstance(node, Object) and is_class(node.cls, cls) and node.args == () and isinstance(node.state, Dict)):
        raise FormatError(f"expected a {cls.name}, found {shape_of(node)}")
    out = {}
    for key, value in node.state.items:
        if not isinstance(key, str) or key in out or key not in required | optional:
            raise FormatError(f"a {cls.name} has an unexpected field {key!r}"[:200])
        out[key] = value
    if not required <= set(out):
        raise FormatError(f"a {cls.name} lacks the fields {sorted(required - set(out))}")
    return out


def shape_of(node: Any) -> str:
    if isinstance(node, Object):
        cls = node.cls
        return f"an object of {cls.module}.{cls.name}" if isinstance(cls, Global) else "an object"
    if isinstance(node, Call):
        func = node.func
        return f"a call of {func.module}.{func.name}" if isinstance(func, Global) else "a call"
    return f"a {type(node).__name__}"


def integer(node: Any, what: str, low: int = 0) -> int:
    if type(node) is not int or not low <= node <= MAX_INT:
        raise FormatError(f"{what} must be an integer from {low} to {MAX_INT}, not {node!r}"[:200])
    return node


def size(node: Any, what: str) -> tuple[int, ...]:
    """A torch.Size as the pickle made it: torch.Size called with a list or tuple of integers."""
    if not (isinstance(node, Call) and is_class(node.func, Global("torch", "Size")) and len(node.args) == 1
            and isinstance(node.args[0], (list, tuple)) and len(node.args[0]) <= 16):
        raise FormatError(f"{what} must be a torch.Size, not {shape_of(node)}")
    return tuple(integer(v, what) for v in node.args[0])


def dtype_of(node: Any) -> torch.dtype:
    if not (isinstance(node, Global) and node.module == "torch" and node.name in LOADABLE):
        raise FormatError(f"a tensor's dtype must be one fullshard loads ({', '.join(LOADABLE)}), not "
                          f"{node.name if isinstance(node, Global) else shape_of(node)}"[:400])
    return LOADABLE[node.name]


def properties_dtype(node: Any, budget: Budget) -> torch.dtype:
    """The dtype of a TensorProperties (its state a 5-tuple, or a dict in older torch)."""
    budget.spend()
    cls = meta_class("TensorProperties")
    if not (isinstance(node, Object) and is_class(node.cls, cls) and node.args == ()):
        raise FormatError(f"expected a TensorProperties, found {shape_of(node)}")
    if isinstance(node.state, tuple) and len(node.state) == 5:
        dtype, layout, requires_grad, memory_format, pin_memory = node.state
        strided = isinstance(layout, Call) and is_class(layout.func, Global("torch.serialization", "_get_layout")) \
            and layout.args == ("torch.strided",)
        encoded = isinstance(memory_format, Call) and is_class(memory_format.func, meta_class("_MEM_FORMAT_ENCODING")) \
            and len(memory_format.args) == 1 and type(memory_format.args[0]) is int
        if not (strided and encoded and isinstance(requires_grad, bool) and isinstance(pin_memory, bool)):
            raise FormatError("a TensorProperties holds something other than a strided layout, a memory format "
                              "code and two flags")
        return dtype_of(dtype)
    fields = fields_of(node, cls, {"dtype"}, {"layout", "requires_grad", "memory_format", "pin_memory"}, budget)
    return dtype_of(fields["dtype"])


def read_metadata(data: bytes, where: str, deadline: float = math.inf) -> Contents:
    """What a plain DCP directory holds, from its .metadata (Note [pickles as data]), by `deadline`."""
    with gc_paused():
        return metadata_contents(data, where, deadline)


def metadata_contents(data: bytes, where: str, deadline: float) -> Contents:
    try:
        tree = parse(data, deadline)
        budget = Budget(64 * len(data) + 1024)
        top = fields_of(tree, meta_class("Metadata"), {"state_dict_metadata"},
                        {"planner_data", "storage_data", "storage_meta", "version"}, budget)
        records = storage_records(top.get("storage_data"), budget)
        contents = Contents()
        items = top["state_dict_metadata"]
        if not isinstance(items, Dict):
            raise FormatError("state_dict_metadata must be a dict")
        for key, item in items.items:
            if not isinstance(key, str) or key in contents.tensors or key in contents.values:
                raise FormatError(f"an item's name must be a string used once, not {key!r}"[:200])
            if isinstance(item, Object) and is_class(item.cls, meta_class("BytesStorageMetadata")):
                file, start, length = record_of(records, key, None)
                contents.values[key] = SavedValue(None, file, start, length)
                continue
            fields = fields_of(item, meta_class("TensorStorageMetadata"), {"properties", "size", "chunks"}, set(),
                               budget)
            dtype, shape = properties_dtype(fields["properties"], budget), size(fields["size"], f"{key}'s size")
            if not isinstance(fields["chunks"], list):
                raise FormatError(f"{key}'s chunks must be a list")
            chunks = []
            check_deadline(deadline, f"{key}'s {len(fields['chunks'])} chunks")
            for i, raw in enumerate(fields["chunks"]):
                if i % DEADLINE_EVERY == DEADLINE_EVERY - 1:
                    check_deadline(deadline, f"{key}'s {len(fields['chunks'])} chunks")
                place = fields_of(raw, meta_class("ChunkStorageMetadata"), {"offsets", "sizes"}, set(), budget)
                offsets, sizes = size(place["offsets"], f"{key}'s chunk"), size(place["sizes"], f"{key}'s chunk")
                if len(offsets) != len(shape) or len(sizes) != len(shape) or \
                        any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
                    raise FormatError(f"a chunk of {key} lies outside its shape {list(shape)}")
                chunk = Chunk(offsets, sizes, *record_of(records, key, offsets))
                if math.prod(sizes) * dtype.itemsize > chunk.length:
                    raise FormatError(f"a chunk of {key} has {math.prod(sizes)} elements, more than its record of "
                                      f"{chunk.length} bytes holds")
                chunks.append(chunk)
            if problem := overlap_problem(chunks) or coverage_problem(chunks, shape):
                raise FormatError(f"{key} {problem}")
            contents.tensors[key] = SavedTensor(dtype, shape, tuple(chunks))
    except (PickleDataError, FormatError) as e:
        raise FormatError(f"{where}: {e}") from None
    contents.files = {file: None for file in contents.needed()}
    return contents


def storage_records(node: Any, budget: Budget) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
    """{(item name, chunk offsets or None): (file, start, length)} from DCP's storage_data."""
    if not isinstance(node, Dict):
        raise FormatError("storage_data must be a dict")
    out = {}
    for key, value in node.items:
        index = fields_of(key, meta_class("MetadataIndex"), {"fqn"}, {"offset", "index"}, budget)
        if not isinstance(index["fqn"], str):
            raise FormatError("a MetadataIndex's fqn must be a string")
        offset = index.get("offset")
        place = (index["fqn"], None if offset is None else size(offset, "a MetadataIndex's offset"))
        info = fields_of(value, STORAGE_INFO, {"relative_path", "offset", "length"}, {"transform_descriptors"}, budget)
        if info.get("transform_descriptors"):
            raise FormatError(f"{place[0]} is stored through transforms (e.g. compression), which fullshard does "
                              f"not read")
        out[place] = (name(info["relative_path"], "a storage record"), integer(info["offset"], "a record's offset"),
                      integer(info["length"], "a record's length"))
    return out


def record_of(records: dict, key: str, offsets: tuple[int, ...] | None) -> tuple[str, int, int]:
    if (key, offsets) not in records:
        raise FormatError(f"no storage record holds {key}" + (f" at {list(offsets)}" if offsets is not None else ""))
    return records[(key, offsets)]


def open_record(view: View) -> tuple[zipfile.ZipFile, str]:
    """A torch.save record as a zip archive, and the prefix of its members' names."""
    try:
        archive = zipfile.ZipFile(view)
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise FormatError(f"a record is not a torch.save archive ({e})") from None
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise FormatError("a record is not a torch.save archive (no data.pkl)")
    prefix = pickles[0][: -len("data.pkl")]
    if prefix + "byteorder" in archive.namelist() and member(archive, prefix + "byteorder", 16) != \
            sys.byteorder.encode():
        raise FormatError(f"a record's bytes are not in this machine's {sys.byteorder}-endian order")
    return archive, prefix


def member(archive: zipfile.ZipFile, entry: str, limit: int) -> bytes:
    info = archive.getinfo(entry)
    if info.file_size > limit or info.compress_type != zipfile.ZIP_STORED:
        raise FormatError(f"a record's {entry.rsplit('/', 1)[-1]} is compressed or larger than {limit} bytes")
    try:
        return archive.read(entry)
    except (zipfile.BadZipFile, OSError) as e:
        raise FormatError(f"a record's {entry.rsplit('/', 1)[-1]} cannot be read ({e})") from None


def record_layout(view: View, dtype: torch.dtype, sizes: tuple[int, ...]) -> Layout:
    """Where the values of the tensor a torch.save record holds lie in it, checked to be a
    tensor of `dtype` and `sizes` over one storage of its own."""
    archive, prefix = open_record(view)
    header = member(archive, prefix + "data.pkl", MAX_HEADER)
    try:
        tree = parse(header)
    except PickleDataError as e:
        raise FormatError(f"a tensor record's header: {e}") from None
    rebuild = Global("torch._utils", "_rebuild_tensor_v2")
    if not (isinstance(tree, Call) and is_class(tree.func, rebuild) and len(tree.args) in (6, 7)):
        raise FormatError(f"a tensor record holds {shape_of(tree)}, not a tensor")
    storage, storage_offset, shape, stride, requires_grad, hooks = tree.args[:6]
    pid = storage.pid if isinstance(storage, Persistent) else None
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], Global)
            and pid[1].module == "torch" and pid[1].name in STORAGE_DTYPES and isinstance(pid[2], str)
            and isinstance(pid[3], str)):
        raise FormatError("a tensor record's storage is not a typed torch storage")
    if not (isinstance(hooks, Call) and is_class(hooks.func, Global("collections", "OrderedDict"))
            and hooks.args == () and isinstance(requires_grad, bool)):
        raise FormatError("a tensor record has backward hooks or flags of another kind")
    if STORAGE_DTYPES[pid[1].name] != dtype:
        raise FormatError(f"a tensor record holds {STORAGE_DTYPES[pid[1].name]}, its metadata says {dtype}")
    if not (isinstance(shape, tuple) and isinstance(stride, tuple) and tuple(shape) == tuple(sizes)
            and len(stride) == len(shape)):
        raise FormatError(f"a tensor record holds shape {shape!r}, its metadata says {list(sizes)}"[:200])
    numel = integer(pid[4], "a storage's size")
    entry = prefix + "data/" + pid[2]
    try:
        info = archive.getinfo(entry)
    except KeyError:
        raise FormatError("a tensor record lacks its storage") from None
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != numel * dtype.itemsize:
        raise FormatError("a tensor record's storage is compressed or of another size than its header says")
    local = view.read_range(info.header_offset, 30)  # the zip local file header
    if local[:4] != b"PK\x03\x04":
        raise FormatError("a tensor record's zip headers are damaged")
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    layout = Layout(info.header_offset + 30 + name_length + extra_length, numel,
                    integer(storage_offset, "a storage offset"), tuple(integer(s, "a stride") for s in stride))
    if problem := layout_problem(layout, sizes, dtype.itemsize, view.length):
        raise FormatError(f"a tensor record {problem}")
    return layout


def record_value(view: View) -> Any:
    """The plain value a torch.save record of a non-tensor item holds."""
    if view.length > MAX_VALUE:
        raise FormatError(f"a value record of {view.length} bytes is larger than {MAX_VALUE}")
    archive, prefix = open_record(view)
    data = member(archive, prefix + "data.pkl", MAX_VALUE)
    try:
        return plain(parse(data), Budget(64 * len(data) + 1024))
    except PickleDataError as e:
        raise FormatError(f"a value record: {e}") from None


# ---- writing ----------------------------------------------------------------------------------


def metadata_bytes(contents: Contents, planner_data: dict[str, tuple], checkpoint_id: str, save_id: str) -> bytes:
    """DCP's .metadata for `contents`, pickled with torch's own classes (as dcp.save writes it)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    items: dict[str, Any] = {}
    records: dict[Any, Any] = {}
    for key, tensor in contents.tensors.items():
        items[key] = TensorStorageMetadata(TensorProperties(dtype=tensor.dtype), torch.Size(tensor.shape),
                                           [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                                            for c in tensor.chunks])
        for i, c in enumerate(tensor.chunks):
            records[MetadataIndex(key, c.offsets, i)] = _StorageInfo(c.file, c.start, c.length)
    for key, value in contents.values.items():
        items[key] = BytesStorageMetadata()
        records[MetadataIndex(key)] = _StorageInfo(value.file, value.start, value.length)
    metadata = Metadata(items, planner_data=planner_data, storage_data=records,
                        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id))
    if "version" in {f.name for f in dataclasses.fields(Metadata)}:
        metadata.version = "1.0.0"  # DCP's format version of these files
    return pickle.dumps(metadata)
