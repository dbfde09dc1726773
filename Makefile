# Each target makes its own virtualenv (.venv) with python3 first, so a fresh machine needs
# nothing but python3 and make.
PYTHON ?= python3
# The Python the built wheel is tested on (make dist); CI picks 3.12 so that each Python runs once.
WHEEL_PYTHON ?= $(PYTHON)
VENV := .venv
BIN := $(VENV)/bin
DEPS := setup.cfg setup.py pyproject.toml

.PHONY: demo test lint matrix sid ray-deps sdist-test docs release wheel-test dist bench bench-quick clean
# The bin folders of every installed pyenv Python 3.10-3.13, put first on PATH for tox.
PYENV_BINS := $(shell for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[0-3]\.[0-9]+$$'); do printf '%s:' "$$(pyenv prefix $$v)/bin"; done)

$(VENV)/.installed: $(DEPS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,contract]'
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,contract,bench]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/swe-flush demo

# The suite, one test at a time. `make test TEST_WORKERS=4`: in two parts, the test files spread over 4
# processes (pytest-xdist, one file to a process), then the tests marked `alone` one at a time: about
# 4 minutes on two cores, quiet only (beside other load a few timed guard tests still fail: CHANGELOG).
TEST_WORKERS ?= 0
test: $(VENV)/.installed
ifeq ($(TEST_WORKERS),0)
	$(BIN)/python -m pytest
else
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not alone"
	$(BIN)/python -m pytest -m alone
endif

$(VENV)/.installed-lint: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,contract,lint]'
	touch $@

lint: $(VENV)/.installed-lint
	$(BIN)/ruff check swe_flush_sync swe_flush_sync_pytest.py tests benchmarks
	$(BIN)/mypy --strict swe_flush_sync swe_flush_sync_pytest.py
	test "$$($(BIN)/mypy --strict tests/typecheck/misspelt_options.py | grep -c 'Unexpected keyword argument')" = 4

# Ray, for the one test that runs a watchdog in a Ray actor (skipped without it).
$(VENV)/.installed-ray: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,contract,ray]'
	touch $@

ray-deps: $(VENV)/.installed-ray

$(VENV)/.installed-matrix: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,contract,matrix]'
	touch $@

# The suite on every Python a trainer runs, side by side as CI runs it (.ci/matrix): 3.10-3.13 and
# the declared dependency floors (setup.cfg [tox:tox]) through tox, 3.14 and 3.15 in the sid root
# (make sid: root only); a missing interpreter fails the run. ENVS=py312 (py310 ... py313,
# floors) runs one tox environment alone; TOXFLAGS adds tox options (CI: a --workdir and the wheel).
matrix: $(VENV)/.installed-matrix
	$(if $(ENVS),PATH="$(PYENV_BINS)$$PATH" $(BIN)/tox run --skip-missing-interpreters false -e $(ENVS) $(TOXFLAGS),bash .ci/matrix)

# The suite on Python 3.14 and 3.15 from Debian sid's packages, side by side in a debootstrap root
# (.ci/sid; root only: it mounts and chroots). The root is kept in /var/cache/swe-flush-sid.
sid:
	bash .ci/sid root
	bash .ci/sid test 3.14 3.15

# Build the sdist, unpack it elsewhere and run its own tests against it.
sdist-test: $(VENV)/.installed
	rm -rf build/sdist-test && mkdir -p build/sdist-test
	$(BIN)/python -m pip install --quiet --disable-pip-version-check build
	$(BIN)/python -m build --sdist --outdir build/sdist-test .
	tar -xzf build/sdist-test/*.tar.gz -C build/sdist-test
	cd build/sdist-test/swe_flush_sync-* && ../../../$(BIN)/python -m pytest -q -p no:cacheprovider

# The documentation site (MkDocs + mkdocstrings), built strictly: a broken link, a missing page
# or a reference to a name that no longer exists fails the build. The chart is copied in.
$(VENV)/.installed-docs: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,contract,docs]'
	touch $@

docs: $(VENV)/.installed-docs
	mkdir -p docs/assets && cp benchmarks/results.png docs/assets/results.png
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The release check (make release): sdist and wheel, twine's strict check, a long description with
# no relative link or image, check-wheel-contents, then the wheel installed alone into a fresh
# virtualenv; make dist also runs the suite against it (from a folder holding the tests and docs
# but not the package).
$(VENV)/.installed-release: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,contract,release]'
	touch $@

release: $(VENV)/.installed-release
	rm -rf dist build/wheel-test
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(BIN)/python .ci/check_long_description.py dist/*.whl
	$(BIN)/check-wheel-contents dist/*.whl
	PATH="$(PYENV_BINS)$$PATH" $(WHEEL_PYTHON) -m venv build/wheel-test/venv
	build/wheel-test/venv/bin/python -m pip install --quiet --disable-pip-version-check "$$(ls dist/*.whl)[test,contract]"
	mkdir -p build/wheel-test/run
	cp -r tests docs README.md CHANGELOG.md setup.cfg build/wheel-test/run/
	cd build/wheel-test/run && ../venv/bin/python -c "import swe_flush_sync, sys; f = swe_flush_sync.__file__; print('testing', f); sys.exit('site-packages' not in f)"

# The suite against the wheel that `make release` installed (a folder without the package).
wheel-test:
	cd build/wheel-test/run && ../venv/bin/python -m pytest -q -p no:cacheprovider

dist: release
	$(MAKE) wheel-test

bench: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks --plot

bench-quick: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks --quick

clean:
	rm -rf $(VENV) build *.egg-info
