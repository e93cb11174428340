"""What this machine has, read before any rank starts and without importing torch where that can
be avoided: its GPUs and its free memory, which the launcher's checks weigh a run against."""

from __future__ import annotations

import ast
import importlib.util
import os


def cuda_gpus() -> int:
    """The GPUs torch can use here. A build of torch for CPUs alone (torch.version.cuda and .hip
    None) can use none; that is read from its version file, without importing torch (a
    CPU-second at every launch, on machines where the ranks need every core)."""
    spec = importlib.util.find_spec("torch")
    try:
        with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as f:
            version = f.read()
        values = {node.target.id: ast.literal_eval(node.value) for node in ast.parse(version).body
                  if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value}
    except (AttributeError, TypeError, IndexError, OSError, SyntaxError, ValueError):
        values = {}
    if values.get("cuda", "") is None and values.get("hip", "") is None:  # both named, both None
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def available_memory() -> int:
    """Bytes of host memory free for new processes (MemAvailable on Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
