#!/usr/bin/env bash
# launch_ddp.sh: start any lesson on one node, on one node of a multi-node job, or through Slurm.
#
#   ./launch_ddp.sh multinode.py --epochs 2                     one node, one process per GPU
#   ./launch_ddp.sh --nnodes 2 --node-rank 0 --master-addr HOST0 multinode.py   on node 0,
#   ./launch_ddp.sh --nnodes 2 --node-rank 1 --master-addr HOST0 multinode.py   then on node 1
#   ./launch_ddp.sh --nnodes 2 --rdzv-endpoint HOST0:29400 multinode.py          same on every node
#   ./launch_ddp.sh --slurm --nnodes 2 multinode.py             sbatch slurm/train.sbatch
#
# Everything after the script name goes to the script. Run ./launch_ddp.sh --help for all options.
# torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each restart attempt gets a fresh store
# (docs/multinode.md explains why a restart on several nodes needs it).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: launch_ddp.sh [options] SCRIPT [SCRIPT ARGS...]

Start SCRIPT with torchrun on this node (single node or one node of a multi-node job), or submit
it to Slurm. Options:
  --nproc N             processes on this node (default: the GPUs this process may use, i.e.
                        nvidia-smi -L limited by CUDA_VISIBLE_DEVICES; 2 CPU processes if none)
  --nnodes N            number of nodes in the job (default 1)
  --node-rank R         static rendezvous: this node's rank, 0..N-1 (node 0 hosts the store)
  --master-addr HOST    static rendezvous: address of node rank 0, reachable from every node
  --master-port PORT    static rendezvous port on node 0 (default 29500)
  --rdzv-endpoint HOST[:PORT]
                        c10d rendezvous instead: the same command on every node; node ranks
                        follow the nodes' addresses (HOST is one of the nodes; default port 29400)
  --rdzv-id ID          c10d rendezvous id, the same on every node of one job (default ddp-course)
  --max-restarts N      torchrun restarts the workers up to N times after a failure (default 0);
                        the script must resume from its checkpoint (lesson 3 always does; the
                        others with --resume auto), or each restart starts over.
                        Several nodes: only with --rdzv-endpoint (static rendezvous cannot)
  --slurm               submit with sbatch slurm/train.sbatch (one torchrun per node);
                        --nnodes sets --nodes, --nproc sets NPROC_PER_NODE and --gpus-per-node
  --slurm-srun          submit with sbatch slurm/train_srun.sbatch (one srun task per GPU,
                        no torchrun); --nproc sets --ntasks-per-node and --gpus-per-node
  --debug               verbose distributed logs: NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET,
                        TORCH_DISTRIBUTED_DEBUG=INFO, TORCH_CPP_LOG_LEVEL=INFO,
                        TORCH_SHOW_CPP_STACKTRACES=1, LOGLEVEL=INFO
  --dry-run             print the command instead of running it
  -h, --help            this help
Extra sbatch options: set SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT... in the environment.
EOF
}

die() { echo "error: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value (see --help)"; }
# No leading zeros: bash reads 010 as octal 8, torchrun as 10.
is_uint() { [[ $1 =~ ^(0|[1-9][0-9]*)$ ]]; }

NPROC="" NNODES=1 NODE_RANK="" MASTER_ADDR_ARG="" MASTER_PORT_ARG=29500 RDZV_ENDPOINT="" RDZV_ID=ddp-course
MAX_RESTARTS=0
MODE=torchrun DEBUG=0 DRY_RUN=0 PORT_SET=0 NNODES_SET=0 RDZV_ID_SET=0
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --nproc|--nproc-per-node|--nproc_per_node) need_value "$@"; NPROC=$2; shift 2 ;;
        --nnodes) need_value "$@"; NNODES=$2; NNODES_SET=1; shift 2 ;;
        --node-rank|--node_rank) need_value "$@"; NODE_RANK=$2; shift 2 ;;
        --master-addr|--master_addr) need_value "$@"; MASTER_ADDR_ARG=$2; shift 2 ;;
        --master-port|--master_port) need_value "$@"; MASTER_PORT_ARG=$2; PORT_SET=1; shift 2 ;;
        --rdzv-endpoint|--rdzv_endpoint) need_value "$@"; RDZV_ENDPOINT=$2; shift 2 ;;
        --rdzv-id|--rdzv_id) need_value "$@"; RDZV_ID=$2; RDZV_ID_SET=1; shift 2 ;;
        --max-restarts|--max_restarts) need_value "$@"; MAX_RESTARTS=$2; shift 2 ;;
        --slurm) MODE=slurm; shift ;;
        --slurm-srun) MODE=slurm-srun; shift ;;
        --debug) DEBUG=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done

