#!/usr/bin/env bash
# A real two-node Slurm on this one machine, for tests/test_slurm.py (and for trying the
# sbatch scripts by hand). Needs root and apt-get (Debian/Ubuntu); no systemd or cgroups needed.
#
#   tests/slurm_cluster.sh install  install munge+Slurm with apt-get if missing (.ci/run starts
#                                   this in the background, beside the Python install)
#   tests/slurm_cluster.sh start    install if missing, start munged, slurmctld and two slurmd
#                                   (node1, node2; 4 CPUs and 4 fake GPUs each), wait until idle
#   tests/slurm_cluster.sh status   daemons and sinfo
#   tests/slurm_cluster.sh stop     stop the daemons this script started (by pid file only)
#
# Then, in the same shell:  export SLURM_CONF=/tmp/ddp-course-slurm/slurm.conf
#                           sbatch --wait slurm/train.sbatch multinode.py --epochs 2
# Everything (config, state, logs, pid files, fake GPU devices) lives in $SLURM_TEST_DIR
# (default /tmp/ddp-course-slurm), wiped at each start; slurmctld listens on $SLURM_TEST_PORT
# (default 16817) and the slurmd on the next two ports. The tests give each session its own dir
# and ports, so two test sessions can run at once. Outside it, start touches only
# /etc/hosts (adds node1/node2 -> 127.0.0.1 if they do not resolve) and munge (starts munged if
# none runs). The stop of the last cluster running undoes both: it removes the lines it added and
# stops the munged it started (recorded in $MUNGE_OURS), never one it found running.
# The "GPUs" are character devices with /dev/null's numbers: Slurm counts and hands them out
# (so `#SBATCH --gpus-per-node=2` works unchanged), but there is no CUDA behind them.
set -euo pipefail

DIR=${SLURM_TEST_DIR:-/tmp/ddp-course-slurm}
PORT=${SLURM_TEST_PORT:-16817}   # slurmctld's port; the two slurmd listen on PORT+1 and PORT+2
CONF=$DIR/slurm.conf
NODES=(node1 node2)
# CPUs and GPUs per node as Slurm sees them: room for two jobs of the sbatch scripts at once
# (2 ranks per node each), so that the tests run the two scripts side by side.
CPUS=${SLURM_TEST_CPUS:-4}
GPUS=4
MUNGE_PID=/run/munge/munged.pid
# The munged this script started, if any (shared by the test sessions, like munge itself).
MUNGE_OURS=/tmp/ddp-course-slurm-munged.pid
# Marks the /etc/hosts lines this script adds, so that it removes those and no others.
HOSTS_MARK="# ddp-course test Slurm"

say() { echo "slurm_cluster: $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_slurm() {
    local need=0
    for c in munged mungekey slurmctld slurmd sbatch srun sinfo; do
        command -v "$c" >/dev/null || need=1
    done
    [[ $need == 0 ]] && return 0
    [[ $(id -u) == 0 ]] || die "Slurm is not installed and installing it needs root"
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get to install it"
    export DEBIAN_FRONTEND=noninteractive
    local packages=(munge slurmctld slurmd slurm-client)
    # apt-get update (a minute on a slow mirror) only when the package lists do not know Slurm,
    # or when they are stale: their .deb files are gone from the mirror and the install fails.
    if ! apt-cache show slurmctld >/dev/null 2>&1; then
        say "apt-get update"
        apt-get update -q >/dev/null || die "apt-get update failed"
    fi
    say "installing ${packages[*]} (apt-get, without recommended packages)"
    if ! apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null; then
        say "apt-get install failed: apt-get update, then once more"
        apt-get update -q >/dev/null || die "apt-get update failed"
        apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null \
            || die "apt-get install ${packages[*]} failed"
    fi
}

add_hosts() {
    for n in "${NODES[@]}"; do
        # The job uses the first node's name as MASTER_ADDR / rendezvous host: it must resolve.
        getent hosts "$n" >/dev/null || echo "127.0.0.1 $n  $HOSTS_MARK" >>/etc/hosts
    done
}

remove_hosts() {  # the lines add_hosts added; rewritten in place (/etc/hosts may be a bind mount)
    grep -qF -- "$HOSTS_MARK" /etc/hosts || return 0
    local kept
    kept=$(grep -vF -- "$HOSTS_MARK" /etc/hosts || true)
    printf '%s\n' "$kept" >/etc/hosts
}

