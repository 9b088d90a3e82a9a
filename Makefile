# torch-overlay: every command runs in the virtual environment of one base, .venv/$(TORCH).
# The bases are the torch releases torch_overlay/manifest.json lists; TORCH picks one (default 2.13.0, a CPU wheel).
PYTHON ?= python3
TORCH ?= 2.13.0
BASES := $(shell $(PYTHON) -c 'import json; print(*(b["version"] for b in json.load(open("torch_overlay/manifest.json"))["bases"]))')
ifeq ($(filter $(TORCH),$(BASES)),)
$(error TORCH=$(TORCH) is not a base of torch-overlay (bases: $(BASES)). Pick one, or add the release with `make rebase UPSTREAM=<torch wheel or site-packages dir>`)
endif
VENV := .venv/$(TORCH)
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest
# pytest-xdist workers for make test and check-stack, a test class (or module) to a worker (tools/check_stack.py,
# pytest_jobs). Most of a distributed test's time is its ranks starting and importing torch, so 2 workers pay
# even on 2 cores; PYTEST_JOBS=1 runs them one at a time.
PYTEST_JOBS ?= 2
XDIST := $(if $(filter-out 0 1,$(PYTEST_JOBS)),-n $(PYTEST_JOBS) --dist loadscope)
# The machines this project is built on cap torch through a constraint file in pip's configuration. Each venv pins
# torch exactly (never an open range, which would pull a CUDA build of several GB), so the cap is lifted for these
# installs only; nothing outside the venv changes.
PIP := PIP_CONSTRAINT=/dev/null $(PY) -m pip

.PHONY: install sources test test-stock test-overlay lint apply-overlay revert-overlay status check clean patches bench-tp-ddp \
	bench-unshard bench-clip bench-foreach apply-patches revert-patches ghstack rebase check-stack example recipes quickstart

install: $(VENV)/.installed

# torch is installed first, pinned exactly. Every install after it runs under a constraint file holding that pin
# ($(VENV)/torch-constraint.txt), so a dependency that requires torch (lightning, in dev) can never upgrade,
# downgrade or replace it: pip fails instead.
$(VENV)/.installed: pyproject.toml torch_overlay/manifest.json
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# setuptools>=77 (pyproject's build requirement: test_install builds a wheel in the venv), resolved with torch, so
	# within what torch pins (2.11 and 2.12: setuptools<82; their venvs would otherwise keep Python's 65.5)
	$(PIP) install --quiet "torch==$(TORCH)" "setuptools>=77"
	echo "torch==$(TORCH)" > $(VENV)/torch-constraint.txt
	$(PIP) install --quiet -c $(VENV)/torch-constraint.txt -e '.[dev]'
	$(PY) -c 'import sys, torch; v = torch.__version__.split("+")[0]; sys.exit(0 if v == "$(TORCH)" else f"{sys.prefix}: torch {v}, not $(TORCH)")'
	touch $@

# The pristine files of every base, for the patch tools and the sync check: found in the base venvs here, else the
# missing bases' wheels are downloaded into .venv/wheels (pinned, no dependencies).
sources: install
	$(PY) -m tools.pristine --fetch $(if $(WHEEL),--wheel $(WHEEL))

# The red tests must fail on stock torch with their listed error (on the bases that have the bug), then
# everything passes with the overlay.
test: test-stock test-overlay

test-stock: install
	$(PYTEST) --stock $(XDIST) test

test-overlay: install sources
	$(PYTEST) --durations=15 $(XDIST) test

UPSTREAM_FORMATTED := test/distributed/tensor/test_optimizers.py,test/distributed/fsdp/test_fsdp_tp_integration.py,test/distributed/fsdp/test_fsdp_unshard_params.py,test/distributed/test_dynamo_distributed.py

lint: install
	$(PY) -m ruff check torch_overlay tools test examples
	$(PY) -m ruff format --check torch_overlay tools test examples
	# The overlay modules are upstream files: PyTorch's formatting (ruff format, 88 columns)
	$(PY) -m ruff format --check --isolated --line-length 88 torch_overlay/torch torch_overlay/bases
	# The tests under test/distributed travel upstream in the patches: PyTorch's formatting too, and 88 columns
	# (but upstream's test_optimizers.py, which keeps upstream's formatting; the series adds tests to it)
	$(PY) -m ruff format --check --isolated --line-length 88 --extend-exclude $(UPSTREAM_FORMATTED) test/distributed
	$(PY) -m ruff check --isolated --line-length 88 --select E,F,W --extend-exclude $(UPSTREAM_FORMATTED) test/distributed

# A script as a user runs it, on 4 CPU ranks, with the overlay for this command only: the test suite's boot
# directory on PYTHONPATH runs the persistent install's start-up hook in every torchrun rank, and nothing in the venv
# changes (TORCH_OVERLAY=0 make example: stock torch, where the example's require_active() stops every rank at once,
# in one line). --standalone takes a free port.
TORCHRUN_OVERLAY = PYTHONPATH=$(CURDIR)/test/overlay/boot:$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)) \
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4

example: install
	$(TORCHRUN_OVERLAY) examples/tp_ddp_train.py

