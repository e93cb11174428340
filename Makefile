# `make train` and `make test` set everything up from nothing (a .venv with the
# CPU build of torch pinned by constraints.txt) and then run.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test test-integrations bench test-torch

# pip byte-compiles on one core; compileall does it on all of them (14 s less of the
# ~60 s set-up on 2 cores). Like pip, it skips the few files this Python cannot compile.
# Without it, the environment's PYTHONDONTWRITEBYTECODE=1 makes every process compile what
# it imports again. Letting the tests' processes write the bytecode of what they import
# instead (no compileall; PYTHONDONTWRITEBYTECODE cleared for pytest) was tried on a fresh
# clone: 26 s of set-up instead of 38, and the tests 14 s longer: no gain. Of transformers'
# ~400 model folders (a quarter of the venv's Python) the tests import four: the rest is left
# out (3 s of the set-up); a model imported all the same is compiled as it is imported. So are
# the packages no test process imports (a record of every process's modules at exit, 2026-12-05):
# pip, setuptools, networkx, pydantic, rich, markdown_it, typer and test (2.3 s of 13.6).
# fullshard's own source and the tests' modules are compiled too: every fresh process of the
# suite (about 110: ranks, probes, spawned worlds) otherwise compiles what it imports of them,
# 0.05-0.08 CPU-seconds each; an edited file is compiled again as it is imported.
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile --constraint constraints.txt --editable '.[test,ft]'
	$(PY) -m compileall -q -j 0 -x 'transformers/models/(?!(auto|gpt2|llama|t5)/)[^/]+/|site-packages/(pip|setuptools|networkx|pydantic|rich|markdown_it|typer|test)/' $(VENV)/lib src tests > /dev/null || true
	touch $@

train: $(VENV)/.installed
	$(VENV)/bin/fullshard train

# two pytest workers, a test file each at a time: the suite is CPU-bound (its ranks, and the
# fresh processes of its end-to-end runs), and one worker leaves a core idle a quarter of the time
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile

# The frameworks users train with (Lightning, Accelerate, the HF Trainer, PEFT, torchtitan),
# each against torch's FSDP2: integrations/test_frameworks.py, about 2 minutes
$(VENV)/.integrations: $(VENV)/.installed integrations/requirements.txt integrations/requirements-no-deps.txt
	$(PY) -m pip install --quiet --no-compile --constraint constraints.txt -r integrations/requirements.txt
	$(PY) -m pip install --quiet --no-compile --no-deps --constraint constraints.txt -r integrations/requirements-no-deps.txt
	touch $@

test-integrations: $(VENV)/.integrations
	$(PY) -m pytest -q integrations

bench: $(VENV)/.installed
	$(VENV)/bin/fullshard bench

# The suite on another torch, in a venv of its own: make test-torch TORCH=2.12.0
# (PyPI's builds of other releases are CUDA builds, several GB with their nvidia-* wheels;
# they run on the CPU.)
TORCH ?= 2.12.0
test-torch:
	python3 -m venv .venv-torch-$(TORCH)
	echo "torch==$(TORCH)" > .venv-torch-$(TORCH)/constraints.txt
	.venv-torch-$(TORCH)/bin/python -m pip install --quiet --no-compile --constraint .venv-torch-$(TORCH)/constraints.txt --editable '.[test,ft]'
	# torchao 0.18 imports on recent torch only; a torchao that does not import breaks
	# transformers' import too, so it goes (the float8 test then skips, saying why)
	.venv-torch-$(TORCH)/bin/python -c "import torchao" 2>/dev/null || .venv-torch-$(TORCH)/bin/python -m pip uninstall --quiet --yes torchao
	.venv-torch-$(TORCH)/bin/python -m pytest -q -n 2 --dist loadfile
