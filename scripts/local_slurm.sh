#!/bin/bash
# A real one-node Slurm cluster on this machine, for testing the launch scripts (tests and CI).
#
#   scripts/local_slurm.sh start <base-dir>   # start munged, slurmctld, slurmd; wait until the node is idle
#   scripts/local_slurm.sh env   <base-dir>   # print `export SLURM_CONF=...` (every client command needs it)
#   scripts/local_slurm.sh stop  <base-dir>   # cancel jobs, stop the daemons by PID
#
# Everything (config, keys, sockets, state, logs) lives under <base-dir>; nothing in /etc is touched,
# so several clusters on one machine do not collide (each picks its own free ports). `start` prints
# the export line on stdout, so `eval "$(scripts/local_slurm.sh start /tmp/x)"` works.
# Needs Debian's slurmctld, slurmd, slurm-client and munge (.ci/install_slurm.sh); run as root.
set -eEuo pipefail  # -E: the ERR trap in cmd_start also fires inside functions

usage() {
  echo "usage: $0 start|stop|env <base-dir>" >&2
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
  local base=$1 host ctld_host node_addr="" mem_mb ctld_port slurmd_port
  host=$(hostname -s)
  ctld_host=$host
  # Without a resolvable hostname the daemons cannot find each other by name: pin loopback.
  if ! getent hosts "$host" >/dev/null; then
    ctld_host="$host(127.0.0.1)"
    node_addr="NodeAddr=127.0.0.1"
  fi
  # slurmd marks the node invalid if RealMemory exceeds what it finds, so leave 1 GiB of headroom.
  ctld_port=$(free_port)
  slurmd_port=$(free_port)
  while ((slurmd_port == ctld_port)); do slurmd_port=$(free_port); done
  mem_mb=$(awk '/^MemTotal:/ { m = int($2 / 1024) - 1024; print (m > 1 ? m : 1) }' /proc/meminfo)
  cat >"$base/etc/slurm.conf" <<EOF
ClusterName=panlocal
SlurmctldHost=$ctld_host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
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
# Finished jobs leave the controller after 4 s; otherwise \`sbatch --wait\` polls for up to 32 s.
MinJobAge=4
StateSaveLocation=$base/state
SlurmdSpoolDir=$base/spool
SlurmctldPidFile=$base/run/slurmctld.pid
SlurmdPidFile=$base/run/slurmd.pid
SlurmctldLogFile=$base/log/slurmctld.log
SlurmdLogFile=$base/log/slurmd.log
NodeName=$host $node_addr CPUs=$(nproc) RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
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
  local state=""
  for _ in $(seq 150); do
    state=$(sinfo -h -N -o %t 2>/dev/null || true)
    [[ $state == idle ]] && return 0
    sleep 0.2
  done
  log "node not idle after 30 s (state: '${state:-no answer}'); logs in $1/log:"
  tail -n 20 "$1"/log/*.log >&2 || true
  return 1
}

cmd_start() {
  local base=$1
  if [[ -e $base/etc/slurm.conf ]]; then
    log "$base already holds a cluster; stop it first or use a new folder"
    return 1
  fi
  mkdir -p "$base"/{etc,log,run,state,spool,munge}
  chmod 700 "$base/munge"
  # The munge socket path must fit in a unix socket address (108 bytes).
  if ((${#base} > 80)); then
    log "base dir path too long for the munge socket: $base"
    return 1
  fi
  write_slurm_conf "$base"
  export SLURM_CONF=$base/etc/slurm.conf
  # Whatever fails below, leave no daemon behind.
  trap 'log "start failed; stopping"; cmd_stop "$base"' ERR
  start_munged "$base"
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  wait_until_idle "$base"
  trap - ERR
  log "cluster up under $base"
  cmd_env "$base"
}

cmd_env() {
  printf 'export SLURM_CONF=%q\n' "$1/etc/slurm.conf"
}

# Wait up to ~10 s for a PID to exit after SIGTERM, then SIGKILL it.
stop_pid_file() {
  local pid_file=$1 pid
  [[ -s $pid_file ]] || return 0
  pid=$(<"$pid_file")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pid_file"
}

cancel_jobs() {
  local jobs
  jobs=$(squeue -h -o %i 2>/dev/null || true)
  [[ -n $jobs ]] || return 0
  log "cancelling jobs: $(echo $jobs)"
  scancel $jobs 2>/dev/null || true
  for _ in $(seq 50); do
    [[ -z $(squeue -h -o %i 2>/dev/null || true) ]] && return 0
    sleep 0.2
  done
}

cmd_stop() {
  local base=$1
  export SLURM_CONF=$base/etc/slurm.conf
  [[ -e $SLURM_CONF && -s $base/run/slurmctld.pid ]] && cancel_jobs
  # Order matters: slurmd reports to slurmctld, and both authenticate through munged.
  stop_pid_file "$base/run/slurmd.pid"
  stop_pid_file "$base/run/slurmctld.pid"
  stop_pid_file "$base/munge/munged.pid"
}

[[ $# == 2 ]] || usage
base=$(realpath -m "$2")
case $1 in
  start) cmd_start "$base" ;;
  stop) cmd_stop "$base" ;;
  env) cmd_env "$base" ;;
  *) usage ;;
esac
