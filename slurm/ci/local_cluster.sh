#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for CI and the tests in tests/slurm/.
#
#   slurm/ci/local_cluster.sh up     # start munged (if none runs), slurmctld, slurmd c1 and c2
#   slurm/ci/local_cluster.sh down   # stop exactly the daemons `up` started (by the PIDs it recorded)
#   slurm/ci/local_cluster.sh env    # print `export SLURM_CONF=...` for the clients (sbatch, squeue, ...)
#
# Needs Debian's packages: apt-get install --no-install-recommends slurmctld slurmd slurm-client munge
# Runs as root without systemd and without cgroups (proctrack/linuxproc, task/none). Two slurmd on
# one host simulate two nodes: `NodeName=c1 ... Port=17001`, `NodeName=c2 ... Port=17002`, each
# started with `slurmd -N cX`; `%n` keeps their spool/pid/log paths apart. Nothing under /etc is
# written: the config lives in $PRETRAIN_SLURM_DIR and clients find it through SLURM_CONF.
#
# Knobs (environment): PRETRAIN_SLURM_DIR (default /tmp/pretrain-slurm), PRETRAIN_SLURM_PORT (base
# port: slurmctld on it, node i on base+i; default: a random free range in 20000-29999, so several
# clusters can coexist), PRETRAIN_SLURM_CPUS (CPUs per node, default: this machine's),
# PRETRAIN_SLURM_MEM_MB (memory per node, 4000).
set -euo pipefail

DIR=${PRETRAIN_SLURM_DIR:-/tmp/pretrain-slurm}
CONF=$DIR/slurm.conf
CPUS=${PRETRAIN_SLURM_CPUS:-$(nproc)}
MEM_MB=${PRETRAIN_SLURM_MEM_MB:-4000}
NODES=(c1 c2)
HOST=$(hostname -s)

die() { echo "local_cluster: $*" >&2; exit 1; }

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A base port P with P..P+#nodes free (nobody listening).
pick_ports() {
  local base i
  for _ in $(seq 50); do
    base=${PRETRAIN_SLURM_PORT:-$((20000 + RANDOM % 10000))}
    for ((i = 0; i <= ${#NODES[@]}; i++)); do port_busy $((base + i)) && continue 2; done
    CTLD_PORT=$base; NODE_PORT=$base; return
  done
  die "no free port range found (set PRETRAIN_SLURM_PORT)"
}

write_conf() {
  pick_ports
  mkdir -p "$DIR"/{state,spool,run,log}
  cat >"$CONF" <<EOF
# Written by slurm/ci/local_cluster.sh: two simulated nodes on $HOST.
ClusterName=pretrain-ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may only start again once the old job credential expired (default 20 min).
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups here: track processes by parentage, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
# Without a default each job would take all of a node's memory and the next one would wait.
DefMemPerCPU=$((MEM_MB / CPUS))
# No accounting daemon: finished jobs stay visible to scontrol show job for an hour.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=3600
JobRequeue=1
ReturnToService=2
InactiveLimit=0
KillWait=15
SlurmdTimeout=60
SchedulerParameters=sched_interval=2,bf_interval=2
EOF
  local i=1
  for n in "${NODES[@]}"; do
    echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((NODE_PORT + i)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN" >>"$CONF"
    i=$((i + 1))
  done
  echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
}

munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_ok; then
    echo "local_cluster: munged already running; using it (and leaving it running on down)"
    return
  fi
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge
  [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key missing (the munge package creates it)"
  runuser -u munge -- /usr/sbin/munged
  cp /run/munge/munged.pid "$DIR/run/munged.ours.pid"
  for _ in $(seq 50); do munge_ok && return; sleep 0.1; done
  die "munged did not come up"
}

# Our PID files: a daemon counts as ours only if its PID file is under $DIR/run and the process lives.
pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

up() {
  command -v slurmctld >/dev/null || die "slurmctld not installed (apt-get install --no-install-recommends slurmctld slurmd slurm-client munge)"
  if pid_alive "$DIR/run/slurmctld.pid"; then
    echo "local_cluster: already up ($CONF)"; print_env; return
  fi
  rm -rf "$DIR/state" "$DIR/spool" "$DIR/log"
  write_conf
  start_munge
  export SLURM_CONF=$CONF
  slurmctld -f "$CONF" -i
  for n in "${NODES[@]}"; do slurmd -f "$CONF" -N "$n"; done
  # Wait until both nodes registered and are idle (and our daemons are the ones answering).
  for _ in $(seq 150); do
    for f in slurmctld "${NODES[@]/#/slurmd-}"; do
      pid_alive "$DIR/run/$f.pid" || { sleep 0.5; pid_alive "$DIR/run/$f.pid"; } ||
        { tail -n 20 "$DIR"/log/*.log >&2; down; die "$f did not start (logs above, all under $DIR/log)"; }
    done
    if [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" -eq ${#NODES[@]} ]; then
      echo "local_cluster: up: ${NODES[*]} idle ($CONF)"; print_env; return
    fi
    sleep 0.2
  done
  sinfo -N -l >&2 || true
  tail -n 20 "$DIR"/log/*.log >&2 || true
  die "nodes did not become idle in 30 s (logs above, all under $DIR/log)"
}

stop_pidfile() {
  local f=$1 pid
  pid_alive "$f" || { rm -f "$f"; return; }
  pid=$(cat "$f")
  kill -TERM "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  rm -f "$f"
}

down() {
  [ -d "$DIR/run" ] || { echo "local_cluster: nothing to stop"; return; }
  # Cancel what is still queued or running first, so every job's slurmstepd finishes while its
  # slurmd is still there to hear from it (a stepd orphaned by a stopped slurmd lingers).
  if pid_alive "$DIR/run/slurmctld.pid"; then
    export SLURM_CONF=$CONF
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      echo "local_cluster: cancelling jobs $jobs"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 60); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
      sleep 1
    fi
  fi
  for n in "${NODES[@]}"; do stop_pidfile "$DIR/run/slurmd-$n.pid"; done
  stop_pidfile "$DIR/run/slurmctld.pid"
  stop_pidfile "$DIR/run/munged.ours.pid"
  echo "local_cluster: down"
}

print_env() { echo "export SLURM_CONF=$CONF"; }

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) print_env ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
