# torch-overlay: every command runs in the project's own virtual environment, .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest

.PHONY: install test test-stock test-overlay lint apply-overlay revert-overlay status check clean patches bench-tp-ddp bench-unshard \
	apply-patches revert-patches ghstack rebase

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
	# The overlay modules are upstream files: PyTorch's formatting (ruff format, 88 columns)
	$(PY) -m ruff format --check --isolated --line-length 88 torch_overlay/torch

apply-overlay: install
	$(PY) -m torch_overlay.activate

revert-overlay: install
	$(PY) -m torch_overlay.activate --revert

status: install
	$(PY) -m torch_overlay.activate --status

# The base, then the sync check: patches/ must reproduce the overlay and its tests byte for byte.
check: install
	$(PY) -m torch_overlay.activate --check
	$(PY) -m tools.check $(if $(WHEEL),--wheel $(WHEEL))

# patches/NNNN-*.patch and patches/series, generated from the overlay and patches/series.toml.
patches: install
	$(PY) -m tools.patches $(if $(WHEEL),--wheel $(WHEEL))

# Fork mode: the series applied in place to this environment's torch, and reverted byte for byte.
apply-patches: install
	$(PY) -m torch_overlay apply-patches

revert-patches: install
	$(PY) -m torch_overlay revert-patches

# One commit per patch on a branch of a PyTorch checkout, then `ghstack submit $(GHSTACK_ARGS)`.
ghstack: install
	$(PY) -m tools.ghstack_export --pytorch-dir "$(PYTORCH_DIR)" -- $(GHSTACK_ARGS)

# 3-way merge of the overlay onto another torch (a wheel or a site-packages-like directory).
rebase: install
	$(PY) -m tools.rebase --upstream "$(UPSTREAM)" --out "$(or $(OUT),build/rebase)"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Rank-0 writeback in summon_full_params vs today's workaround vs one bare scatter (4 ranks, CPU; ~2 min).
bench-unshard: install
	$(PY) -m tools.bench_unshard

# TP + DDP: swap-hook cost vs a bare DTensor.from_local loop; step time vs stock DDP and FSDP2 (4 ranks, CPU; ~1 min).
bench-tp-ddp: install
	$(PY) -m tools.bench_tp_ddp
