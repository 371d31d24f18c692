# The two commands a new user needs: `make demo` and `make test`. Both create .venv on first use.
# torch is pinned to the CPU wheel here (an unpinned torch pulls a multi-GB CUDA build); the package itself
# only asks for a range (pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: install demo test lint fixtures compat clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/slabconv fuse fixtures/digits-prepbn/checkpoint.pth --out build/demo --force

test: install
	$(VENV)/bin/ruff check slabconv tests fixtures benchmarks scripts
	$(VENV)/bin/ruff format --check slabconv tests fixtures benchmarks scripts
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n auto --dist loadfile --durations=15

lint: install
	$(VENV)/bin/ruff check slabconv tests fixtures benchmarks scripts
	$(VENV)/bin/ruff format --check slabconv tests fixtures benchmarks scripts
	$(VENV)/bin/mypy

# The declared dependency ranges at both ends (fresh venvs under build/compat, several GB; not part of make test):
# docs/compat.md's table is rewritten from the results.
compat:
	$(PYTHON) scripts/compat.py --write-docs

fixtures: install
	$(PY) fixtures/make_fixtures.py

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache
