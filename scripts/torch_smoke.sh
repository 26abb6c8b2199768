#!/usr/bin/env bash
# The smoke run on one torch release, in a venv of its own (.venv-torch-VERSION, kept for
# the next run): sync, async thread and async process save-and-load, a resharded load and a
# report (scripts/torch_smoke.py). Exits non-zero on any failure.
#   scripts/torch_smoke.sh 2.15.0      (PyPI's build: a CUDA one on Linux, ~3 GB; runs on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/torch_smoke.sh TORCH_VERSION (e.g. 2.11.0)}
PYTHON=${PYTHON:-python3}
VENV=.venv-torch-$VERSION
STAMP=$VENV/.installed
started=$(date +%s)
if [[ ! -f $STAMP || pyproject.toml -nt $STAMP || constraints.txt -nt $STAMP ]]; then
    test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==$VERSION"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
    touch "$STAMP"
fi
installed=$(date +%s)
echo "torch-smoke: torch $VERSION: venv ready in $((installed - started)) s"
"$VENV/bin/python" scripts/torch_smoke.py
echo "torch-smoke: torch $VERSION: smoke took $(($(date +%s) - installed)) s"
