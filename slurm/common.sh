# shellcheck shell=bash
# The one place that turns SLURM's environment into what our jobs need. Sourced by every
# slurm/*.sbatch script (in the batch shell) and by slurm/ray_node.sh (in each Ray srun task).
#
#   pretrain_job_env     batch shell: PRETRAIN_REPO/PYTHON, NNODES, GPUS_PER_NODE, PROCS_PER_NODE,
#                        WORLD_SIZE, HEAD_NODE, MASTER_ADDR, MASTER_PORT (free on the head node),
#                        RESTART (SLURM_RESTART_COUNT), thread and NCCL defaults — all exported, so
#                        the srun tasks inherit exactly the same values.
#   (a node's rank is SLURM_NODEID, read inside each srun task: see NODE_CMD in pretrain.sbatch)
#   pretrain_resolve_run KIND CONFIG [k=v ...]: validates the config; sets RUN_DIR, LOG_DIR, MAX_STEPS, RESUME.
#   pretrain_checkpoint_step / pretrain_run_complete: where the run stands (for the requeue decision).
#   pretrain_wait PID    wait for a background srun even while signal traps interrupt `wait`.
#
# Inputs you may set (all optional): PRETRAIN_REPO (repo checkout; default: the submit directory),
# PRETRAIN_PYTHON (default: $PRETRAIN_REPO/.venv/bin/python, else python3), PRETRAIN_GPUS_PER_NODE
# (default: SLURM's GPU count for the node, else 0 = one CPU process per node with gloo),
# PRETRAIN_MASTER_PORT (default: a free port on the head node), PRETRAIN_IFNAME (network interface
# for NCCL and gloo). NCCL defaults, each applied only when the variable is unset:
#   NCCL_DEBUG=WARN                         errors and warnings only (INFO to debug rendezvous)
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1       a failed/hung collective aborts the job instead of hanging
#   NCCL_SOCKET_IFNAME=^docker,lo           multi-node GPU jobs: never bootstrap over loopback/docker
#                                           (PRETRAIN_IFNAME=ib0 or eth0 pins one interface instead)
#   OMP_NUM_THREADS=cpus-per-task/procs     no CPU oversubscription by torch's intra-op threads

_pretrain_log() { echo "[pretrain-slurm $(date +%H:%M:%S)] $*" >&2; }
_pretrain_die() { _pretrain_log "error: $*"; exit 2; }

# A free TCP port on this host (the batch shell runs on the head node, so it is free there).
_pretrain_free_port() {
  "$PRETRAIN_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

pretrain_job_env() {
  [ -n "${SLURM_JOB_ID:-}" ] || _pretrain_die "not inside a SLURM job (SLURM_JOB_ID unset); submit with sbatch or 'pretrain submit'"
  : "${PRETRAIN_REPO:=${SLURM_SUBMIT_DIR:-$PWD}}"
  [ -f "$PRETRAIN_REPO/slurm/common.sh" ] || _pretrain_die "PRETRAIN_REPO=$PRETRAIN_REPO is not a pretrain checkout; set PRETRAIN_REPO or submit from the repo root"
  if [ -z "${PRETRAIN_PYTHON:-}" ]; then
    if [ -x "$PRETRAIN_REPO/.venv/bin/python" ]; then PRETRAIN_PYTHON=$PRETRAIN_REPO/.venv/bin/python; else PRETRAIN_PYTHON=python3; fi
  fi
  export PRETRAIN_REPO PRETRAIN_PYTHON
  export PYTHONPATH="$PRETRAIN_REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

  # Topology. SLURM_GPUS_ON_NODE is set with --gpus-per-node/--gres; "a100:8" forms keep the count.
  export NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
  local g=${PRETRAIN_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}}
  export GPUS_PER_NODE=${g##*:}
  export PROCS_PER_NODE=$(( GPUS_PER_NODE > 0 ? GPUS_PER_NODE : 1 ))
  export WORLD_SIZE=$(( NNODES * PROCS_PER_NODE ))
  export RESTART=${SLURM_RESTART_COUNT:-0}
  if [ -n "${PRETRAIN_WORLD_SIZE:-}" ] && [ "$PRETRAIN_WORLD_SIZE" != "$WORLD_SIZE" ]; then
    _pretrain_die "the script was rendered for world size $PRETRAIN_WORLD_SIZE but SLURM gave $NNODES node(s) x $PROCS_PER_NODE = $WORLD_SIZE; re-render with 'pretrain submit'"
  fi

  # Rendezvous: the first host of the allocation (where this batch shell runs), by the address
  # SLURM itself uses to reach it (NodeAddr), and a port that is free there right now.
  HEAD_NODE=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-$(hostname)}}" | head -n 1)
  local addr
  addr=$(scontrol show node "$HEAD_NODE" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  export HEAD_NODE MASTER_ADDR=${addr:-$HEAD_NODE}
  export MASTER_PORT=${PRETRAIN_MASTER_PORT:-$(_pretrain_free_port)}

  # Threads and communication defaults (documented at the top of this file).
  local cpus=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus / PROCS_PER_NODE > 0 ? cpus / PROCS_PER_NODE : 1 ))}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  if [ -n "${PRETRAIN_IFNAME:-}" ]; then
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$PRETRAIN_IFNAME} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$PRETRAIN_IFNAME}
  elif [ "$NNODES" -gt 1 ] && [ "$GPUS_PER_NODE" -gt 0 ]; then
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^docker,lo}
  fi
  _pretrain_log "job $SLURM_JOB_ID restart $RESTART: $NNODES node(s) x $PROCS_PER_NODE process(es) = world $WORLD_SIZE;" \
    "rendezvous $MASTER_ADDR:$MASTER_PORT (head $HEAD_NODE); python $PRETRAIN_PYTHON"
}

# Validate KIND (pretrain | finetune) CONFIG [k=v ...] before any srun, learn where the run writes, and
# claim that run dir (its marker) before the logs go into it.
pretrain_resolve_run() {
  local out
  out=$("$PRETRAIN_PYTHON" -m pipelines.ops.submit resolve --claim "$@") \
    || _pretrain_die "the run config or its run dir was refused (message above)"
  eval "$out"  # RUN_DIR=... MAX_STEPS=... RESUME=... (shell-quoted by pipelines.ops.submit)
  export RUN_DIR MAX_STEPS RESUME LOG_DIR=$RUN_DIR/logs
  mkdir -p "$LOG_DIR"
}

# The step of the newest complete checkpoint in RUN_DIR (0 when there is none).
pretrain_checkpoint_step() {
  local latest
  latest=$(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null) || { echo 0; return; }
  latest=${latest##*step-}
  echo $(( 10#${latest:-0} ))
}

# `wait PID` returns early whenever a trapped signal arrives; keep waiting until PID really exits
# and return its exit status.
pretrain_wait() {
  local pid=$1 rc=0 again
  while :; do
    wait "$pid"; rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  wait "$pid" 2>/dev/null; again=$?          # an interrupted wait whose child exited meanwhile
  [ "$again" -ne 127 ] && rc=$again          # 127: already collected above, rc is its status
  return "$rc"
}

# Has the run reached its budget? pretrain: a checkpoint at MAX_STEPS; finetune: metrics.json written.
pretrain_run_complete() {
  if [ "${KIND:-pretrain}" = finetune ]; then [ -f "$RUN_DIR/metrics.json" ]; return; fi
  [ "$(pretrain_checkpoint_step)" -ge "$MAX_STEPS" ]
}
