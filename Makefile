# Each target makes its own virtualenv (.venv) with python3 first, so a fresh machine needs
# nothing but python3 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEPS := setup.cfg setup.py pyproject.toml

.PHONY: demo test bench bench-quick clean

$(VENV)/.installed: $(DEPS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,contract]'
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,contract,bench]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/swe-flush demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest

bench: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks

bench-quick: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks --quick

clean:
	rm -rf $(VENV) build *.egg-info