[[ $# -ge 1 ]] || die "no script given: launch_ddp.sh [options] SCRIPT [ARGS...] (see --help)"
is_uint "$NNODES" && [[ $NNODES -ge 1 ]] || die "--nnodes must be a whole number >= 1, not '$NNODES'"
if [[ -n $NPROC ]]; then
    is_uint "$NPROC" && [[ $NPROC -ge 1 ]] || die "--nproc must be a whole number >= 1, not '$NPROC'"
fi
is_uint "$MAX_RESTARTS" || die "--max-restarts must be a whole number >= 0, not '$MAX_RESTARTS'"
is_uint "$MASTER_PORT_ARG" && [[ $MASTER_PORT_ARG -ge 1 && $MASTER_PORT_ARG -le 65535 ]] \
    || die "--master-port must be a port number 1..65535, not '$MASTER_PORT_ARG'"
SCRIPT=$1; shift
[[ -f $SCRIPT ]] || die "script $SCRIPT not found (paths are relative to $(pwd))"

if [[ $DEBUG == 1 ]]; then
    # What each one shows: NCCL's transport choice and errors; DDP's checks of unused parameters
    # and mismatched collectives; c10d's store/rendezvous logs; C++ stacks in errors; torchrun's log.
    export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET TORCH_DISTRIBUTED_DEBUG=INFO \
        TORCH_CPP_LOG_LEVEL=INFO TORCH_SHOW_CPP_STACKTRACES=1 LOGLEVEL=INFO PYTHONFAULTHANDLER=1
    echo "+ export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET TORCH_DISTRIBUTED_DEBUG=INFO" \
        "TORCH_CPP_LOG_LEVEL=INFO TORCH_SHOW_CPP_STACKTRACES=1 LOGLEVEL=INFO PYTHONFAULTHANDLER=1" >&2
fi

run() {  # print the command (shell-quoted), then run it unless --dry-run
    printf '+' >&2; printf ' %q' "$@" >&2; printf '\n' >&2
    [[ $DRY_RUN == 1 ]] && exit 0
    exec "$@"
}

if [[ $MODE != torchrun ]]; then
    [[ -z $NODE_RANK && -z $MASTER_ADDR_ARG && -z $RDZV_ENDPOINT && $PORT_SET == 0 && $RDZV_ID_SET == 0 ]] \
        || die "--node-rank, --master-addr, --master-port, --rdzv-endpoint and --rdzv-id are not used with $MODE: the sbatch script picks them"
    HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    export DDP_COURSE_DIR=$HERE   # the sbatch scripts activate $DDP_COURSE_DIR/.venv if it exists
    # Only what you gave overrides the #SBATCH lines of the script. OPTS may stay empty:
    # ${OPTS[@]+"${OPTS[@]}"} expands it to nothing where "${OPTS[@]}" would stop bash <= 4.3
    # (set -u: "unbound variable").
    OPTS=()
    [[ $NNODES_SET == 1 ]] && OPTS+=(--nodes="$NNODES")
    # One GPU per process: the scripts' #SBATCH --gpus-per-node=2 would leave the rest on CPUs.
    [[ -z $NPROC ]] || OPTS+=(--gpus-per-node="$NPROC")
    if [[ $MODE == slurm ]]; then
        EXPORT=ALL${NPROC:+,NPROC_PER_NODE=$NPROC}
        [[ $MAX_RESTARTS == 0 ]] || EXPORT+=,MAX_RESTARTS=$MAX_RESTARTS
        [[ $EXPORT == ALL ]] || OPTS+=(--export="$EXPORT")
        CMD=(sbatch ${OPTS[@]+"${OPTS[@]}"} "$HERE/slurm/train.sbatch")
    else
        [[ $MAX_RESTARTS == 0 ]] || die "--max-restarts needs torchrun: use --slurm, not --slurm-srun"
        CMD=(sbatch ${OPTS[@]+"${OPTS[@]}"} ${NPROC:+--ntasks-per-node=$NPROC} "$HERE/slurm/train_srun.sbatch")
    fi
    CMD+=("$SCRIPT" "$@")
    [[ $DRY_RUN == 1 ]] || command -v sbatch >/dev/null || die "sbatch not found: is this a Slurm login node?"
    run "${CMD[@]}"
fi

if [[ -z $NPROC ]]; then
    # nvidia-smi lists every GPU of the machine; CUDA_VISIBLE_DEVICES may allow only some ("0,1"),
    # or none (empty). One process per GPU this process may use.
    NPROC=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then  # set, even empty (not -v: bash >= 4.2 only)
        IFS=, read -ra VISIBLE <<<"$CUDA_VISIBLE_DEVICES"
        [[ ${#VISIBLE[@]} -lt $NPROC ]] && NPROC=${#VISIBLE[@]}
    fi
    [[ $NPROC -ge 1 ]] || NPROC=2   # no GPU: 2 CPU processes (gloo) to see DDP at work
fi
if command -v torchrun >/dev/null; then TORCHRUN=(torchrun); else TORCHRUN=("${PYTHON:-python}" -m torch.distributed.run); fi
# A fresh store for each restart attempt: with torchrun's default (one store shared by all
# attempts) a restart on several nodes can hang (docs/multinode.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
echo "+ export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" >&2
[[ $MAX_RESTARTS == 0 ]] || TORCHRUN+=(--max-restarts="$MAX_RESTARTS")

if [[ $NNODES == 1 ]]; then
    [[ -z $NODE_RANK && -z $MASTER_ADDR_ARG && -z $RDZV_ENDPOINT && $PORT_SET == 0 && $RDZV_ID_SET == 0 ]] \
        || die "--node-rank, --master-addr, --master-port, --rdzv-endpoint and --rdzv-id need --nnodes 2 or more"
    # --standalone: a private rendezvous on a free local port, so two jobs never collide. The
    # workers meet at 127.0.0.1, not at this machine's name, which may not resolve (a laptop).
    run "${TORCHRUN[@]}" --local-addr=127.0.0.1 --standalone --nproc-per-node="$NPROC" "$SCRIPT" "$@"
fi

if [[ -n $RDZV_ENDPOINT ]]; then
    [[ -z $NODE_RANK && -z $MASTER_ADDR_ARG && $PORT_SET == 0 ]] \
        || die "use either --rdzv-endpoint (c10d) or --node-rank/--master-addr/--master-port (static), not both"
    [[ $RDZV_ENDPOINT == *:* ]] || RDZV_ENDPOINT=$RDZV_ENDPOINT:29400
    RDZV_PORT=${RDZV_ENDPOINT##*:}
    is_uint "$RDZV_PORT" && [[ $RDZV_PORT -ge 1 && $RDZV_PORT -le 65535 ]] \
        || die "--rdzv-endpoint's port must be a port number 1..65535, not '$RDZV_PORT'"
    # "Nodes" on this machine (a rehearsal): the workers meet at 127.0.0.1, not at its name.
    LOCAL=()
    [[ $RDZV_ENDPOINT == 127.0.0.1:* || $RDZV_ENDPOINT == localhost:* ]] && LOCAL=(--local-addr=127.0.0.1)
    # c10d: every node runs this same line; the node whose address is HOST serves the store.
    run "${TORCHRUN[@]}" ${LOCAL[@]+"${LOCAL[@]}"} --nnodes="$NNODES" --nproc-per-node="$NPROC" \
        --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" "$SCRIPT" "$@"
fi

[[ -n $NODE_RANK && -n $MASTER_ADDR_ARG ]] \
    || die "--nnodes $NNODES needs --node-rank and --master-addr (static), or --rdzv-endpoint (c10d)"
[[ $RDZV_ID_SET == 0 ]] || die "--rdzv-id is for c10d rendezvous (--rdzv-endpoint): static has none"
# Static rendezvous never restarts a healthy node with the failed one (docs/multinode.md).
[[ $MAX_RESTARTS == 0 ]] \
    || die "--max-restarts needs c10d rendezvous on several nodes: use --rdzv-endpoint HOST, not --node-rank/--master-addr"
is_uint "$NODE_RANK" && [[ $NODE_RANK -lt $NNODES ]] \
    || die "--node-rank must be 0..$((NNODES - 1)) for --nnodes $NNODES, not '$NODE_RANK'"
# static: node ranks are fixed by you; node 0 hosts the store at MASTER_ADDR:MASTER_PORT.
run "${TORCHRUN[@]}" --nnodes="$NNODES" --nproc-per-node="$NPROC" --node-rank="$NODE_RANK" \
    --master-addr="$MASTER_ADDR_ARG" --master-port="$MASTER_PORT_ARG" "$SCRIPT" "$@"
