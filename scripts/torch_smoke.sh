#!/usr/bin/env bash
# The smoke run on one torch release, in a venv of its own (.venv-torch-VERSION, kept for
# the next run): sync, async thread and async process save-and-load, a resharded load and a
# report (scripts/torch_smoke.py). Exits non-zero on any failure.
#   scripts/torch_smoke.sh 2.15.0      (PyPI's build: a CUDA one on Linux, ~3 GB; runs on CPU)
#   scripts/torch_smoke.sh 2.15.0 --install-only   (the venv alone: .ci/run builds the venvs
#                                                   while the tests run, then smokes them)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/torch_smoke.sh TORCH_VERSION [--install-only] (e.g. 2.11.0)}
INSTALL_ONLY=${2:-}
PYTHON=${PYTHON:-python3}
VENV=.venv-torch-$VERSION
STAMP=$VENV/.installed
started=$(date +%s)
# The matrix asks for exact releases on purpose, so a machine-wide pip cap (a constraint in
# /etc/pip.conf or /etc/xdg/pip, as some CI hosts set: torch<=2.14.1) must not apply to these
# venvs: PIP_CONFIG_FILE=/dev/null makes pip read no config file at all, and PIP_CONSTRAINT is
# emptied for the same reason. Works the same where there is no cap. The project's own
# constraints.txt still applies to the second install.
export PIP_CONFIG_FILE=/dev/null PIP_CONSTRAINT=
if [[ ! -f $STAMP || pyproject.toml -nt $STAMP || constraints.txt -nt $STAMP ]]; then
    test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
    # uv (the project venv's, from make setup) where there is one: it installs PyPI's CUDA
    # build (~3 GB) with a fraction of pip's CPU, which .ci/run shares with the tests; it reads
    # no pip config, so no cap applies to it either. The package alone (no test or lint
    # extras: the smoke runs no pytest, moto or mypy) and nothing byte-compiled at install:
    # the smoke writes .pyc files for what it imports (below), about a sixth of the venv's
    # 16,000 modules, where compiling them all cost more CPU than the smoke itself.
    if [[ -x .venv/bin/uv ]]; then
        # TMPDIR in the venv: uv leaves an empty uv-setuptools-<hash>.lock per editable build
        mkdir -p "$VENV/.uv-tmp"
        install=(env TMPDIR="$PWD/$VENV/.uv-tmp" .venv/bin/uv pip install --python "$VENV/bin/python" --quiet)
    else
        install=("$VENV/bin/pip" install --quiet --disable-pip-version-check --no-compile)
    fi
    "${install[@]}" "torch==$VERSION"
    # torch named again: without it the resolver may replace the release under test with
    # another that fits the project's constraints better (pip once put 2.15.0 in the 2.11.0
    # venv, through a setuptools pin torch 2.11 refuses), and the matrix would test one torch
    # twice
    "${install[@]}" -c constraints.txt "torch==$VERSION" -e .
    touch "$STAMP"
fi
installed=$(date +%s)
echo "torch-smoke: torch $VERSION: venv ready in $((installed - started)) s"
[[ $INSTALL_ONLY == --install-only ]] && exit 0
# .pyc files written as modules are first imported: where PYTHONDONTWRITEBYTECODE=1 (this
# project's machines set it) and nothing was compiled, every rank of every run compiled torch
# again (the smoke took 213 s instead of 84 s, 2026-11-27).
PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" scripts/torch_smoke.py "$VERSION"
echo "torch-smoke: torch $VERSION: smoke took $(($(date +%s) - installed)) s"
