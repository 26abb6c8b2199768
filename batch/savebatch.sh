#!/bin/bash
#SBATCH --job-name=savebatch
#SBATCH --output=logs/%x-%j.out
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
# Warned 60 s before the time limit (-t): the step is stopped and the aftermath has time to run.
#SBATCH --signal=B:USR1@60
#
# Save checkpoints of an FSDP-sharded model to S3 from every node of the allocation
# (`dcp-fsdp save`), and end the log with the suffixes written:
#
#   mkdir -p logs                      # sbatch does not create the --output directory
#   URI=s3://my-bucket/ckpt REGION=us-east-2 sbatch --nodes 8 batch/savebatch.sh model=L7b iterations=3
#   grep -o 'SUFFIXES=[^ ]*' logs/savebatch-<jobid>.out | tail -1
#
# One srun task per node runs torchrun (--nnodes = the job's node count, c10d rendezvous
# on the first node of the allocation); partition, account and time limit are sbatch flags.
# Arguments are Hydra overrides (they win over the environment). Settings (environment):
#   URI             s3://bucket/prefix (storage.uri)             [none: required on a cluster]
#   REGION          AWS region of the bucket (storage.region)    [AWS_REGION, else us-east-1]
#   MODEL           model preset: tiny_llama, tiny_gpt2, L7b, L13b, L30b, L65b, L70b [tiny_llama]
#   ITERATIONS      checkpoints to save                          [1]
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

batch_init savebatch
collect_overrides "$@"
rc=0
run_torchrun save "${SETTINGS[@]}" || rc=$?
# The library prints "[dcp-fsdp] SUFFIXES=..." after a save; repeat it as the log's last word.
log=$(job_log)
suffixes=
[[ -n $log ]] && suffixes=$(grep -ao 'SUFFIXES=[^[:space:]]*' "$log" | tail -n 1 | cut -d= -f2- || true)
if [[ -n $suffixes ]]; then
    echo "[savebatch] load with: $(load_command "$suffixes" "$@")"
fi
batch_finish "$rc" "SUFFIXES=${suffixes}"
