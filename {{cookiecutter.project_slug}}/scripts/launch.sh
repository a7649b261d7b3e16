#!/usr/bin/env bash
# Launch train.py with torchrun; arguments after the script go to train.py.
#
#   scripts/launch.sh --epochs 3                  # this machine, NPROC_PER_NODE processes
#   scripts/launch.sh --preflight                 # check the cluster instead of training
#
# Several nodes, static (run on every node; only NODE_RANK differs):
#   MASTER_ADDR=10.0.0.1 NODE_RANK=0 NNODES=2 NPROC_PER_NODE=8 scripts/launch.sh
#   MASTER_ADDR=10.0.0.1 NODE_RANK=1 NNODES=2 NPROC_PER_NODE=8 scripts/launch.sh
# Several nodes, elastic (c10d rendezvous; nodes may come and go between MIN and MAX):
#   RDZV_ENDPOINT=10.0.0.1:29400 RDZV_ID=job42 NNODES=1:4 NPROC_PER_NODE=8 scripts/launch.sh
#
# Defaults come from the answers given when the project was generated. MAX_RESTARTS > 0 lets
# torchrun restart all workers when one dies; they resume from the newest checkpoint.
set -euo pipefail

NNODES=${NNODES:-{{ cookiecutter.num_nodes }}}
NPROC_PER_NODE=${NPROC_PER_NODE:-{{ cookiecutter.gpus_per_node }}}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-}
RDZV_ID=${RDZV_ID:-ddp}
MAX_RESTARTS=${MAX_RESTARTS:-0}

die() { echo "launch.sh: $*" >&2; exit 2; }
whole() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 must be a whole number, got '$2'"; }
for name in NPROC_PER_NODE NODE_RANK MASTER_PORT MAX_RESTARTS; do whole "$name" "${!name}"; done
(( NPROC_PER_NODE >= 1 )) || die "NPROC_PER_NODE must be at least 1"

entry=(train.py)
if [[ ${1:-} == --preflight ]]; then
    shift
    entry=(preflight.py)
fi

if [[ -n $RDZV_ENDPOINT ]]; then
    [[ $NNODES =~ ^[0-9]+(:[0-9]+)?$ ]] || die "NNODES must be a count or MIN:MAX, got '$NNODES'"
    (( ${NNODES%%:*} >= 1 && ${NNODES##*:} >= ${NNODES%%:*} )) || die "NNODES=$NNODES: need 1 <= MIN <= MAX"
    rendezvous=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID")
    where="c10d rendezvous at $RDZV_ENDPOINT (id $RDZV_ID)"
else
    [[ $NNODES != *:* ]] || die "NNODES=$NNODES (MIN:MAX) needs RDZV_ENDPOINT, the elastic c10d rendezvous"
    whole NNODES "$NNODES"
    (( NNODES >= 1 )) || die "NNODES must be at least 1"
    (( NODE_RANK < NNODES )) || die "NODE_RANK ($NODE_RANK) must be less than NNODES ($NNODES)"
    if (( NNODES == 1 )) && [[ -z $MASTER_ADDR ]]; then
        rendezvous=(--standalone)
        where="this machine only"
    else
        [[ -n $MASTER_ADDR ]] || die "NNODES=$NNODES needs MASTER_ADDR (the address of the NODE_RANK=0 node)"
        rendezvous=(--nnodes="$NNODES" --node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
        where="static rendezvous at $MASTER_ADDR:$MASTER_PORT, node $NODE_RANK"
    fi
fi

# torchrun forwards these signals to every worker, which then checkpoint and exit: SIGTERM
# (schedulers, Kubernetes) and SIGUSR1 (SLURM's --signal). Older torchrun ignores the variable.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}

cd "$(dirname "$0")/.."
echo "launch.sh: ${entry[*]} on $NNODES node(s) x $NPROC_PER_NODE process(es), $where," \
    "max restarts $MAX_RESTARTS" >&2
exec torchrun "${rendezvous[@]}" --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS" \
    "${entry[@]}" "$@"
