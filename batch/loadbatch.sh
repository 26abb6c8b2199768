#!/bin/bash
#SBATCH --job-name=loadbatch
#SBATCH --output=logs/%x-%j.out
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
# Warned 60 s before the time limit (-t): the step is stopped and the aftermath has time to run.
#SBATCH --signal=B:USR1@60
#
# Load a checkpoint written by savebatch.sh from every node of the allocation (`dcp-fsdp load`).
# Give the suffix from savebatch's log, and the same node count and ranks per node it had:
#
#   mkdir -p logs                      # sbatch does not create the --output directory
#   SUFFIX=$(grep -o 'SUFFIXES=[^ ]*' logs/savebatch-<jobid>.out | tail -1 | tr , '\n' | tail -1)
#   (the last suffix, as savebatch's "load with:" line suggests; it prints the whole command)
#   URI=s3://my-bucket/ckpt SUFFIX=$SUFFIX sbatch --nodes 8 batch/loadbatch.sh model=L7b
#
# One srun task per node runs torchrun (--nnodes = the job's node count, c10d rendezvous
# on the first node of the allocation); partition, account and time limit are sbatch flags.
# Arguments are Hydra overrides (they win over the environment). Settings (environment):
#   SUFFIX          the checkpoint to load (or the argument suffix=...)  [none: required]
#   URI             s3://bucket/prefix it was saved under (storage.uri)  [none: required on a cluster]
#   REGION          AWS region of the bucket (storage.region)    [AWS_REGION, else us-east-1]
#   MODEL           model preset it was saved with               [tiny_llama]
#   ITERATIONS      times to load it                             [1]
#   RESULTS_DIR     where the JSONL records go                   [results/ in the submit dir]
#   OVERRIDES       more Hydra overrides, space-separated        [none]
#   NPROC_PER_NODE  ranks per node                               [GPUs per node, or 1]
#   RDZV_PORT       rendezvous port on the first node            [29500 + job id % 2500]
#   PYTHON          interpreter with dcp_fsdp installed          [<repo>/.venv/bin/python, else python3]
#   SRUN_ARGS       extra srun options, space-separated          [none]
#   JOB_DIR         where the job makes its own .dcp-fsdp-job-<id>/ (all nodes reach it) [the job's cwd]
# Credentials: the standard AWS variables or the instance role (sbatch passes the environment).
set -euo pipefail
# sbatch runs a copy of this file from its spool directory: find batch/ from the submitted path.
BATCH_DIR=${BATCH_DIR:-$(dirname "$(scontrol show job -o "${SLURM_JOB_ID:-0}" 2>/dev/null | grep -o ' Command=[^ ]*' | cut -d= -f2- || true)")}
[[ -r $BATCH_DIR/common.sh ]] || BATCH_DIR=${SLURM_SUBMIT_DIR:-.}/batch
source "$BATCH_DIR/common.sh"

BATCH_NAME=loadbatch
given=${SUFFIX:-}
for arg in "$@"; do
    [[ $arg == suffix=* || $arg == +suffix=* || $arg == ++suffix=* ]] && given=${arg#*suffix=}
done
[[ -n $given ]] || batch_fail "no checkpoint suffix given: SUFFIX=<from savebatch's log (SUFFIXES=...)> sbatch batch/loadbatch.sh, or pass suffix=..."

batch_init loadbatch
collect_overrides "$@"
rc=0
run_torchrun load "${SETTINGS[@]}" || rc=$?
batch_finish "$rc"
