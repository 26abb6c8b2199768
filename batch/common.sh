# Sourced by batch/*.sh (not a job script): settings, the torchrun command line, and one
# srun task per node. Everything here can be set from the environment of `sbatch`
# (sbatch passes its environment to the job); each script's header lists what it reads.
#
# Common settings (environment; default in brackets):
#   PYTHON          interpreter with dcp_fsdp and torch installed
#                   [<repo>/.venv/bin/python when present, else python3 on PATH]
#   URI             storage.uri, s3://bucket/prefix     [library: none; required for S3 runs]
#   REGION          storage.region                      [library: AWS_REGION, else us-east-1]
#   MODEL           model preset: tiny_llama, L7b, ...  [library: tiny_llama]
#   ITERATIONS      iterations                          [library: 1]
#   RESULTS_DIR     results_dir, records (JSONL) land here [library: results/ in the job's cwd]
#   OVERRIDES       more Hydra overrides, space-separated, e.g. "storage.thread_count=4 state=model_and_optimizer"
#   NPROC_PER_NODE  ranks per node                      [GPUs per node, 1 without GPUs]
#   RDZV_PORT       c10d rendezvous port on the first node [29500 + job id % 2500]
#   SRUN_ARGS       extra srun options, space-separated [none]
#   JOB_DIR         where the job makes its own .dcp-fsdp-job-<id>/ (all nodes reach it) [the job's cwd]
# Arguments given to the script (`sbatch batch/savebatch.sh model=L13b iterations=10`) are
# Hydra overrides placed after those from the environment, so they win.
# Credentials and endpoints: the standard AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
# AWS_SESSION_TOKEN, AWS_PROFILE, AWS_ENDPOINT_URL, AWS_REGION) or the instance role.

BATCH_STARTED=$SECONDS

batch_fail() {  # one clear line on stderr (the job's log), then exit 2
    echo "$BATCH_NAME: error: $*" >&2
    exit 2
}

# $1 = script name (savebatch, ...). Checks that we are inside a Slurm job, picks PYTHON.
batch_init() {
    BATCH_NAME=$1
    [[ -n ${SLURM_JOB_ID:-} && -n ${SLURM_JOB_NODELIST:-} ]] ||
        batch_fail "not inside a Slurm job; submit it: sbatch --nodes 2 batch/$BATCH_NAME.sh"
    local repo
    repo=$(cd "$BATCH_DIR/.." && pwd)
    if [[ -z ${PYTHON:-} ]]; then
        if [[ -x $repo/.venv/bin/python ]]; then
            PYTHON=$repo/.venv/bin/python
        else
            PYTHON=$(command -v python3 || command -v python || true)
        fi
    fi
    [[ -n $PYTHON && -x $(command -v "$PYTHON" 2>/dev/null) ]] ||
        batch_fail "PYTHON=${PYTHON:-}: no Python interpreter found; set PYTHON to one with dcp_fsdp installed"
    NODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    echo "[$BATCH_NAME] job $SLURM_JOB_ID ($SLURM_JOB_NAME): $NODES node(s) $SLURM_JOB_NODELIST," \
         "batch host $(hostname), python $PYTHON, started $(date -u +%FT%TZ)"
}

# Hydra overrides from the environment, then OVERRIDES, then the script's arguments ("$@"):
# fills the array SETTINGS.
collect_overrides() {
    SETTINGS=()
    [[ -n ${URI:-} ]] && SETTINGS+=("storage.uri=$URI")
    [[ -n ${REGION:-} ]] && SETTINGS+=("storage.region=$REGION")
    [[ -n ${MODEL:-} ]] && SETTINGS+=("model=$MODEL")
    [[ -n ${ITERATIONS:-} ]] && SETTINGS+=("iterations=$ITERATIONS")
    [[ -n ${SUFFIX:-} ]] && SETTINGS+=("suffix=$SUFFIX")
    [[ -n ${RESULTS_DIR:-} ]] && SETTINGS+=("results_dir=$RESULTS_DIR")
    local extra
    # shellcheck disable=SC2206  # OVERRIDES is a space-separated list by design
    extra=(${OVERRIDES:-})
    SETTINGS+=("${extra[@]}" "$@")
    return 0
}

gpus_per_node() {
    if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
        echo "$SLURM_GPUS_ON_NODE"
        return
    fi
    local count=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
    if ((count > 0)); then echo "$count"; else echo 1; fi
}

# srun one task per node running "$@"; SIGTERM/SIGINT to this script (scancel, the time
# limit) and SIGUSR1 (the time limit is near: #SBATCH --signal=B:USR1@60) go to the step as
# SIGTERM, and the script still logs how the step ended. The signal that came is left in
# BATCH_SIGNAL; srun's own lines also go to $JOB_DIR/srun.err when there is a JOB_DIR.
# Returns the step's status.
run_per_node() {
    local srun_args pid rc=0
    # shellcheck disable=SC2206
    srun_args=(${SRUN_ARGS:-})
    echo "[$BATCH_NAME] srun on $NODES node(s): $*"
    if [[ -n ${JOB_DIR:-} ]]; then
        srun --nodes "$NODES" --ntasks "$NODES" --ntasks-per-node 1 --kill-on-bad-exit=1 \
            "${srun_args[@]}" "$@" 2> >(tee -a "$JOB_DIR/srun.err" >&2) &
    else
        srun --nodes "$NODES" --ntasks "$NODES" --ntasks-per-node 1 --kill-on-bad-exit=1 \
            "${srun_args[@]}" "$@" &
    fi
    pid=$!
    BATCH_SIGNAL=
    trap 'on_signal SIGTERM "$pid"' TERM
    trap 'on_signal SIGINT "$pid"' INT
    trap 'on_signal SIGUSR1 "$pid"' USR1
    wait "$pid" || rc=$?
    while kill -0 "$pid" 2>/dev/null; do  # a trapped signal interrupted wait
        rc=0
        wait "$pid" || rc=$?
    done
    # What follows (the aftermath) must finish: Slurm's SIGKILL comes KillWait s after its SIGTERM.
    trap '' TERM INT USR1
    return "$rc"
}

