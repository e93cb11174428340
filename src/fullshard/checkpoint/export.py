"""export: a sharded model's full weights as one safetensors file, gathered unit by unit."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fullshard.checkpoint.store import agree, os_problem
from fullshard.checkpoint.files import Folder
from fullshard.gather import gather_whole
from fullshard.hooks import normal_tensors, units_of
from fullshard.param import ShardedParam
from fullshard.state_dict import check_path, reshard_all, state_entries, value_of

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}


@normal_tensors
def export(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the full weights (the unwrapped model's state dict) as one safetensors file.

    Every rank takes part in gathering, unit by unit; rank 0 streams each unit's tensors
    to the file as they come, so no rank holds more than one unit's full parameters. The
    file loads with plain ``safetensors.torch.load_file`` and ``model.load_state_dict``.

    Args:
        model: the sharded model.
        path: the file to write (rank 0); replaced atomically, through a new temporary file
            beside it (Note [confined files]).

    Raises:
        FullShardError: on every rank when rank 0 cannot write the file (it is then left as it was).
    """
    check_path(path, "export")
    reshard_all(model)
    entries = state_entries(model)
    units = units_of(model, "export")
    names_of: dict[int, list[str]] = {}
    for name, entry in entries.items():
        names_of.setdefault(id(entry), []).append(name)
    # tensors in the order they become available: buffers and unmanaged parameters, then unit by unit
    plain = [(name, value_of(entry).detach()) for name, entry in entries.items() if not isinstance(entry, ShardedParam)]
    gathered = [(name, p) for unit in units for p in unit.params for name in names_of[id(p)]]
    header, offset = {}, 0
    for name, value in plain + [(name, p.sharded) for name, p in gathered]:
        nbytes = value.numel() * value.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[value.dtype], "shape": list(value.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    path = Path(path)
    folder = out = error = None
    try:
        if dist.get_rank() == 0:
            folder = Folder.open(path.parent)
            out = folder.create(path.name)
            out.write(struct.pack("<Q", len(blob)) + blob)
            for _, tensor in plain:
                out.write(tensor_bytes(tensor))
    except OSError as e:
        error = f"export to {path} could not write ({os_problem(e)})"
    try:
        for unit in units:  # every rank gathers, whether or not rank 0 can still write
            for p, tensor in gather_whole(unit):
                if out is not None and error is None:
                    try:
                        for _ in names_of[id(p)]:
                            out.write(tensor_bytes(tensor))
                    except OSError as e:
                        error = f"export to {path} could not write ({os_problem(e)})"
        if out is not None and error is None:
            out.commit()
    except OSError as e:
        error = f"export to {path} could not write ({os_problem(e)})"
    finally:
        if out is not None:
            out.close()  # a file not committed is removed
        if folder is not None:
            folder.close()
    agree(f"the export to {path}", "writing the file", units[0].timeout, {"error": error},
          nothing_changed=f"{path} is as it was")


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
