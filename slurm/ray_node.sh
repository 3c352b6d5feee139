#!/usr/bin/env bash
# One Ray node, run by slurm/prepare_ray.sbatch as an srun task: `ray_node.sh head` on the first
# node, `ray_node.sh worker` on each other one. Blocks until the step is ended (SIGTERM), then
# `ray start --block` stops the Ray processes it started on this node.
set -euo pipefail
source "$PRETRAIN_REPO/slurm/common.sh"
node=${SLURMD_NODENAME:?run me with srun}
ray_bin=$(dirname "$PRETRAIN_PYTHON")/ray
# Per job and node: nodes that share a host (and concurrent jobs) never share a session dir,
# sockets or the dashboard agent's port. mktemp: a fresh 0700 directory with an unguessable name, so
# another user cannot plant one (or a symlink) in /tmp first. prepare_ray.sbatch removes it at the end.
tmp=$(mktemp -d "/tmp/ray-$SLURM_JOB_ID-$node.XXXXXX")
common=(--block --disable-usage-stats --num-cpus="${SLURM_CPUS_ON_NODE:-1}" --temp-dir="$tmp"
        --dashboard-agent-listen-port="$(_pretrain_free_port)")
echo "[node $node on $(hostname)] ray $1, head $MASTER_ADDR:$MASTER_PORT, ${SLURM_CPUS_ON_NODE:-1} CPU(s)" >&2
case $1 in
  head) exec "$ray_bin" start --head --node-ip-address="$MASTER_ADDR" --port="$MASTER_PORT" --include-dashboard=false "${common[@]}" ;;
  worker) exec "$ray_bin" start --address="$MASTER_ADDR:$MASTER_PORT" "${common[@]}" ;;
  *) _pretrain_die "usage: ray_node.sh head|worker" ;;
esac
