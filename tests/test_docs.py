"""What README promises about the code's surface, checked against the code: every exported
name is in the API table, every `fullshard train` flag in its option list."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

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