# The recipes (docs/recipes.md), Lightning Fabric's and the torchtitan-style one, as `make example` runs the example.
# The Fabric recipe needs lightning (in the dev extra).
recipes: install
	for recipe in fabric_tp_ddp titan_style_tp_replicate; do $(TORCHRUN_OVERLAY) examples/$$recipe.py || exit 1; done

# The README's quick start as a new user follows it: a fresh venv (removed after) holding only torch $(TORCH), pinned,
# then the quick start's commands as written, from `pip install` to the example's "OK: ..." line; then its install
# line in a venv whose torch is not a base, which must leave that torch alone and refuse to activate. No dev venv.
quickstart:
	$(PYTHON) -m tools.quickstart --torch $(TORCH)

apply-overlay: install
	$(PY) -m torch_overlay.activate

revert-overlay: install
	$(PY) -m torch_overlay.activate --revert

status: install
	$(PY) -m torch_overlay.activate --status

# The base, then the sync check: on every base, patches/ must reproduce the overlay and its tests byte for byte.
check: install sources
	$(PY) -m torch_overlay.activate --check
	$(PY) -m tools.check $(if $(WHEEL),--wheel $(WHEEL))

# Every prefix of the installed base's series applied to its pristine files, its touched modules imported and the
# tests of every patch it applies run, all served from a scratch copy; then the stack rules on the upstream series
# and the lint of the lines each patch adds (flake8 E, F, W, each patch at its prefix; docs/patches.md).
# CHECK_STACK_ARGS=--own-tests runs at each prefix only the tests its last patch adds or changes (CI, default base),
# --import-only skips the tests, --test-last runs them at the last prefix only (CI, newest base), --rules-only
# skips everything but the rules and the lint; --table prints docs/patches.md's stack table.
check-stack: install sources
	$(PY) -m tools.check_stack $(if $(WHEEL),--wheel $(WHEEL)) --jobs $(PYTEST_JOBS) $(CHECK_STACK_ARGS)

# The per-base payloads (torch_overlay/bases/<version>/...: the payload's change transplanted onto each base's own
# file, for the runtime files whose code differs between bases), then patches/NNNN-*.patch, patches/series
# (upstream) and patches/series-<version> (bases that need backports), generated from the overlay and
# patches/series.toml on the newest base. Run it after editing any file under torch_overlay/torch.
patches: install sources
	$(PY) -m tools.transplant $(if $(WHEEL),--wheel $(WHEEL))
	$(PY) -m tools.patches $(if $(WHEEL),--wheel $(WHEEL))

# Fork mode: the series applied in place to this environment's torch, and reverted byte for byte.
apply-patches: install
	$(PY) -m torch_overlay apply-patches

revert-patches: install
	$(PY) -m torch_overlay revert-patches

# One commit per patch of the upstream series on a branch of a PyTorch checkout, by your git identity, then
# `ghstack submit $(GHSTACK_ARGS)`. GHSTACK_OFFLINE=1: no checkout: prints the PRs it would push, from ghstack's fake
# GitHub, on the pristine files of BASE (from WHEEL=, this machine, or its wheel downloaded as `make sources` does).
# NO_SUBMIT=1: build the branch only (then rebase it onto upstream main and `ghstack submit`; docs/patches.md, "ghstack").
ghstack: install
	$(PY) -m tools.ghstack_export $(if $(GHSTACK_OFFLINE),--offline,--pytorch-dir "$(PYTORCH_DIR)") \
		$(if $(BASE),--base $(BASE)) $(if $(WHEEL),--wheel $(WHEEL)) $(if $(NO_SUBMIT),--no-submit) -- $(GHSTACK_ARGS)

# Add a torch release as a base, in place: 3-way merge of the overlay onto its files (a wheel or a
# site-packages-like directory), then manifest, torch requirement and patches/, checked on every base.
rebase: install sources
	$(PY) -m tools.rebase --upstream "$(UPSTREAM)"

clean:
	rm -rf .venv build *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Rank-0 writeback in summon_full_params vs today's workaround vs one bare scatter (4 ranks, CPU; ~2 min).
bench-unshard: install
	$(PY) -m tools.bench_unshard

# TP + DDP: a launch-bound step in one process (plain and TP, alone and under DDP, eager and compiled), then the
# step vs stock DDP, FSDP2 and replicate_with_fsdp (4 ranks, CPU; ~4 min; --foreach via python -m tools.bench_tp_ddp).
bench-tp-ddp: install
	$(PY) -m tools.bench_tp_ddp

# clip_grad_norm_ over FSDP2 + TP (two meshes) vs stock FSDP2 on one mesh vs a full_tensor() clip (4 ranks, CPU; ~1 min).
bench-clip: install
	$(PY) -m tools.bench_clip

bench-foreach: install
	$(PY) -m tools.bench_foreach

# On a machine with a GPU, from a copy of the working tree with its own torch (nothing installed; .whl/ holds the
# wheels it lacks): the overlay's status, the example and the recipes on CUDA with NCCL against TP alone, the TP + DDP
# and FSDP tests, the step cost, as one table (under 8 min; docs/testing.md, "On a GPU"). Without a GPU: a dry run.
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=$(CURDIR) $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m tools.gpu_check
