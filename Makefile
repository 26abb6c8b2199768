# Two commands for a new user: `make demo` and `make test`. Both set up .venv first.
SHELL := /bin/bash
# The interpreter the venvs are made from: the distribution's Python 3.11 where the machine
# has one that can make a venv, else python3; PYTHON=... chooses another. Debian 12's
# /usr/bin/python3.11 (3.11.2) is a static, profile-optimised build: the same integration
# tests took 13 % less CPU and wall time on it than on pyenv's 3.11.7 (a shared-library build
# without profile optimisation), which is this project's machines' python3; the suite's time
# is mostly Python (imports, launchers, agents): docs/measurements/2026-11-27-ci-cost.md.
DISTRO_PYTHON := /usr/bin/python3.11
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell $(DISTRO_PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1 && echo $(DISTRO_PYTHON) || echo python3)
endif
VENV ?= .venv
BIN := $(VENV)/bin
# CPU wheel where there is no GPU (found locally on this project's machines); on a GPU
# machine the same pin resolves to PyPI's CUDA build. Override with TORCH_SPEC=...
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

# The releases `make torch-smoke` runs: the lowest pyproject admits and the newest.
SMOKE_TORCH ?= 2.11.0 2.15.0

.PHONY: setup demo test test-unit lint clean torch-smoke

# torch by pip (it finds the CPU wheel on this project's machines, and honours a machine's pip
# cap), the rest by uv: the same constraints, resolved and installed in about 30 s of wall
# time instead of pip's 115 (2-core VM, 2026-11-27), byte-compiled as pip does (see `test`).
UV_SPEC ?= uv==0.13.9
# TMPDIR inside the venv: uv leaves an empty uv-setuptools-<hash>.lock in its temp dir for
# each editable build, and /tmp is not ours to leave files in.
UV_TMP := $(abspath $(VENV))/.uv-tmp
UV := TMPDIR=$(UV_TMP) $(BIN)/uv pip install --python $(BIN)/python --quiet --compile-bytecode

# pip byte-compiles on one core (26 of its 42 CPU s here, torch and its dependencies); uv
# compiles only what it installs. So pip installs without compiling, and what it installed
# (every entry of site-packages at that moment) is compiled on every core while uv installs
# the rest: setup 81-91 -> 64 s of wall (2-core VM, docs/measurements/2026-11-27-ci-cost.md).
# compileall's exit status is not checked, as pip does not check it: torch ships a file
# written for a newer Python (torch/testing/_internal/py312_intrinsics.py), left uncompiled.
SITE_PACKAGES = $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("platlib"))')

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@mkdir -p $(UV_TMP)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-compile "$(TORCH_SPEC)" "$(UV_SPEC)"
	$(BIN)/python -m compileall -q -j 0 "$(SITE_PACKAGES)"/* >/dev/null 2>&1 & \
	  $(UV) -c constraints.txt "$(TORCH_SPEC)" -e '.[test,lint]'; status=$$?; wait; exit $$status
	@touch $(STAMP)

setup: $(STAMP)

# A 2-rank save-and-load of a tiny Llama on the embedded S3 server (SeaweedFS on 127.0.0.1).
demo: setup
	$(BIN)/dcp-fsdp save-and-load nproc=2 iterations=3

# Test files run on PYTEST_WORKERS processes (pytest-xdist, one file per worker at a time:
# a file's tests share fixtures); PYTEST_WORKERS=0 runs them in this process. Two on two
# cores: three took make test from 14:53 to 11:45 alone (2-core VM, 2026-11-26), but inside
# .ci/run they are slower than two (2026-11-27: 25:11 against 24:09, 11 % more CPU for the
# same tests; with forked ranks, 19:21 against 19:11; docs/measurements/2026-11-27-ci-cost.md).
PYTEST_WORKERS ?= 2
# The package and tests byte-compiled first: where PYTHONDONTWRITEBYTECODE=1 (this project's
# machines set it) Python never writes a .pyc, so each of the suite's ~2,000 processes would
# compile the modules it imports again (about 0.2 s each). Only changed files are rewritten.
test: setup
	$(BIN)/python -m compileall -q dcp_fsdp tests >/dev/null
	$(BIN)/python -m pytest -q -rs --durations=12 -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The inner loop: tests/unit, the logic alone, in this process (no root, no servers, no
# subprocess: what needs them is in tests/integration). About a minute on an idle 2-core
# machine (2 workers: one alone takes about 65 s of CPU); longer while other work shares it.
test-unit: setup
	$(BIN)/python -m compileall -q dcp_fsdp tests >/dev/null
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests/unit $(PYTEST_ARGS)

# The package, tests, benchmarks and scripts linted (ruff, its complexity gates included) and
# type-checked (mypy, check_untyped_defs; files and settings in pyproject.toml): .ci/run runs it.
lint: setup
	$(BIN)/ruff check dcp_fsdp tests benchmarks scripts
	$(BIN)/mypy

# Each torch in SMOKE_TORCH, in a venv of its own (.venv-torch-VERSION, installed by the
# project venv's uv): sync and async (thread, process) save-and-load, a resharded load and a
# report (scripts/torch_smoke.sh). Every release is run; any failure fails the target.
torch-smoke: setup
	@failed=0; for version in $(SMOKE_TORCH); do PYTHON=$(PYTHON) scripts/torch_smoke.sh $$version || failed=1; done; exit $$failed

clean:
	rm -rf $(VENV) .venv-torch-* *.egg-info .pytest_cache

# A local Slurm test cluster: 2 emulated nodes (network namespaces), munge and a SeaweedFS
# S3 server on a bridge the script creates (root; installs slurm-wlm and munge when missing).
# Then: sbatch --nodes 2 batch/savebatch.sh (README: "Slurm").
.PHONY: slurm-up slurm-down slurm-status
slurm-up: setup
	@mkdir -p logs
	scripts/slurm/localcluster.sh up

slurm-down:
	scripts/slurm/localcluster.sh down

slurm-status:
	scripts/slurm/localcluster.sh status
