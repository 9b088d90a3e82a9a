# torch-overlay: every command runs in the project's own virtual environment, .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest

.PHONY: install test test-stock test-overlay lint apply-overlay revert-overlay status check clean

install: $(VENV)/.installed

# torch is pinned exactly (see pyproject.toml): an unpinned torch would pull a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# The red tests must fail on stock torch with their listed error, then everything passes with the overlay.
test: test-stock test-overlay

test-stock: install
	$(PYTEST) --stock test

test-overlay: install
	$(PYTEST) test

lint: install
	$(PY) -m ruff check torch_overlay tools test
	$(PY) -m ruff format --check torch_overlay tools test

apply-overlay: install
	$(PY) -m torch_overlay.activate

revert-overlay: install
	$(PY) -m torch_overlay.activate --revert

status: install
	$(PY) -m torch_overlay.activate --status

check: install
	$(PY) -m torch_overlay.activate --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
