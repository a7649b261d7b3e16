#!/usr/bin/env bash
# Launch train.py with torchrun; arguments after the script go to train.py.
#
#   scripts/launch.sh --epochs 3                 # this machine, NPROC_PER_NODE processes
#   MASTER_ADDR=10.0.0.1 NODE_RANK=0 NNODES=2 scripts/launch.sh   # on the first node
#   MASTER_ADDR=10.0.0.1 NODE_RANK=1 NNODES=2 scripts/launch.sh   # on the second node
#
# Defaults come from the answers given when the project was generated. MAX_RESTARTS > 0 lets
# torchrun restart all workers when one dies; they resume from the newest checkpoint.
set -euo pipefail

NNODES=${NNODES:-{{ cookiecutter.num_nodes }}}
NPROC_PER_NODE=${NPROC_PER_NODE:-{{ cookiecutter.gpus_per_node }}}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-0}

die() { echo "launch.sh: $*" >&2; exit 2; }
for name in NNODES NPROC_PER_NODE NODE_RANK MASTER_PORT MAX_RESTARTS; do
    [[ ${!name} =~ ^[0-9]+$ ]] || die "$name must be a whole number, got '${!name}'"
done
(( NNODES >= 1 )) || die "NNODES must be at least 1"
(( NPROC_PER_NODE >= 1 )) || die "NPROC_PER_NODE must be at least 1"
(( NODE_RANK < NNODES )) || die "NODE_RANK ($NODE_RANK) must be less than NNODES ($NNODES)"

cd "$(dirname "$0")/.."
if (( NNODES == 1 )) && [[ -z $MASTER_ADDR ]]; then
    rendezvous=(--standalone)
else
    [[ -n $MASTER_ADDR ]] || die "NNODES=$NNODES needs MASTER_ADDR (the address of the NODE_RANK=0 node)"
    rendezvous=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
fi

# torchrun forwards these signals to every worker, which then checkpoint and exit: SIGTERM
# (schedulers, Kubernetes) and SIGUSR1 (SLURM's --signal). Older torchrun ignores the variable.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}

echo "launch.sh: nodes=$NNODES node_rank=$NODE_RANK procs_per_node=$NPROC_PER_NODE" \
    "master=${MASTER_ADDR:-localhost}:$MASTER_PORT max_restarts=$MAX_RESTARTS" >&2
exec torchrun "${rendezvous[@]}" --nproc_per_node="$NPROC_PER_NODE" --max_restarts="$MAX_RESTARTS" \
    train.py "$@"
