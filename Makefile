# Two entry points, each doing all set-up on a fresh machine:
#   make quickstart   train the tiny MoE of configs/quickstart.yaml on CPU and print its run card
#   make test         run the test suite
VENV ?= .venv
PYTHON ?= python3
# the torch requirement, installed first; the build (CPU or a CUDA version) is whichever pip's indexes offer
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# test processes run side by side (pytest-xdist), one core each; the distributed tests' ranks come on top
TEST_WORKERS ?= 2
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install quickstart test lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/lightning-moe fit --config configs/quickstart.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS)

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_moe tests benchmarks
	$(VENV)/bin/lint-imports

clean:
	rm -rf runs lightning_logs .pytest_cache
