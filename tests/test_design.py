"""README's design section as a check on the code: every library file is in its layer
picture, and each imports only files of layers below its own (no file imports another of
its line), including imports inside functions; the library never imports the CLI or the
test tooling beside it; and `__init__`, the public API, imports each name on first use."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "fullshard"


def readme_layers() -> dict[str, int]:
    """Each file README's layer list names (`name` followed by its description in
    parentheses), with its layer number."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Design: one training step, top-down"):readme.index("Beside the library:")]
    layers: dict[str, int] = {}
    for item in re.finditer(r"^(\d+)\. (.*?)(?=^\d+\. |\Z)", section, re.S | re.M):
        for name in re.findall(r"`(\w+)`\s*\(", item.group(2)):
            assert name not in layers, f"README names {name} in two layers"
            layers[name] = int(item.group(1))
    return layers


def package_imports(path: Path) -> list[tuple[str, int]]:
    """The fullshard modules `path` imports (top level or inside functions), with the line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fullshard":
            parts = node.module.split(".")
            out += [(parts[1], node.lineno)] if len(parts) > 1 else [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name.split(".")[1], node.lineno) for a in node.names if a.name.startswith("fullshard.")]
    return out


def test_every_library_file_is_in_the_layer_picture_and_imports_only_layers_below():
    layers = readme_layers()
    files = {path.stem for path in PACKAGE.glob("*.py")} | {"checkpoint"}
    assert files == set(layers), f"not in README: {sorted(files - set(layers))}; no such file: " \
                                 f"{sorted(set(layers) - files)}"
    wrong = []
    for path in sorted(PACKAGE.glob("*.py")):
        for name, line in package_imports(path):
            if name in ("cli", "testing") or layers.get(name, 99) >= layers[path.stem]:
                wrong.append(f"{path.name}:{line} ({layers[path.stem]}) imports {name} ({layers.get(name)})")
    assert not wrong, wrong


def test_the_checkpoint_package_imports_its_own_files_in_order_and_the_library_below_it():
    layers = readme_layers()
    doc = (PACKAGE / "checkpoint" / "__init__.py").read_text()
    order = re.findall(r"`(\w+)`\s*\(", doc[: doc.index('"""', 3)])
    files = {path.stem for path in (PACKAGE / "checkpoint").glob("*.py")} - {"__init__"}
    assert set(order) == files, (order, files)
    wrong = []
    for path in sorted((PACKAGE / "checkpoint").glob("*.py")):
        if path.stem == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fullshard"):
                parts = node.module.split(".")
                names = [parts[2]] if len(parts) > 2 and parts[1] == "checkpoint" else \
                    [a.name for a in node.names] if node.module == "fullshard.checkpoint" else []
                for name in names:
                    if order.index(name) >= order.index(path.stem):
                        wrong.append(f"checkpoint/{path.name}:{node.lineno} imports checkpoint's {name}")
                if len(parts) > 1 and parts[1] != "checkpoint" and layers.get(parts[1], 99) >= layers["checkpoint"]:
                    wrong.append(f"checkpoint/{path.name}:{node.lineno} imports {parts[1]}")
    assert not wrong, wrong


# torch.distributed's collectives, and DTensor's methods that run one
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
               "isend", "irecv", "batch_isend_irecv", "broadcast_object_list", "monitored_barrier", "full_tensor",
               "redistribute"}
ONLY_ON_DIST = {"broadcast", "barrier", "gather", "scatter", "reduce", "send", "recv"}  # common names elsewhere


def test_collectives_are_issued_from_collectives_py_and_routes_py_only():
    # README: routes.py issues the collectives of a unit's plans, collectives.py every other one,
    # each waited for under a deadline
    found = []
    for path in sorted([*PACKAGE.glob("*.py"), *PACKAGE.glob("checkpoint/*.py")]):
        if path.name in ("collectives.py", "routes.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, owner = node.func.attr, node.func.value
                on_dist = isinstance(owner, ast.Name) and owner.id == "dist"
                if name in COLLECTIVES or (name in ONLY_ON_DIST and on_dist):
                    found.append(f"{path.name}:{node.lineno} {name}")
    assert not found, found


def test_the_public_names_load_on_first_use_and_import_fullshard_alone_imports_no_torch():
    """README's layer 14: `import fullshard` imports nothing of torch's (so `fullshard train`'s
    launcher does without the library: test_cli.py); each public name then loads as the object
    its module defines, and each module as an attribute (`fullshard.testing`). `fullshard.stats`
    stays the function with the module that counts imported (it is fullshard.accounting: as
    fullshard/stats.py, its import made the attribute the module)."""
    import os
    import subprocess
    import sys

    import fullshard
    import fullshard.accounting
    import fullshard.training
    from tests.world import child_pythonpath

    fresh = subprocess.run([sys.executable, "-c", "import sys, fullshard; print(sorted(m for m in sys.modules if "
                            "m.split('.')[0] in ('torch', 'fullshard')))"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": child_pythonpath()})
    assert fresh.returncode == 0 and fresh.stdout.split() == ["['fullshard']"], (fresh.stdout, fresh.stderr[-2000:])
    try:
        fullshard.no_such_name
        unknown = "resolved"
    except AttributeError as e:
        unknown = str(e)
    assert unknown == "module 'fullshard' has no attribute 'no_such_name'"
    assert set(fullshard.__all__) <= set(dir(fullshard))
    assert fullshard.stats is fullshard.training.stats and fullshard.optim.__name__ == "fullshard.optim"
    assert fullshard.testing.__name__ == "fullshard.testing"
    names = {name: getattr(getattr(fullshard, name), "__module__", "") for name in fullshard.__all__}
    assert all(module.startswith("fullshard.") for name, module in names.items() if name != "optim"), names
