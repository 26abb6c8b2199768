#!/bin/bash
# The GPU checks of issue 32 in one call on a lent GPU machine (about 10 minutes on one H100;
# the first run, docs/measurements/2026-11-28-gpu.md, ran out of a 560 s limit in L7b async):
# tests/gpu, then save-and-load of GPT-4B and L7b (bf16), sync with the raw ceiling and async
# with training steps between saves, against SeaweedFS on loopback (.device/setup.sh; restarted
# empty before each L7b run: the disk holds about two runs' checkpoints). Each stage has a time
# limit; a limit ends a run with SIGINT, as Ctrl-C would, so its record still says what happened.
#
# Here first: bash ../shared/device/prepare.sh (builds the git-ignored .device/ this needs).
# There, from the project root, with .device carried: OUT=DIR bash scripts/gpu_check.sh [STAGE...]
# Stages (by default the "where the time goes" set, issue 45, in one 10-minute call: env
# gpt4b_time gpt4b_time_raised l7b_time): GPT-4B bf16 with every ceiling (ceiling=true: raw
# PUT/GET, storage into tensors, DCP alone on tmpfs) and the split, under glibc's defaults and
# with malloc=raised, then L7b likewise with malloc=raised. The issue-32 set stays available
# by name: env tests gpt4b_sync gpt4b_async l7b_sync l7b_async
# Output in OUT: env.txt, tests.log, runs.log, report.txt, records.tgz (the runs' JSON Lines),
# and server.log (the server's log tail after a failed run).
# GPU_CHECK_SETUP=0 skips .device/setup.sh (a dry run where dcp_fsdp and an S3 are already set up);
# GPU_CHECK_MID / GPU_CHECK_BIG replace GPT-4B / L7b there.
set -u
: "${OUT:?OUT must name the folder for the results}"
RESULTS=/tmp/gpu-check-results
MID=${GPU_CHECK_MID:-GPT-4B}
BIG=${GPU_CHECK_BIG:-L7b}
mkdir -p "$OUT" "$RESULTS"

fresh_s3() {
  if [ "${GPU_CHECK_SETUP:-1}" = 1 ]; then
    # shellcheck disable=SC1091
    . .device/setup.sh >>"$OUT/env.txt" 2>&1 || { echo "setup.sh failed: see env.txt"; return 1; }
  fi
}

stage_env() {
  fresh_s3 || return 1
  { date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nproc; free -g | head -2; df -h /tmp | tail -1
    python3 -c 'import torch, s3torchconnector, sys; print(sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "connector", s3torchconnector.__version__)'
  } >>"$OUT/env.txt" 2>&1
}

stage_tests() {
  [ -n "${AWS_ENDPOINT_URL:-}" ] || fresh_s3 || return 1
  # The gloo test watches nvidia-smi for any new CUDA process: it runs alone, after the others.
  timeout -k 20 -s INT 200 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider --durations=0 -n 3 \
    -k "not gloo_ranks" --timeout 180 >"$OUT/tests.log" 2>&1
  echo "tests (3 workers) rc=$?" >>"$OUT/tests.log"
  timeout -k 20 -s INT 90 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider \
    -k gloo_ranks --timeout 80 >>"$OUT/tests.log" 2>&1
  echo "tests (gloo) rc=$?" >>"$OUT/tests.log"
}

# run NAME LIMIT_S FRESH COMMAND SETTINGS...: one dcp-fsdp run (on an emptied server if FRESH
# is 1), its record kept.
run() {
  local name=$1 limit_s=$2 fresh=$3
  shift 3
  if [ "$fresh" = 1 ] || [ -z "${AWS_ENDPOINT_URL:-}" ]; then fresh_s3 || return 1; fi
  echo "== $name $(date -u +%T): dcp-fsdp $* (limit ${limit_s} s)" >>"$OUT/runs.log"
  timeout -k 30 -s INT "$limit_s" python3 -m dcp_fsdp "$@" "storage.uri=s3://bench/$name" \
    "results_dir=$RESULTS/$name" >>"$OUT/runs.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(date -u +%T)" >>"$OUT/runs.log"
  # the server's own log of a failed run, before a restart deletes it (S3D: setup.sh's)
  if [ "$rc" != 0 ] && [ -n "${S3D:-}" ]; then
    { echo "== $name: SeaweedFS log tail"; tail -n 60 "$S3D/weed.out"; } >>"$OUT/server.log" 2>&1
  fi
  tar czf "$OUT/records.tgz" -C "$RESULTS" . 2>/dev/null
  python3 -m dcp_fsdp report "$RESULTS" --wide >"$OUT/report.txt" 2>&1
  return "$rc"
}

TRAIN="train_step_s=0.05 async_save.steps_between_saves=20 async_save.train_step_work=memory"
stage_gpt4b_sync() { run gpt4b-sync 120 0 save-and-load "model=$MID" model.dtype=bf16 iterations=2 ceiling=true; }
stage_gpt4b_async() { run gpt4b-async 120 0 save-and-load "model=$MID" model.dtype=bf16 iterations=3 \
  save_mode=async $TRAIN; }
stage_l7b_sync() { run l7b-sync 150 1 save-and-load "model=$BIG" model.dtype=bf16 iterations=2; }
stage_l7b_async() { run l7b-async 150 1 save-and-load "model=$BIG" model.dtype=bf16 iterations=2 \
  save_mode=async $TRAIN; }

# where the time goes (issue 45): each with every ceiling; the end-of-run lines and report.txt
# carry the split, the fresh pages per byte and the efficiency against each ceiling
stage_gpt4b_time() { run gpt4b-time 170 1 save-and-load "model=$MID" model.dtype=bf16 iterations=2 \
  ceiling=true progress=false; }
stage_gpt4b_time_raised() { run gpt4b-time-raised 170 1 save-and-load "model=$MID" model.dtype=bf16 \
  iterations=2 ceiling=true malloc=raised progress=false; }
stage_l7b_time() { run l7b-time 230 1 save-and-load "model=$BIG" model.dtype=bf16 iterations=1 \
  ceiling=true malloc=raised progress=false; }

[ $# -gt 0 ] || set -- env gpt4b_time gpt4b_time_raised l7b_time
for stage in "$@"; do
  started_s=$SECONDS
  "stage_$stage"
  echo "stage $stage: rc=$? in $((SECONDS - started_s)) s" | tee -a "$OUT/env.txt"
done
if [ -f /tmp/weed.pid ]; then kill "$(cat /tmp/weed.pid)" 2>/dev/null; fi
