#!/bin/bash
#SBATCH --job-name=waitbatch
#SBATCH --output=logs/%x-%j.out
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#
# Keep-alive: hold every node of the allocation doing nothing (`dcp-fsdp wait`), e.g. to
# keep a dynamic cluster's nodes up between benchmark jobs. Exits 0 when the time is up,
# or at once on scancel / the time limit (SIGTERM):
#
#   mkdir -p logs                      # sbatch does not create the --output directory
#   DURATION=30m sbatch --nodes 8 batch/waitbatch.sh
#   scancel <jobid>                    # ends it cleanly
#
# Arguments go to `dcp-fsdp wait` (--duration 1h30m, --heartbeat 5m).
# Settings (environment):
#   DURATION   how long to hold, with a unit: 90s, 2m, 1h30m, 1.5h, forever   [2m]
#   HEARTBEAT  interval of the "alive" log line, with a unit; 0 for none       [1m]
#   PYTHON     interpreter with dcp_fsdp installed      [<repo>/.venv/bin/python, else python3]
#   SRUN_ARGS  extra srun options, space-separated      [none]
set -euo pipefail
# sbatch runs a copy of this file from its spool directory: find batch/ from the submitted path.
BATCH_DIR=${BATCH_DIR:-$(dirname "$(scontrol show job -o "${SLURM_JOB_ID:-0}" 2>/dev/null | grep -o ' Command=[^ ]*' | cut -d= -f2- || true)")}
[[ -r $BATCH_DIR/common.sh ]] || BATCH_DIR=${SLURM_SUBMIT_DIR:-.}/batch
source "$BATCH_DIR/common.sh"

batch_init waitbatch
options=(--duration "${DURATION:-2m}")
[[ -n ${HEARTBEAT:-} ]] && options+=(--heartbeat "$HEARTBEAT")
rc=0
run_per_node "$PYTHON" -m dcp_fsdp wait "${options[@]}" "$@" || rc=$?
batch_finish "$rc"
