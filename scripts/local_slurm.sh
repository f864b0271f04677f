#!/bin/bash
# A real Slurm cluster on this machine, for testing the launch scripts (tests and CI).
#
#   scripts/local_slurm.sh start <base-dir> [nodes]  # munged, slurmctld and `nodes` slurmd (default 1)
#   scripts/local_slurm.sh env   <base-dir>          # print `export SLURM_CONF=...` (every client needs it)
#   scripts/local_slurm.sh stop  <base-dir>          # cancel jobs, stop the daemons by PID
#
# Everything (config, keys, sockets, state, logs) lives under <base-dir>; nothing in /etc is touched,
# so several clusters on one machine do not collide (each picks its own free ports). `start` prints
# the export line on stdout, so `eval "$(scripts/local_slurm.sh start /tmp/x)"` works.
# Each node is its own slurmd on this host (named pan0, pan1, ..., address 127.0.0.1), so a
# multi-node job really runs one task per node, each with its own SLURM_NODEID. Every node reports
# all of this machine's CPUs and memory; jobs are not confined (no cgroups) anyway.
# Needs Debian's slurmctld, slurmd, slurm-client and munge (.ci/install_slurm.sh); run as root.
set -eEuo pipefail # -E: the ERR trap in cmd_start also fires inside functions

usage() {
  echo "usage: $0 start <base-dir> [nodes] | stop <base-dir> | env <base-dir>" >&2
  exit 2
}

log() { echo "local_slurm: $*" >&2; }

