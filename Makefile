# Two commands from a fresh clone:  `make demo`  and  `make test`.
# TORCH_SPEC: the CPU wheel by default; on a GPU machine install your CUDA build of torch first
# (e.g. `make setup TORCH_SPEC="torch==2.13.0"` with your index), the rest of the install keeps it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast test-lowest lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(VENV)/bin/pretrain demo --out demo_out

# DeepSpeed JIT-builds its CPU comm op into TORCH_EXTENSIONS_DIR: one per venv, so a stale build lock
# left in the user's ~/.cache by a killed job (or another checkout's build) never stalls the suite.
test: setup
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions $(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions $(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The fast suite with every dependency at the lowest version pyproject.toml allows, torch included
# (.ci/lowest_pins.py; torch's floor is PyPI's CUDA build, a few GB to download, run on the CPU).
test-lowest:
	$(PYTHON) -m venv .venv-lowest
	.venv-lowest/bin/python -m pip install -q --upgrade pip
	$(PYTHON) .ci/lowest_pins.py > .venv-lowest/constraints.txt
	.venv-lowest/bin/python -m pip install -q -c .venv-lowest/constraints.txt -e ".[dev]"
	TORCH_EXTENSIONS_DIR=$(CURDIR)/.venv-lowest/torch_extensions .venv-lowest/bin/python -m pytest -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .venv-lowest demo_out .pytest_cache
