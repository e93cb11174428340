# `make train` and `make test` set everything up from nothing (a .venv with the
# CPU build of torch pinned by constraints.txt) and then run.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test bench

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[test]'
	touch $@

train: $(VENV)/.installed
	$(VENV)/bin/fullshard train

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(VENV)/bin/fullshard bench