# A TCP port nothing listens on: connecting to it is refused. (Racy in theory, fine for tests.)
free_port() {
  local port
  for _ in $(seq 200); do
    port=$((20000 + RANDOM % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return 0
    fi
  done
  log "no free TCP port found"
  return 1
}

write_slurm_conf() {
  local base=$1 nodes=$2 host ctld_host mem_mb port i
  local ports=() node_lines=""
  host=$(hostname -s)
  ctld_host=$host
  # Without a resolvable hostname the daemons cannot find the controller by name: pin loopback.
  getent hosts "$host" >/dev/null || ctld_host="$host(127.0.0.1)"
  # slurmd marks a node invalid if RealMemory exceeds what it finds, so leave 1 GiB of headroom.
  mem_mb=$(awk '/^MemTotal:/ { m = int($2 / 1024) - 1024; print (m > 1 ? m : 1) }' /proc/meminfo)
  # One port for slurmctld, one per slurmd, all different.
  while ((${#ports[@]} < nodes + 1)); do
    port=$(free_port)
    [[ " ${ports[*]} " == *" $port "* ]] || ports+=("$port")
  done
  for ((i = 0; i < nodes; i++)); do
    node_lines+="NodeName=pan$i NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[i + 1]}"
    node_lines+=" CPUs=$(nproc) RealMemory=$mem_mb State=UNKNOWN"$'\n'
  done
  cat >"$base/etc/slurm.conf" <<EOF
ClusterName=panlocal
SlurmctldHost=$ctld_host
SlurmctldPort=${ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$base/munge/munge.sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# Finished jobs leave the controller after 4 s; otherwise sbatch --wait polls for up to 32 s.
MinJobAge=4
StateSaveLocation=$base/state
SlurmdSpoolDir=$base/spool/%n
SlurmctldPidFile=$base/run/slurmctld.pid
SlurmdPidFile=$base/run/slurmd-%n.pid
SlurmctldLogFile=$base/log/slurmctld.log
SlurmdLogFile=$base/log/slurmd-%n.log
${node_lines}PartitionName=debug Nodes=pan[0-$((nodes - 1))] Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munged() {
  local m=$1/munge
  dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 status=none
  chmod 400 "$m/munge.key"
  munged --force --key-file="$m/munge.key" --socket="$m/munge.sock" --pid-file="$m/munged.pid" \
    --log-file="$1/log/munged.log" --seed-file="$m/munged.seed"
}

wait_until_idle() {
  local base=$1 nodes=$2 states=""
  for _ in $(seq 150); do
    states=$(sinfo -h -N -o %t 2>/dev/null | sort | uniq -c | xargs || true)
    [[ $states == "$nodes idle" ]] && return 0
    sleep 0.2
  done
  log "nodes not idle after 30 s (states: '${states:-no answer}'); logs in $base/log:"
  tail -n 20 "$base"/log/*.log >&2 || true
  return 1
}

cmd_start() {
  local base=$1 nodes=$2 i
  [[ $nodes =~ ^[1-9][0-9]*$ ]] || usage
  # The munge socket path must fit in a unix socket address (108 bytes).
  if ((${#base} > 80)); then
    log "base dir path too long for the munge socket: $base"
    return 1
  fi
  if [[ -e $base/etc/slurm.conf ]]; then
    log "$base already holds a cluster; stop it first or use a new folder"
    return 1
  fi
  mkdir -p "$base"/{etc,log,run,state,spool,munge}
  chmod 700 "$base/munge"
  write_slurm_conf "$base" "$nodes"
  export SLURM_CONF=$base/etc/slurm.conf
  # Whatever fails below, leave no daemon behind.
  trap 'log "start failed; stopping"; cmd_stop "$base"' ERR
  start_munged "$base"
  slurmctld -f "$SLURM_CONF"
  for ((i = 0; i < nodes; i++)); do
    slurmd -f "$SLURM_CONF" -N "pan$i"
  done
  wait_until_idle "$base" "$nodes"
  trap - ERR
  log "cluster of $nodes node(s) up under $base"
  cmd_env "$base"
}

cmd_env() {
  printf 'export SLURM_CONF=%q\n' "$1/etc/slurm.conf"
}

pid_alive() {
  [[ -s $1 ]] && kill -0 "$(<"$1")" 2>/dev/null
}

# SIGTERM every PID in the given pid files, wait up to ~10 s for them to exit, then SIGKILL.
stop_pid_files() {
  local pid_file pids=()
  for pid_file in "$@"; do
    [[ -s $pid_file ]] || continue
    pids+=("$(<"$pid_file")")
  done
  ((${#pids[@]})) || return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 50); do
    any_alive "${pids[@]}" || break
    sleep 0.2
  done
  if any_alive "${pids[@]}"; then
    log "SIGKILL after 10 s: ${pids[*]}"
    kill -9 "${pids[@]}" 2>/dev/null || true
  fi
  # A daemon removes its own pid file on a clean exit; a stale one must not name a reused PID later.
  rm -f "$@"
}

any_alive() {
  local pid
  for pid in "$@"; do
    kill -0 "$pid" 2>/dev/null && return 0
  done
  return 1
}

cancel_jobs() {
  local jobs
  jobs=$(squeue -h -o %i 2>/dev/null | xargs || true)
  [[ -n $jobs ]] || return 0
  log "cancelling jobs: $jobs"
  # shellcheck disable=SC2086  # one job id per word
  scancel $jobs 2>/dev/null || true
  for _ in $(seq 50); do
    [[ -z $(squeue -h -o %i 2>/dev/null || true) ]] && return 0
    sleep 0.2
  done
}

cmd_stop() {
  local base=$1
  export SLURM_CONF=$base/etc/slurm.conf
  if pid_alive "$base/run/slurmctld.pid"; then
    cancel_jobs
  fi
  # Slurm's daemons authenticate through munged while they shut down, so it goes last. (Each
  # daemon takes ~2 s to exit; stopping slurmd and slurmctld together halves the wait.)
  stop_pid_files "$base"/run/slurmd-*.pid "$base/run/slurmctld.pid"
  stop_pid_files "$base/munge/munged.pid"
}

[[ $# == 2 || ($# == 3 && $1 == start) ]] || usage
base=$(realpath -m "$2")
case $1 in
  start) cmd_start "$base" "${3:-1}" ;;
  stop) cmd_stop "$base" ;;
  env) cmd_env "$base" ;;
  *) usage ;;
esac