write_config() {
    mkdir -p "$DIR"/{state,log,run,dev} "$DIR"/spool/{node1,node2}
    local gres_lines="" i=0
    for n in "${NODES[@]}"; do
        # Fake GPUs: gres needs device files (a count-only gres leaves the node INVAL).
        for g in $(seq "$i" $((i + GPUS - 1))); do mknod "$DIR/dev/nvidia$g" c 1 3; done
        gres_lines+="NodeName=$n Name=gpu File=$DIR/dev/nvidia[$i-$((i + GPUS - 1))]"$'\n'
        i=$((i + GPUS))
    done
    printf '%s' "$gres_lines" >"$DIR/gres.conf"
    cat >"$CONF" <<EOF
# Written by tests/slurm_cluster.sh: two nodes on one machine, for tests only.
ClusterName=ddpcourse
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
# Finished jobs leave the controller after 5 s: sbatch --wait then returns within seconds.
MinJobAge=5
# The sbatch scripts derive their rendezvous port from the job id: two test clusters at once
# must not hand out the same ids (the tests start each at its cluster's own port).
FirstJobId=${SLURM_TEST_FIRST_JOB_ID:-1}
# Seconds between SIGTERM and SIGKILL when a step is killed (e.g. --kill-on-bad-exit).
KillWait=5
# A requeued job waits for the old run's step credentials to expire before it starts again
# (cred_expire, 120 s by default), then for the main scheduling loop (sched_interval, 60 s):
# a requeued test job would wait three minutes. Here, seconds.
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=1
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
GresTypes=gpu
NodeName=node[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + 1))-$((PORT + 2)) CPUs=$CPUS Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    pid_alive "$MUNGE_PID" && return 0
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
    chmod 0700 /etc/munge /var/lib/munge /var/log/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0755 /run/munge
    runuser -u munge -- munged --force 9>&- || die "munged did not start (see /var/log/munge/munged.log)"
    cp "$MUNGE_PID" "$MUNGE_OURS"
}

wait_idle() {
    local t
    for t in $(seq 1 60); do
        # sinfo: one line per node and state; all nodes idle -> done.
        if [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2=="idle"' | wc -l) == "${#NODES[@]}" ]]; then
            return 0
        fi
        sleep 0.5
    done
    sinfo -N >&2 || true
    tail -n 20 "$DIR"/log/*.log >&2 || true
    die "the Slurm nodes did not become idle within 30 s (logs in $DIR/log)"
}

stop_daemons() {
    # Jobs first: their processes hang off slurmstepd, not the daemons, and would outlive them.
    if pid_alive "$DIR/run/slurmctld.pid" && [[ -f $CONF ]]; then
        SLURM_CONF=$CONF scancel --full --quiet --state=PENDING 2>/dev/null || true
        SLURM_CONF=$CONF scancel --full --quiet 2>/dev/null || true
        for _ in $(seq 1 40); do
            [[ -z $(SLURM_CONF=$CONF squeue -h -t PD,R,CG,CF,S 2>/dev/null) ]] && break
            sleep 0.5
        done
    fi
    # The Slurm daemons take seconds each to exit: stop them together, then munge under them.
    stop_pids "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid"
    local f
    for f in /tmp/ddp-course-slurm*/run/slurmctld.pid; do
        pid_alive "$f" && return 0  # another test session's cluster (its own dir and ports) still needs munge and the hosts
    done
    # Only the munged this script started (the pid it recorded, still a munged).
    if pid_alive "$MUNGE_OURS" && [[ $(cat "/proc/$(cat "$MUNGE_OURS")/comm" 2>/dev/null) == munged ]]; then
        stop_pids "$MUNGE_OURS"
    fi
    rm -f "$MUNGE_OURS"
    remove_hosts
}

stop_pids() {  # SIGTERM the processes of these pid files at once; SIGKILL any alive after 5 s
    local f pid pids=() alive
    for f in "$@"; do pid_alive "$f" && pids+=("$(cat "$f")"); done
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for _ in $(seq 1 50); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [[ $alive == 0 ]] && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null; done
    rm -f "$@"
}

start() {
    [[ $(id -u) == 0 ]] || die "starting the test Slurm needs root"
    install_slurm
    stop_daemons   # a previous instance of this script, if any
    rm -rf "$DIR"
    add_hosts
    write_config
    export SLURM_CONF=$CONF
    start_munge
    slurmctld 9>&- || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
    for n in "${NODES[@]}"; do
        slurmd -N "$n" 9>&- || die "slurmd -N $n did not start (see $DIR/log/slurmd-$n.log)"
    done
    wait_idle
    say "up: nodes ${NODES[*]} idle; export SLURM_CONF=$CONF"
}

status() {
    local f
    for f in "$MUNGE_PID" "$DIR/run/slurmctld.pid" "$DIR"/run/slurmd-*.pid; do
        if pid_alive "$f"; then echo "running  $(basename "$f" .pid) pid $(cat "$f")"; else echo "stopped  $(basename "$f" .pid)"; fi
    done
    [[ -f $CONF ]] && SLURM_CONF=$CONF sinfo -N 2>/dev/null || true
}

# Two test sessions (or pytest workers) at once share apt-get, /etc/hosts and munge: one at a time here.
# (The daemons are started with fd 9 closed, or they would hold the lock for as long as they run.)
[[ ${1:-} == install || ${1:-} == start || ${1:-} == stop ]] && exec 9>/tmp/ddp-course-slurm.lock && flock 9
case "${1:-}" in
    install) install_slurm ;;
    start) start ;;
    stop) stop_daemons; say "stopped" ;;
    status) status ;;
    *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
