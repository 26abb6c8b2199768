#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for trying batch/*.sh and for tests.
#
#   scripts/slurm/localcluster.sh up       install (when missing), configure and start it
#   scripts/slurm/localcluster.sh status   daemons, nodes, queue
#   scripts/slurm/localcluster.sh down     stop everything it started, remove its network
#
# What `up` builds (as root; `make slurm-up` runs it):
#   * Debian's slurm-wlm and munge, installed with apt-get when missing.
#   * A bridge ($NAME-br, SUBNET.1/24) and, for each of NODES emulated nodes, a network
#     namespace ($NAME-n1, ...) joined to the bridge by a veth pair (address SUBNET.1<i>),
#     with its own hostname (unshare --uts: node1, node2, ...) and /etc/hosts (a bind mount
#     seen only in that namespace). The namespaces have no default route: they reach the
#     bridge subnet and nothing else.
#   * munged (as user munge) on its own socket and key, slurmctld on SUBNET.1 in this
#     namespace, one slurmd per node namespace (proctrack/linuxproc, task/none, no cgroups).
#   * A SeaweedFS S3 server (the project's embedded one) bound to SUBNET.1 so every node can
#     reach it; its endpoint, keys and a URI go to $DIR/env (with SLURM_CONF). A TaskProlog
#     gives them to every job that brings no S3 settings of its own (no URI, AWS_ENDPOINT_URL
#     or AWS_ACCESS_KEY_ID), so `sbatch --nodes 2 batch/savebatch.sh` needs no settings here.
#
# All state, configuration and logs live under DIR (default /var/tmp/dcp-fsdp-slurm).
# The one file written outside it: /etc/slurm/slurm.conf, a symlink to DIR/etc/slurm.conf,
# created only when no slurm.conf exists there (so plain `sbatch` works) and removed by `down`.
#
# Settings (environment):
#   DCP_SLURM_DIR    state directory                    (/var/tmp/dcp-fsdp-slurm)
#   DCP_SLURM_NAME   prefix of namespaces/interfaces    (dcpslurm; at most 8 characters)
#   DCP_SLURM_NODES  emulated nodes                     (2)
#   DCP_SLURM_SUBNET first three octets of the /24 created on the bridge, or "auto" for the
#                    first free 10.213.X.0/24           (10.213.77)
#   DCP_SLURM_CTLD_PORT / DCP_SLURM_SLURMD_PORT         (6917 / 6918; not Slurm's defaults)
#   DCP_SLURM_CPUS   CPUs per node                      (this machine's, nproc)
#   DCP_SLURM_S3     1: start the S3 server, 0: don't   (1)
#   DCP_SLURM_LINK_ETC  1: link /etc/slurm/slurm.conf when absent, 0: never (1)
#   PYTHON           interpreter with dcp_fsdp installed (REPO/.venv/bin/python)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DIR=${DCP_SLURM_DIR:-/var/tmp/dcp-fsdp-slurm}
STATE_FILE=$DIR/cluster.env
# A cluster that is up keeps the settings it was started with (down/status read them).
if [[ -r $STATE_FILE ]]; then
    # shellcheck source=/dev/null
    source "$STATE_FILE"
fi
NAME=${CLUSTER_NAME:-${DCP_SLURM_NAME:-dcpslurm}}
NODES=${CLUSTER_NODES:-${DCP_SLURM_NODES:-2}}
SUBNET=${CLUSTER_SUBNET:-${DCP_SLURM_SUBNET:-10.213.77}}
CTLD_PORT=${CLUSTER_CTLD_PORT:-${DCP_SLURM_CTLD_PORT:-6917}}
SLURMD_PORT=${CLUSTER_SLURMD_PORT:-${DCP_SLURM_SLURMD_PORT:-6918}}
CPUS=${DCP_SLURM_CPUS:-$(nproc)}
WITH_S3=${DCP_SLURM_S3:-1}
LINK_ETC=${DCP_SLURM_LINK_ETC:-1}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}

CONF=$DIR/etc/slurm.conf
HOSTS=$DIR/etc/hosts
MUNGE_DIR=$DIR/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
ENV_FILE=$DIR/env
S3_TMP=$DIR/s3tmp
TASK_PROLOG=$DIR/etc/task-prolog.sh
BRIDGE=$NAME-br
ETC_CONF=/etc/slurm/slurm.conf

