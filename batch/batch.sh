#!/bin/bash
#SBATCH --job-name=batch
#SBATCH --output=logs/%x-%j.out
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
# Warned 60 s before the time limit (-t): the step is stopped and the aftermath has time to run.
#SBATCH --signal=B:USR1@60
#
# The stress job: ITERATIONS x (save, load, bit-exact check) from every node of the
# allocation (`dcp-fsdp save-and-load`). Run it at several node counts, then tabulate:
#
#   mkdir -p logs                      # sbatch does not create the --output directory
#   for n in 1 2 4 8; do URI=s3://my-bucket/ckpt ITERATIONS=5 sbatch --nodes $n batch/batch.sh model=L7b; done
#   dcp-fsdp report results/           # one row per node count
#
# One srun task per node runs torchrun (--nnodes = the job's node count, c10d rendezvous
# on the first node of the allocation); partition, account and time limit are sbatch flags.
# Arguments are Hydra overrides (they win over the environment). Settings (environment):
#   URI             s3://bucket/prefix (storage.uri)             [none: required on a cluster]
#   REGION          AWS region of the bucket (storage.region)    [AWS_REGION, else us-east-1]
#   MODEL           model preset: tiny_llama, tiny_gpt2, L7b, L13b, L30b, L65b, L70b [tiny_llama]
#   ITERATIONS      save/load/check rounds                       [1]
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

batch_init batch
collect_overrides "$@"
rc=0
run_torchrun save-and-load "${SETTINGS[@]}" || rc=$?
batch_finish "$rc"
