# Two commands do all set-up on a fresh machine:
#   make demo   create .venv, install, pack the bundled real sample and print the summary
#   make test   install, run the test suite (GPU tests skip cleanly without CUDA; the hf extra
#               installs transformers and trl for tests/test_integrations_*.py)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Without a GPU we install a CPU build of torch first, so that the `torch>=2.6` requirement of
# pyproject.toml is already met and pip never pulls a multi-GB CUDA build. With a GPU, pip
# resolves `torch>=2.6` normally and gets the CUDA build. Override TORCH_CPU_SPEC if needed.
TORCH_CPU_SPEC ?= torch==2.13.0
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# pip's quietness for the installs: -qq prints errors only (a failed install still stops make with
# pip's ERROR lines), not the warnings a user cannot act on (setuptools' "Editable installation"
# notice, a pip config's unreachable extra index). `make install PIP_QUIET=-q` shows warnings too.
PIP_QUIET ?= -qq
# `make test` runs the suite on TEST_WORKERS pytest-xdist processes (the dev extra installs it): on the
# two-core CI machine about 2.5 min with 2 against 4-6 min in one process. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

.PHONY: demo test install clean bench-pack

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(PIP_QUIET) --upgrade pip
ifeq ($(HAS_GPU),)
	$(PIP) install $(PIP_QUIET) "$(TORCH_CPU_SPEC)"
endif
	$(PIP) install $(PIP_QUIET) -e ".[data,service,dev,hf]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/flamia pack --out out/sample-packed --capacity 65536

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

bench-pack: install
	$(PIP) install $(PIP_QUIET) -e ".[bench]"
	$(PY) benchmarks/bench_pack.py

clean:
	rm -rf $(VENV) out .pytest_cache