say() { echo "localcluster: $*"; }
die() { echo "localcluster: error: $*" >&2; exit 1; }

ns_name() { echo "$NAME-n$1"; }
node_name() { echo "node$1"; }
node_addr() { echo "$SUBNET.$((10 + $1))"; }
ctld_addr() { echo "$SUBNET.1"; }
ctld_name() { echo "$NAME-ctl"; }

need_root() {
    [[ $(id -u) == 0 ]] || die "run as root (network namespaces, munge and slurmd need it): sudo $0 $*"
}

check_settings() {
    [[ $NAME =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "DCP_SLURM_NAME=$NAME: 1-8 lowercase letters/digits, starting with a letter"
    [[ $NODES =~ ^[1-9][0-9]?$ ]] || die "DCP_SLURM_NODES=$NODES: give 1 to 99 nodes"
    [[ $SUBNET == auto || $SUBNET =~ ^(10\.[0-9]+\.[0-9]+|172\.(1[6-9]|2[0-9]|3[01])\.[0-9]+|192\.168\.[0-9]+)$ ]] ||
        die "DCP_SLURM_SUBNET=$SUBNET: give the first three octets of a private /24 (e.g. 10.213.77) or auto"
}

ensure_packages() {
    local missing=()
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null ||
        missing+=(slurm-wlm)
    command -v munged >/dev/null || missing+=(munge)
    command -v ip >/dev/null || missing+=(iproute2)
    command -v unshare >/dev/null && command -v flock >/dev/null || missing+=(util-linux)
    if ((${#missing[@]})); then
        command -v apt-get >/dev/null || die "missing ${missing[*]}; install them (Debian/Ubuntu: apt-get install ${missing[*]})"
        say "installing ${missing[*]} with apt-get"
        # Keep the packages' own services (a system munged, slurmctld, slurmd) from starting:
        # this cluster runs its own, and 'down' must leave nothing running.
        local policy=/usr/sbin/policy-rc.d made_policy=0
        if [[ ! -e $policy ]]; then
            printf '#!/bin/sh\n# localcluster.sh: no service starts during apt-get install\nexit 101\n' >"$policy"
            chmod 0755 "$policy"
            made_policy=1
        fi
        local status=0
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            "${missing[@]}" >/dev/null || status=$?
        ((made_policy)) && rm -f "$policy"
        ((status == 0)) || die "apt-get install ${missing[*]} failed (exit $status)"
    fi
    id munge >/dev/null 2>&1 || die "user munge is missing (it comes with the munge package)"
    [[ -x $PYTHON ]] || die "PYTHON=$PYTHON: no interpreter there; run 'make setup' first or set PYTHON"
}

subnet_in_use() {  # $1 = a.b.c: any address or route of this machine in a.b.c.0/24?
    ip -4 -o addr show | awk '{print $4}' | grep -q "^${1//./\\.}\." && return 0
    ip -4 route show | awk '{print $1}' | grep -q "^${1//./\\.}\." && return 0
    return 1
}

choose_subnet() {
    if [[ $SUBNET == auto ]]; then
        local third
        for third in $(seq 77 254); do
            if ! subnet_in_use "10.213.$third"; then SUBNET=10.213.$third; return; fi
        done
        die "no free 10.213.X.0/24 found; set DCP_SLURM_SUBNET"
    fi
    ! subnet_in_use "$SUBNET" || die "$SUBNET.0/24 is already used on this machine; set DCP_SLURM_SUBNET to a free private /24 (or auto)"
}

pid_alive() {  # $1 = pid file, $2 = expected command name
    local pid
    [[ -r $1 ]] && pid=$(<"$1") && [[ $pid =~ ^[0-9]+$ ]] && [[ -r /proc/$pid/comm ]] &&
        [[ $(</proc/"$pid"/comm) == "$2"* ]]
}

# TERM the processes that "$@" lists (a command printing pids), wait up to $2 s for them
# to go, then KILL what is left. $1 = label for the log.
stop_listed() {
    local label=$1 wait_s=$2 pids tries
    shift 2
    pids=$("$@")
    [[ -n $pids ]] || return 0
    kill -TERM $pids 2>/dev/null || true
    for tries in $(seq $((wait_s * 5))); do
        pids=$("$@")
        [[ -z $pids ]] && return 0
        sleep 0.2
    done
    say "$label did not stop on SIGTERM: killing $(echo $pids)"
    kill -KILL $pids 2>/dev/null || true
}

pid_if_running() { [[ -e /proc/$1 ]] && echo "$1"; return 0; }
ns_pids() { ip netns pids "$1" 2>/dev/null || true; }

stop_pid_file() {  # $1 = pid file, $2 = expected command name, $3 = label
    if pid_alive "$1" "$2"; then
        local pid
        pid=$(<"$1")
        stop_listed "$3 (pid $pid)" 20 pid_if_running "$pid"
    fi
    rm -f "$1"
}

write_config() {
    mkdir -p "$DIR"/{etc,state,spool,log,run}
    {
        echo "127.0.0.1 localhost"
        echo "::1 localhost ip6-localhost ip6-loopback"
        echo "$(ctld_addr) $(ctld_name)"
        for i in $(seq "$NODES"); do echo "$(node_addr "$i") $(node_name "$i")"; done
    } >"$HOSTS"
    local nodes="node[1-$NODES]"
    ((NODES == 1)) && nodes=node1
    cat >"$CONF" <<EOF
# Written by scripts/slurm/localcluster.sh (dcp_fsdp local test cluster); 'down' removes it.
ClusterName=$NAME
SlurmctldHost=$(ctld_name)($(ctld_addr))
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
# Bind the controller to the bridge address only (slurmd listens inside its namespace).
CommunicationParameters=NoCtldInAddrAny
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
# Gives jobs that bring no S3 settings of their own this cluster's S3 server (see task-prolog.sh).
TaskProlog=$TASK_PROLOG
# scancel: SIGTERM, then SIGKILL after KillWait seconds (30: Slurm's default; the batch
# scripts' aftermath runs in it). Finished jobs stay visible to
# 'scontrol show job' for MinJobAge seconds (there is no accounting database here).
KillWait=30
MinJobAge=3600
InactiveLimit=0
SlurmdTimeout=60
MessageTimeout=20
EOF
    for i in $(seq "$NODES"); do
        echo "NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") NodeHostname=$(node_name "$i") CPUs=$CPUS State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=local Nodes=$nodes Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
    # Slurm runs this before every task (the batch script's too) and applies the 'export'
    # lines it prints. It adds the local S3 server's endpoint and keys only to jobs that
    # bring none of their own (no AWS_ENDPOINT_URL or AWS_ACCESS_KEY_ID), and its URI only to
    # jobs without one, so that 'sbatch batch/savebatch.sh' works here as it does on a
    # cluster with an instance role, and so does the 'load with:' line it prints (URI=...).
    cat >"$TASK_PROLOG" <<EOF
#!/bin/sh
# Written by scripts/slurm/localcluster.sh: default S3 settings for jobs on the local test cluster.
if [ -z "\${AWS_ENDPOINT_URL:-}" ] && [ -z "\${AWS_ACCESS_KEY_ID:-}" ] && [ -r "$DIR/s3.env" ]; then
    if [ -n "\${URI:-}" ]; then grep -v '^export URI=' "$DIR/s3.env"; else cat "$DIR/s3.env"; fi
fi
exit 0
EOF
    chmod 0755 "$TASK_PROLOG"
}

start_munge() {
    mkdir -p "$MUNGE_DIR"
    chown munge:munge "$MUNGE_DIR"
    chmod 0755 "$MUNGE_DIR"
    if [[ ! -s $MUNGE_DIR/munge.key ]]; then
        (umask 077 && dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none)
    fi
    chown munge:munge "$MUNGE_DIR/munge.key"
    chmod 0400 "$MUNGE_DIR/munge.key"
    runuser -u munge -- munged --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCKET" \
        --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed" ||
        die "munged did not start; see $MUNGE_DIR/munged.log"
    munge -s dcp -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET" >/dev/null ||
        die "munge does not round-trip a credential on $MUNGE_SOCKET"
}

start_network() {
    ip link add "$BRIDGE" type bridge
    ip addr add "$(ctld_addr)/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for i in $(seq "$NODES"); do
        local ns host_if peer_if
        ns=$(ns_name "$i") host_if=$NAME-v$i peer_if=$NAME-p$i
        ip netns add "$ns"
        ip link add "$host_if" type veth peer name "$peer_if"
        ip link set "$peer_if" netns "$ns"
        ip link set "$host_if" master "$BRIDGE" up
        ip -n "$ns" link set "$peer_if" name eth0
        ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done
}

start_slurm() {
    # The controller stays in this network namespace but gets its own hostname, resolving to
    # the bridge address, so that NoCtldInAddrAny binds it there (this machine's own name
    # may resolve to 127.0.0.1, which the nodes cannot reach).
    unshare --uts --mount --propagation private \
        /bin/sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && SLURM_CONF="$3" exec slurmctld -f "$3" -c' \
        sh "$HOSTS" "$(ctld_name)" "$CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    for i in $(seq "$NODES"); do
        # In the node's network namespace, with its own hostname and /etc/hosts (bind-mounted
        # in a private mount namespace: the machine's /etc/hosts is untouched).
        # nsenter, not 'ip netns exec': that remounts /sys and hides /sys/fs/cgroup from slurmd.
        mkdir -p "$DIR/spool/$(node_name "$i")"
        nsenter --net="/run/netns/$(ns_name "$i")" unshare --uts --mount --propagation private \
            /bin/sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && SLURM_CONF="$3" exec slurmd -f "$3" -N "$2"' \
            sh "$HOSTS" "$(node_name "$i")" "$CONF" ||
            die "slurmd on $(node_name "$i") did not start; see $DIR/log/slurmd-$(node_name "$i").log"
    done
    local deadline=$((SECONDS + 60)) states
    while :; do
        states=$(SLURM_CONF=$CONF sinfo -h -N -o '%T' 2>/dev/null | sort | uniq -c | xargs || true)
        [[ $states == "$NODES idle" ]] && break
        ((SECONDS < deadline)) || die "nodes not idle after 60 s (sinfo: ${states:-no answer}); see $DIR/log/"
        sleep 0.5
    done
}

start_s3() {
    rm -f "$DIR/s3.env"
    rm -rf "$S3_TMP" && mkdir -p "$S3_TMP"
    # TMPDIR: SeaweedFS's data, logs and sockets stay under DIR, so 'down' can remove them.
    TMPDIR=$S3_TMP setsid "$PYTHON" "$REPO/scripts/slurm/s3server.py" --host "$(ctld_addr)" \
        --env-file "$DIR/s3.env" --pid-file "$DIR/run/s3server.pid" \
        >"$DIR/log/s3server.log" 2>&1 </dev/null &
    local pid=$! deadline=$((SECONDS + 90))
    until [[ -s $DIR/s3.env ]]; do
        kill -0 "$pid" 2>/dev/null || die "the S3 server exited; see $DIR/log/s3server.log"
        ((SECONDS < deadline)) || die "the S3 server did not answer in 90 s; see $DIR/log/s3server.log"
        sleep 0.3
    done
}

link_etc() {
    if [[ $LINK_ETC != 1 ]]; then return; fi
    if [[ -L $ETC_CONF && $(readlink "$ETC_CONF") == "$CONF" ]]; then return; fi
    if [[ -e $ETC_CONF || -L $ETC_CONF ]]; then
        say "note: $ETC_CONF exists and is not this cluster's: export SLURM_CONF=$CONF (or source $ENV_FILE)"
        return
    fi
    mkdir -p /etc/slurm
    ln -s "$CONF" "$ETC_CONF"
}

write_env() {
    (
        umask 077
        {
            echo "# Source this file for the local test cluster: . $ENV_FILE"
            echo "export SLURM_CONF=$CONF"
            [[ -s $DIR/s3.env ]] && cat "$DIR/s3.env"
        } >"$ENV_FILE"
    )
}

is_up() { pid_alive "$DIR/run/slurmctld.pid" slurmctld; }

cmd_up() {
    need_root up
    check_settings
    ensure_packages
    mkdir -p "$DIR"
    exec 9>"$DIR/.lock"
    flock -n 9 || die "another localcluster.sh is working on $DIR"
    if is_up; then
        say "already up ($DIR)"
        cmd_status
        return 0
    fi
    cmd_down quiet  # leftovers of an earlier run that was killed
    choose_subnet
    rm -rf "$DIR"/{state,spool,run,etc}
    cat >"$STATE_FILE" <<EOF
CLUSTER_NAME=$NAME
CLUSTER_NODES=$NODES
CLUSTER_SUBNET=$SUBNET
CLUSTER_CTLD_PORT=$CTLD_PORT
CLUSTER_SLURMD_PORT=$SLURMD_PORT
EOF
    trap 'say "start failed: stopping what was started"; cmd_down quiet' EXIT
    local started=$SECONDS
    write_config
    start_munge
    start_network
    start_slurm
    if [[ $WITH_S3 == 1 ]]; then start_s3; fi
    write_env
    link_etc
    trap - EXIT
    say "up in $((SECONDS - started)) s: $NODES nodes (node1..node$NODES on $SUBNET.11..), controller $(ctld_addr):$CTLD_PORT, state in $DIR"
    [[ $WITH_S3 == 1 ]] && say "S3 (SeaweedFS) at $(grep AWS_ENDPOINT_URL "$ENV_FILE" | cut -d= -f2), URI $(grep '^export URI=' "$ENV_FILE" | cut -d= -f2)"
    echo
    echo "Next:  mkdir -p logs && sbatch --nodes 2 batch/savebatch.sh   # jobs get the S3 settings"
    echo "       . $ENV_FILE   # optional: SLURM_CONF, URI and the S3 endpoint and keys in this shell"
}

pids_mentioning() {  # pids whose command line has an argument containing $1 (no spaces in it)
    # The first character in brackets, the rest escaped: the pattern does not match grep's
    # own command line (grep lists itself among /proc/*).
    local rest pattern
    rest=$(printf '%s' "${1:1}" | sed 's/[][\.*^$]/\\&/g')
    pattern="[${1:0:1}]$rest"
    grep -lsa -- "$pattern" /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3 |
        grep -vxE "$$|$BASHPID" || true
}

kill_mentioning() {  # $1 = marker, $2 = label
    local pids
    pids=$(pids_mentioning "$1")
    [[ -n $pids ]] || return 0
    say "stopping leftover $2: $(echo $pids)"
    stop_listed "$2" 5 pids_mentioning "$1"
}

cmd_down() {
    local quiet=${1:-}
    need_root down
    [[ -n $quiet ]] || say "stopping the cluster in $DIR"
    stop_pid_file "$DIR/run/s3server.pid" python "S3 server"
    # A server left behind by a killed s3server.py (its files live under S3_TMP).
    kill_mentioning "$S3_TMP/" "S3 server processes"
    # Everything started in a node namespace: slurmd, slurmstepd, the jobs' processes.
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-n[0-9]+$" || true); do
        stop_listed "processes in $ns" 10 ns_pids "$ns"
        ip netns del "$ns"
    done
    stop_pid_file "$DIR/run/slurmctld.pid" slurmctld slurmctld
    # Daemons whose pid file was lost (an 'up' killed half-way): they name our files.
    kill_mentioning "$CONF" "Slurm daemons"
    stop_pid_file "$MUNGE_DIR/munged.pid" munged munged
    kill_mentioning "$MUNGE_DIR/munge.key" munged
    if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
    local i
    for i in $(seq 99); do  # host ends of veth pairs whose namespace end was not deleted yet
        ip link show "$NAME-v$i" >/dev/null 2>&1 && ip link del "$NAME-v$i"
    done
    if [[ -L $ETC_CONF && $(readlink "$ETC_CONF") == "$CONF" ]]; then rm -f "$ETC_CONF"; fi
    rm -rf "$DIR"/{state,spool,run,env,s3.env,s3.tmp} "$S3_TMP"
    rm -f "$STATE_FILE"
    [[ -n $quiet ]] || say "down (logs kept in $DIR/log)"
}

cmd_status() {
    local running=0
    if is_up; then
        say "slurmctld running (pid $(<"$DIR/run/slurmctld.pid")) on $(ctld_addr):$CTLD_PORT; config $CONF"
        running=1
    else
        say "slurmctld not running ($DIR)"
    fi
    pid_alive "$MUNGE_DIR/munged.pid" munged && say "munged running" || say "munged not running"
    pid_alive "$DIR/run/s3server.pid" python && say "S3 server running: $(grep AWS_ENDPOINT_URL "$ENV_FILE" 2>/dev/null | cut -d= -f2)" ||
        say "S3 server not running"
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-n[0-9]+$" || true); do
        say "namespace $ns: $(ip netns pids "$ns" | wc -l) processes"
    done
    if ((running)); then
        SLURM_CONF=$CONF sinfo -N -o '%N %T %c %O' || true
        SLURM_CONF=$CONF squeue || true
        [[ -r $ENV_FILE ]] && say "settings for jobs: . $ENV_FILE"
    fi
    return 0
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