on_signal() {  # $1 = signal name, $2 = srun's pid
    [[ -n $BATCH_SIGNAL ]] && return 0  # the step has been told already
    BATCH_SIGNAL=$1
    case $1 in
        SIGUSR1) echo "[$BATCH_NAME] the job's time limit is near (SIGUSR1 from Slurm): stopping the job step" ;;
        *) echo "[$BATCH_NAME] $1: stopping the job step" ;;
    esac
    kill -TERM "$2" 2>/dev/null || true
}

# The job's own directory (.dcp-fsdp-job-<id> in JOB_DIR, which every node must reach; the
# job's working directory by default), the run id every rank records under and the file where
# rank 0 notes the suffix a save is writing: what the aftermath after the step reads. Only
# that directory of the job's own is removed at the end, never JOB_DIR itself.
job_dir_init() {  # $1 = dcp-fsdp command
    local base=${JOB_DIR:-$PWD}
    [[ -d $base && -w $base ]] || batch_fail "JOB_DIR=$base: not a writable directory; give one every node can reach"
    JOB_DIR=$(cd "$base" && pwd)/.dcp-fsdp-job-$SLURM_JOB_ID
    mkdir -p "$JOB_DIR" || batch_fail "cannot create $JOB_DIR; set JOB_DIR to a directory every node can reach"
    export DCP_FSDP_JOB_DIR=$JOB_DIR
    # a fresh one per job (one exported in the submitting shell would make two jobs one run)
    export DCP_FSDP_RUN_ID
    DCP_FSDP_RUN_ID=$(date +%Y%m%d-%H%M%S)-$1-$(printf '%06x' $(((RANDOM << 15 | RANDOM) & 0xffffff)))
    export DCP_FSDP_WRITING_SUFFIX_FILE=$JOB_DIR/writing-suffix
}

# torchrun on every node: --nnodes = the job's node count, c10d rendezvous on the first node.
# $1 = dcp-fsdp command; the rest are its Hydra overrides. Each node's task is
# batch/node_task.sh (torch's agent, quiet, with its log directory in JOB_DIR); after the
# step, the aftermath (python -m dcp_fsdp.launch.after_job) writes or amends the record
# with the first cause, aborts the open uploads of a partial checkpoint and says so.
# Returns the exit code of the docs' table (docs/reliability.md, "How a run ends").
run_torchrun() {
    local first port nproc command=$1 rc=0
    first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    [[ -n $first ]] || batch_fail "cannot list the hosts of $SLURM_JOB_NODELIST (scontrol show hostnames)"
    port=${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 2500))}
    nproc=${NPROC_PER_NODE:-$(gpus_per_node)}
    job_dir_init "$command"
    run_per_node bash "$BATCH_DIR/node_task.sh" "$PYTHON" \
        --nnodes "$NODES" --nproc-per-node "$nproc" \
        --rdzv-backend c10d --rdzv-endpoint "$first:$port" --rdzv-id "$SLURM_JOB_ID" \
        -m dcp_fsdp "$@" || rc=$?
    local after=0
    "$PYTHON" -m dcp_fsdp.launch.after_job --job-dir "$JOB_DIR" --step-exit "$rc" \
        ${BATCH_SIGNAL:+--signal "$BATCH_SIGNAL"} --world-size $((NODES * nproc)) -- \
        "$@" || after=$?
    case $after in
        0 | 1 | 2 | 130) rc=$after ;;
        *) if [[ -n $BATCH_SIGNAL ]]; then rc=130; elif ((rc != 0)); then rc=1; fi ;;
    esac
    rm -rf "$JOB_DIR"
    return "$rc"
}

# The end of every job's log: how it ended (exit status and wall time), then $2 if given
# (savebatch: the SUFFIXES= line, kept last so `tail -1` finds it).
batch_finish() {  # $1 = exit status, $2 = optional last line
    echo "[$BATCH_NAME] job $SLURM_JOB_ID on $NODES node(s): exit $1 after $((SECONDS - BATCH_STARTED)) s"
    [[ -z ${2:-} ]] || echo "$2"
    exit "$1"
}

# This job's log file (what #SBATCH --output opened), when stdout is a file.
job_log() {
    local path
    path=$(readlink -f "/proc/$$/fd/1" 2>/dev/null || true)
    [[ -f $path ]] && echo "$path"
    return 0
}

# The command that loads what a save wrote: the last suffix, with the same URI, REGION, MODEL,
# OVERRIDES and override arguments ("$@" of the save, minus iterations= and suffix=, which
# mean other things to a load), quoted for the shell. $1 = the save's SUFFIXES (a, b, ...).
load_command() {
    local suffixes=$1 arg
    shift
    local words=("SUFFIX=${suffixes##*,}")
    [[ -n ${URI:-} ]] && words+=("URI=$URI")
    [[ -n ${REGION:-} ]] && words+=("REGION=$REGION")
    [[ -n ${MODEL:-} ]] && words+=("MODEL=$MODEL")
    [[ -n ${OVERRIDES:-} ]] && words+=("OVERRIDES=$OVERRIDES")
    words+=(sbatch --nodes "$NODES" batch/loadbatch.sh)
    for arg in "$@"; do
        [[ $arg == iterations=* || $arg == *suffix=* ]] || words+=("$arg")
    done
    printf '%q ' "${words[@]}" | sed 's/ $//'
}
