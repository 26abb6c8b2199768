#!/bin/bash
# Not a job script: the one srun task per node that batch/common.sh (run_torchrun) starts.
# It runs torch's elastic agent (torchrun's code, quiet: `python -m dcp_fsdp.launch.agent`)
# with this node's own directory in the job's directory (DCP_FSDP_JOB_DIR, on a file system
# every node reaches): torchrun's --log-dir (the ranks' error files; no torchelastic_* in
# /tmp), the agent's outcome (agent.json), and one line written here when the agent has
# ended, however it ended (agent-exit: its exit status, the time, the host), so the batch
# script's aftermath can name a node whose agent was killed. $1 = PYTHON, then the agent's
# arguments.
set -uo pipefail
python=$1
shift
node_dir=$DCP_FSDP_JOB_DIR/node-${SLURM_NODEID:-0}
mkdir -p "$node_dir"
hostname >"$node_dir/host"
export DCP_FSDP_AGENT_SUMMARY=$node_dir/agent.json
# torch makes $TMPDIR/torchinductor_$USER in every rank: in the job's directory it goes with it
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$node_dir/torchinductor}
# torch's C++ warnings (a rendezvous store gone with a killed node: a 25-line trace) only
# with DCP_FSDP_DEBUG=1; the aftermath names the cause in one line
[[ -n ${DCP_FSDP_DEBUG:-} ]] || export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
# -X frozen_modules=off: dcp_fsdp/launch/agent.py PYTHON_FLAGS says why (torch's rendezvous, ~0.3 CPU s)
"$python" -X frozen_modules=off -m dcp_fsdp.launch.agent --log-dir "$node_dir/torchelastic" "$@" &
pid=$!
# Slurm signals every process of the step (this one, the agent and the ranks) itself:
# nothing to pass on, only to keep waiting for the agent.
trap ':' TERM INT
rc=0
wait "$pid" || rc=$?
while kill -0 "$pid" 2>/dev/null; do
    rc=0
    wait "$pid" || rc=$?
done
echo "$rc $(date +%s) $(hostname)" >"$node_dir/agent-exit"
exit "$rc"
