"""Which library files one training step enters, and every call from a lower file into an
upper one (issue 46's measure of "references point down").

    PYTHONPATH=src .venv/bin/python benchmarks/step_trace.py [--world 2] [--blocks 3]

Rank 0 of a gloo run of fullshard's GPT (a unit per block and the root, fp32, SGD): two
warm-up steps, then one step (forward, backward, optimizer step, zero_grad) traced with
sys.setprofile. A file is above another when it imports it, directly or through other files
of the package (the import graph is read from the sources, so it follows the code as it is);
a call is upward when the callee's file is above the caller's: a callback into a layer that
called down. gpt.py (the model) and cli/ (the application) are not the library.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "fullshard"
NOT_LIBRARY = ("gpt.py", "cli/")


def module_of(path: Path) -> str:
    """fullshard/ft/manager.py -> fullshard.ft.manager (a package's __init__: the package)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each file of the package (relative to it) -> the files it imports, directly."""
    files = {module_of(p): str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, rel in files.items():
        tree = ast.parse((PACKAGE / rel).read_text())
        package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for alias in node.names:  # a submodule by name, else a name from the module itself
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        graph[rel] = {files[t] for t in targets if t in files and files[t] != rel}
    return graph


def above(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each file -> every file it imports, directly or not (the files below it)."""
    below: dict[str, set[str]] = {}

    def visit(rel: str, seen: set[str]) -> set[str]:
        if rel in below:
            return below[rel]
        out: set[str] = set()
        for dep in graph.get(rel, ()):
            if dep not in seen:
                out |= {dep} | visit(dep, seen | {rel})
        below[rel] = out
        return out

    for rel in graph:
        visit(rel, set())
    return below


def library_file(filename: str) -> str | None:
    marker = os.sep + "fullshard" + os.sep
    if marker not in filename or "site-packages" in filename and "/src/" not in filename:
        return None
    rel = filename.split(marker, 1)[1]
    return None if rel.startswith(NOT_LIBRARY) else rel


def run(rank: int, world: int, port: int, blocks: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import fullshard
    from fullshard.gpt import GPT, Block, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=blocks, n_head=2, n_embd=32))
    fullshard.shard_model(model, wrap={Block})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = torch.randint(0, 64, (2, 17))

    def step() -> None:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        step()
    dist.barrier()
    files: collections.Counter = collections.Counter()
    upward: collections.Counter = collections.Counter()
    cross = 0
    below = above(import_graph())

    def profile(frame, event, arg) -> None:
        nonlocal cross
        if event != "call":
            return
        callee = library_file(frame.f_code.co_filename)
        if callee is None:
            return
        files[callee] += 1
        caller = library_file(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
        if caller is None or caller == callee:
            return
        cross += 1
        if caller in below.get(callee, ()):  # the callee imports the caller: a call up
            upward[(caller, frame.f_back.f_code.co_name, callee, frame.f_code.co_name)] += 1

    sys.setprofile(profile)
    step()
    sys.setprofile(None)
    dist.barrier()
    if rank == 0:
        queue.put((dict(files), dict(upward), cross))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    ranks = mp.start_processes(run, args=(args.world, port, args.blocks, queue), nprocs=args.world,
                               start_method="spawn", join=False)
    files, upward, cross = queue.get(timeout=300)
    ranks.join()
    print(f"library files one step enters: {len(files)}; calls into them: {sum(files.values())}; "
          f"calls from one library file into another: {cross}")
    for rel, n in sorted(files.items(), key=lambda kv: -kv[1]):
        print(f"  {rel:28s} {n:6d} calls")
    print(f"upward calls (a lower file calling into a file above it): {sum(upward.values())}")
    for (caller, caller_fn, callee, callee_fn), n in sorted(upward.items(), key=lambda kv: -kv[1]):
        print(f"  {caller}:{caller_fn} -> {callee}:{callee_fn}  x{n}")


if __name__ == "__main__":
    main()
