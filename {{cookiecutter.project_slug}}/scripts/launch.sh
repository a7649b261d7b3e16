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
#   (RDZV_CONF passes torchrun's --rdzv-conf, e.g. last_call_timeout=10: how long a group of at
#   least MIN nodes waits for more before it starts; torchrun's default is 30 s.)
#
# Defaults come from the answers given when the project was generated. MAX_RESTARTS > 0 lets
# torchrun restart all workers when one dies; they resume from the newest checkpoint.
set -euo pipefail

# On Kubernetes (k8s/): Kubeflow Trainer sets torchrun's own PET_* variables, and an indexed
# Job (the JobSet variant) numbers its pods with JOB_COMPLETION_INDEX; the plain names win.
NNODES=${NNODES:-${PET_NNODES:-{{ cookiecutter.num_nodes }}}}
NPROC_PER_NODE=${NPROC_PER_NODE:-${PET_NPROC_PER_NODE:-{{ cookiecutter.gpus_per_node }}}}
NODE_RANK=${NODE_RANK:-${PET_NODE_RANK:-${JOB_COMPLETION_INDEX:-0}}}
MASTER_ADDR=${MASTER_ADDR:-${PET_MASTER_ADDR:-}}
MASTER_PORT=${MASTER_PORT:-${PET_MASTER_PORT:-29500}}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-}
RDZV_ID=${RDZV_ID:-ddp}
RDZV_CONF=${RDZV_CONF:-}
MAX_RESTARTS=${MAX_RESTARTS:-0}
# Seconds from a stop signal (SIGTERM from a scheduler, SLURM's SIGUSR1) to the hard kill: the
# step in progress and the checkpoint must fit in it. scripts/slurm.sbatch sets it from its
# --signal lead time; on Kubernetes it is the pod's terminationGracePeriodSeconds. Exported:
# the preflight compares a checkpoint's save time with it.
export STOP_GRACE_SECONDS=${STOP_GRACE_SECONDS:-90}

die() { echo "launch.sh: $*" >&2; exit 2; }
whole() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 must be a whole number, got '$2'"; }
for name in NPROC_PER_NODE NODE_RANK MASTER_PORT MAX_RESTARTS STOP_GRACE_SECONDS; do whole "$name" "${!name}"; done
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
    [[ -z $RDZV_CONF ]] || rendezvous+=(--rdzv-conf="$RDZV_CONF")
    # torch 2.13 shares its rendezvous store with the workers; then a node that joins a running
    # job waits forever for the new round's store address, which the old rank 0 never publishes.
    # Unshared, every round (start, restart, node joined) gets a fresh store from its rank 0.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
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
# (schedulers, Kubernetes) and SIGUSR1 (SLURM's --signal).
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
# After forwarding a signal torchrun waits this long for the workers, then kills them (its own
# default is 30 s): the stop grace less 10 s for torchrun, srun and a SLURM requeue to finish.
# torchrun 2.11 has no such setting: scripts/torchrun_status.py gives it the same wait.
export PET_SHUTDOWN_TIMEOUT=$(( STOP_GRACE_SECONDS > 20 ? STOP_GRACE_SECONDS - 10 : STOP_GRACE_SECONDS ))
# NCCL: keep PyTorch's own error handling (3: a failed or timed-out collective ends the
# process, without the extra abort that mode 1, torchrun's default for workers, adds).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}

cd "$(dirname "$0")/.."
echo "launch.sh: ${entry[*]} on $NNODES node(s) x $NPROC_PER_NODE process(es), $where," \
    "max restarts $MAX_RESTARTS, workers get ${PET_SHUTDOWN_TIMEOUT} s to stop" >&2

# torchrun through scripts/torchrun_status.py: the same torchrun, which ends a job stopped by a
# signal (its checkpoint saved) with the workers' status on every node, 143 after SIGTERM, not 1.
# Run by the Python that has torchrun (a virtual environment's), else the first python3.
python=$(dirname "$(command -v torchrun || echo python3)")/python3
[[ -x $python ]] || python=python3
exec "$python" scripts/torchrun_status.py "${rendezvous[@]}" --nproc-per-node="$NPROC_PER_NODE" \
    --max-restarts="$MAX_RESTARTS" "${entry[@]}" "$@"
