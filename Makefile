# Two commands from a fresh clone:  `make demo`  and  `make test`.
# TORCH_SPEC: the CPU wheel by default; on a GPU machine install your CUDA build of torch first
# (e.g. `make setup TORCH_SPEC="torch==2.13.0"` with your index), the rest of the install keeps it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers for the fast tests (1.5x on 2 cores); the slow ones start their own ranks and run one at a time.
TEST_WORKERS ?= 2

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
# `make test`: the fast tests on TEST_WORKERS workers, then the slow ones. It fails if either part fails, or if
# neither collected a test (pytest's exit 5); one part with nothing selected (PYTEST_ARGS naming fast tests) is fine.
test: setup
	@fast=0; slow=0; \
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions $(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) $(PYTEST_ARGS) || fast=$$?; \
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions $(PY) -m pytest -m slow $(PYTEST_ARGS) || slow=$$?; \
	if [ $$fast = 5 ] && [ $$slow = 5 ]; then exit 5; fi; \
	for rc in $$fast $$slow; do [ $$rc = 0 ] || [ $$rc = 5 ] || exit $$rc; done

test-fast: setup
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions $(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The fast suite with every dependency at the lowest version pyproject.toml allows, torch included
# (.ci/lowest_pins.py; torch's floor is PyPI's CUDA build, a few GB to download, run on the CPU).
test-lowest:
	$(PYTHON) -m venv .venv-lowest
	.venv-lowest/bin/python -m pip install -q --upgrade pip
	$(PYTHON) .ci/lowest_pins.py > .venv-lowest/constraints.txt
	.venv-lowest/bin/python -m pip install -q -c .venv-lowest/constraints.txt -e ".[dev]"
	TORCH_EXTENSIONS_DIR=$(CURDIR)/.venv-lowest/torch_extensions .venv-lowest/bin/python -m pytest -m "not slow" -n $(TEST_WORKERS) -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .venv-lowest demo_out .pytest_cache
