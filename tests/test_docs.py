"""What README promises about the code's surface, checked against the code: every exported
name is in the API table, every `fullshard train` flag in its option list."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import torch

import fullshard
from fullshard.cli.config import TrainConfig

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def api_table() -> str:
    return README.split("## API", 1)[1].split("\n## ", 1)[0]


def test_every_export_is_in_the_api_table():
    table = api_table()
    names = [n for n in fullshard.__all__ if n != "optim"] + [f"optim.{n}" for n in fullshard.optim.__all__]
    missing = [n for n in names if not re.search(rf"`{re.escape(n)}\b", table)]
    assert not missing, f"exported but not in README's API table: {missing}"


def test_every_train_flag_is_in_the_option_list():
    options = README.split("Options cover the model", 1)[1].split("\n\n", 1)[0]
    flags = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)]
    missing = [f for f in flags if not re.search(rf"`{f}\b", options)]
    assert not missing, f"fullshard train flags README's option list leaves out: {missing}"


ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "fullshard"
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"`([^`\n]+)`")
NOTE = re.compile(r"Note \[([^\]]+)\]")
SOURCES = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
TESTS = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))


def modules() -> dict[str, Path]:
    """A module's dotted name inside the package (`ft.manager`, `collectives`) -> its file."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def defined(path: Path, dotted: str) -> bool:
    """Whether `dotted` ("Unit.relayout", "DEFAULT_TIMEOUT") is in the file's module: found by
    attribute, or, for what only instances have (a field set in __init__), in the file's text."""
    module = importlib.import_module("fullshard." + modules_by_path()[path]) if modules_by_path()[path] else fullshard
    value = module
    for part in dotted.split("."):
        if not hasattr(value, part):
            break
        value = getattr(value, part)
    else:
        return True
    text = path.read_text()
    first, *rest = dotted.split(".")
    return bool(re.search(rf"^(class|def) {re.escape(first)}\b|^{re.escape(first)}\b[^=\n]*=", text, re.M)) and \
        all(re.search(rf"self\.{re.escape(name)}\b|^    {re.escape(name)}\b", text, re.M) for name in rest)


def modules_by_path() -> dict[Path, str]:
    return {path: name for name, path in modules().items()}


# the variables the docs name objects by, and the classes those objects are
VARIABLES = {"module": (fullshard.FSDPModule, torch.nn.Linear), "unit": (fullshard.FSDPModule,),
             "model": (fullshard.FSDPModule,), "stats": (fullshard.Stats,)}


def on_variable(module: str, name: str) -> bool:
    """`module.to(...)`, `stats.skipped_steps`: an attribute of the object the text's variable
    names (a sharded module, a Stats), not a name in the file of that name."""
    return any(hasattr(cls, name.split(".")[0]) for cls in VARIABLES.get(module, ()))


# files a text tells the reader to save its example as
SAVED_AS = {text.name: set(re.findall(r"Save this as `([^`]+)`", text.read_text())) for text in TEXTS}


def quoted_names() -> list[tuple[str, str]]:
    """(file, code) for every code span of README.md and docs/ that names a module of the
    package followed by something in it (`collectives.redistribute`, `fullshard/accounting.py`)."""
    out = []
    for text in TEXTS:
        for code in CODE.findall(text.read_text()):
            out.append((text.name, code))
    return out


def test_every_code_name_quoted_in_the_docs_exists_where_the_text_puts_it():
    mods = modules()
    wrong = []
    for where, code in quoted_names():
        code = code.strip()
        if re.fullmatch(r"(src/)?fullshard/[\w/]+\.py", code):  # a file of the package
            if not (ROOT / "src" / code.removeprefix("src/")).exists():
                wrong.append((where, code))
            continue
        if re.fullmatch(r"\w+\.py", code):  # a file by its name alone, of the package or the tests
            if not list(PACKAGE.rglob(code)) and not (ROOT / "tests" / code).exists() and code not in SAVED_AS[where]:
                wrong.append((where, code))
            continue
        if re.fullmatch(r"(tests|benchmarks|examples|integrations)/[\w/.-]+\.(py|txt|md)", code):
            if not (ROOT / code).exists():
                wrong.append((where, code))
            continue
        if re.fullmatch(r"test_\w+", code):  # a test, by name
            if not re.search(rf"def {code}\b", TESTS):
                wrong.append((where, code))
            continue
        match = re.fullmatch(r"(?:fullshard\.)?([a-z_]+(?:\.[a-z_]+)*)\.([A-Za-z_][\w.]*)(\(.*\))?", code)
        if not match:
            continue
        module, name = match.group(1), match.group(2)
        while module not in mods and "." in module:  # `ft.manager.Manager`, or `cli.config` read as module.name
            module, name = module.rsplit(".", 1)[0], module.rsplit(".", 1)[1] + "." + name
        if module not in mods:
            continue  # torch's, or a model's attribute (`model.h`)
        if not defined(mods[module], name) and not on_variable(module, name):
            wrong.append((where, code))
    assert not wrong, f"code names in the docs that are not where they say: {wrong}"


def test_every_note_the_docs_cite_exists_in_the_code():
    notes = {" ".join(note.split()) for note in NOTE.findall(SOURCES)}  # a name may wrap: "# Note [exit\n# status]"
    notes |= {" ".join(note.replace("#", " ").split()) for note in NOTE.findall(SOURCES)}
    cited = [(text.name, " ".join(note.split())) for text in TEXTS for note in NOTE.findall(text.read_text())]
    missing = [(where, note) for where, note in cited if note not in notes]
    assert not missing, f"notes the docs cite that no source file has: {missing}"


COMMAND = re.compile(r"(\.venv/bin/python|python3? |PYTHONPATH=|make |fullshard (train|bench|plan)|pytest|benchmarks/\w+\.py)")


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each section of a markdown text, at any depth."""
    parts = re.split(r"^(#{1,4} .*)$", text, flags=re.M)
    return [(parts[i], parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def test_every_table_of_figures_comes_with_the_command_that_made_it():
    # a table of measured figures (ms, s, x, MB, %) with no command in its section, or in the
    # section it is under, is a figure nobody can rerun
    missing = []
    for text in TEXTS:
        above = ""
        for heading, body in sections(text.read_text()):
            if heading.startswith("## "):
                above = body
            table = [line for line in body.splitlines() if line.startswith("|") and re.search(r"\d", line)]
            figures = [line for line in table if re.search(r"\d(\.\d+)?(x\b| ?(ms|MB|MiB|GB|GiB|%)\b| s\b)", line)]
            if figures and not COMMAND.search(body) and not COMMAND.search(above):
                missing.append((text.name, heading.strip()))
    assert not missing, f"tables of figures with no command that made them: {missing}"
