# shellcheck shell=bash
# Shared body of pan's launch scripts (scripts/pretrain.sh, scripts/sft.sh, ...): sourced, not run.
#
# A wrapper is a Slurm header, the repository root and a default YAML, then one source line:
#   export PAN_ROOT="${PAN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
#   PAN_DEFAULT_CONFIG=config/<run>.yaml
#   source "$PAN_ROOT/scripts/_launch.sh" "$@"
# Arguments: [config.yaml] [train.py overrides...]. Under Slurm it runs one torchrun per node with
# srun; without SLURM_JOB_ID it runs one single-node torchrun here.
#
# Exit status: the ranks' own, not torchrun's 1 for any failure. Each node runs torchrun through
# `python -m pan.launch_command torchrun`, which exits with the status of the first rank that failed
# (of those that failed in the same second, the highest); the job (and `sbatch --wait`, and the
# ExitCode sacct shows) ends with it:
#   0    finished
#   1    failed: a crash, non-finite losses, a lost peer, a rank killed by a signal (read the log)
#   2    refused launch or unreadable run: config, data, resume, output_dir held by another run
#        (do not retry until it is fixed)
#   3    hang: the watchdog ended every rank, their stacks are in the log (retry)
#   143  stopped by SIGTERM (preemption, time limit, scancel, USR1 below with PAN_REQUEUE=0) after
#        every rank saved the step it stopped at, or during the start-up before anything was
#        trained or saved (requeue: the next launch resumes from the last checkpoint)
# Several nodes: the job's status is the highest of the nodes' (srun's rule: 143 > 3 > 2 > 1 > 0,
# and a node killed by a signal makes it 128 + the signal, e.g. 137). Refusals, hangs and SIGTERM
# saves are decided by all ranks together (a refusal is raised on every rank, the watchdog ends every
# rank, every rank saves the same step), so every node reports the same status and it is the job's.
# When one node fails alone, srun ends the others (--kill-on-bad-exit: SIGTERM to their step): they
# report 1 (a rank killed by that SIGTERM, or one whose step cannot finish without its peers), so the
# first node's status stands, unless they outlive Slurm's KillWait: then they are SIGKILLed and the
# job reports 137.
#
# Environment it reads (all optional):
#   PAN_ROOT            repository root (default: the Slurm submit dir, else the current dir)
#   CONDA_ENV           conda env to activate where conda exists (default: pan)
#   PAN_PYTHON          python interpreter to use instead of conda's (e.g. a venv's bin/python)
#   PAN_NPROC_PER_NODE  processes per node (default: visible GPUs, or 1 on a CPU node)
#   PAN_TRAIN_SCRIPT    the script torchrun starts (default: train.py)
#   MASTER_PORT         rendezvous port on the first node (default: 29500)
#   PAN_REQUEUE         1 (default): after Slurm's warning signal (USR1) the run saves and the job
#                       requeues itself (unless the ranks' status is 0 or 2: finished, refused);
#                       0: it saves and exits 143 (resubmit it yourself)
#   HF_HOME, PAN2_CACHE_ROOT, WANDB_PROJECT, WANDB_RUN_ID, WANDB_API_KEY
set -euo pipefail

pan_die() {
  echo "pan launch: $*" >&2
  exit 2
}

# ---- repository and arguments ----------------------------------------------------------------
# Under sbatch this file's caller runs from a spool copy, so the repo is never found from a script path.
PAN_ROOT="${PAN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
cd "$PAN_ROOT"
[[ -n "${PAN_DEFAULT_CONFIG:-}" ]] || pan_die "PAN_DEFAULT_CONFIG is not set; source this file from a launch script"
pan_config="$PAN_DEFAULT_CONFIG"
if [[ $# -gt 0 && ( "$1" == *.yaml || "$1" == *.yml ) ]]; then
  pan_config="$1"
  shift
fi
pan_train_script="${PAN_TRAIN_SCRIPT:-train.py}"
[[ -f "$pan_config" ]] || pan_die "config '$pan_config' not found under $PAN_ROOT; submit from the repository root or set PAN_ROOT"
[[ -f "$pan_train_script" ]] || pan_die "'$pan_train_script' not found under $PAN_ROOT; submit from the repository root or set PAN_ROOT"

# ---- python environment ----------------------------------------------------------------------
if [[ -n "${PAN_PYTHON:-}" ]]; then
  pan_python="$PAN_PYTHON"
else
  if command -v conda >/dev/null; then
    set +u # conda's hook and activation scripts read unset variables
    eval "$(conda shell.bash hook)"
    conda activate "${CONDA_ENV:-pan}"
    set -u
  fi
  pan_python="$(command -v python || command -v python3)" || pan_die "no python on PATH; set PAN_PYTHON or CONDA_ENV"
fi

# ---- Hugging Face and kernel caches ----------------------------------------------------------
export HF_HOME="${HF_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/huggingface}"
export HF_HUB_OFFLINE=1 # compute nodes have no network
: "${USER:=$(id -un)}"
# Triton and Inductor are node-local; point PAN2_CACHE_ROOT at shared storage so every node reuses
# the expensive FA4 and quack autotuning results (minutes per GEMM shape).
export TRITON_CACHE_DIR="/tmp/triton_${USER}"
export TORCHINDUCTOR_CACHE_DIR="/tmp/inductor_${USER}"
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="${PAN2_CACHE_ROOT:-$HOME/.cache/pan2}/fa4_cute_dsl"
export QUACK_CACHE_DIR="${PAN2_CACHE_ROOT:-$HOME/.cache/pan2}/quack"
# Weights & Biases: WANDB_PROJECT, WANDB_RUN_ID and WANDB_API_KEY come from the submitting shell
# (srun passes the environment on); never write a key into a script.

# ---- processes per node -----------------------------------------------------------------------
pan_count_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then # set but empty: no GPU visible
    local ids
    IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
    echo "${#ids[@]}"
  elif command -v nvidia-smi >/dev/null; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}
pan_gpus=$(pan_count_gpus)
if [[ -n "${PAN_NPROC_PER_NODE:-}" ]]; then
  GPUS_PER_NODE="$PAN_NPROC_PER_NODE"
elif ((pan_gpus > 0)); then
  GPUS_PER_NODE="$pan_gpus"
else
  GPUS_PER_NODE=1
fi

# ---- EFA / NCCL networking: normally stays as it is ------------------------------------------
# Only on GPU nodes (NCCL ignores these on CPU anyway). A value already set by the cluster wins.
if ((pan_gpus > 0)); then
  export FI_PROVIDER="${FI_PROVIDER:-efa}"
  export FI_EFA_USE_DEVICE_RDMA="${FI_EFA_USE_DEVICE_RDMA:-1}"
  export FI_EFA_FORK_SAFE="${FI_EFA_FORK_SAFE:-1}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  # NIC pinning: keep NCCL's socket and bootstrap traffic off loopback and container bridges.
  export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker,veth}"
fi
# ---- end of networking block ------------------------------------------------------------------

# ---- rendezvous ---------------------------------------------------------------------------------
export MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  mapfile -t pan_hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  # Rank 0's node by the address Slurm itself uses for it (its name on most clusters).
  pan_node_addr=$(scontrol show node "${pan_hosts[0]}" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2 || true)
  export MASTER_ADDR="${pan_node_addr:-${pan_hosts[0]}}"
  pan_nnodes="$SLURM_NNODES"
else
  export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
  pan_nnodes=1
fi

# ---- launch -----------------------------------------------------------------------------------
# Every argument but --node_rank, which each node fills in for itself.
pan_torchrun_args=(
  --nnodes="$pan_nnodes" --nproc_per_node="$GPUS_PER_NODE"
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT"
  "$pan_train_script" --config "$pan_config" "$@"
)
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  # Single quotes: each srun task expands its own SLURM_NODEID. --cpu-bind=none lets the workers
  # and their loader threads use every core of the node.
  # shellcheck disable=SC2016
  pan_cmd=(
    srun --ntasks-per-node=1 --nodes="$SLURM_NNODES" --kill-on-bad-exit=1 --cpu-bind=none
    bash -c 'exec "$0" -m pan.launch_command torchrun --node_rank="$SLURM_NODEID" "$@"'
    "$pan_python" "${pan_torchrun_args[@]}"
  )
else
  pan_cmd=("$pan_python" -m pan.launch_command torchrun --node_rank=0 "${pan_torchrun_args[@]}")
fi

echo "pan launch: job ${SLURM_JOB_ID:-local} on ${pan_nnodes} node(s) x ${GPUS_PER_NODE} process(es), master ${MASTER_ADDR}:${MASTER_PORT}"
echo "pan launch: config $pan_config, python $pan_python, repository $PAN_ROOT"
echo "pan launch: W&B project=${WANDB_PROJECT:-unset} run_id=${WANDB_RUN_ID:-unset} api_key=$([[ -n "${WANDB_API_KEY:-}" ]] && echo set || echo unset)"
# Print the command as one could paste it: plain words bare, anything else single-quoted.
pan_quote() {
  local arg
  for arg in "$@"; do
    if [[ "$arg" =~ ^[][A-Za-z0-9_./=:,@%+-]+$ ]]; then
      printf '%s ' "$arg"
    else
      printf "'%s' " "${arg//\'/\'\\\'\'}"
    fi
  done
}
echo "pan launch: $(pan_quote "${pan_cmd[@]}")"

# ---- warning before the time limit: save, then requeue ------------------------------------------
# Submitted with `--signal=B:USR1@<seconds>` (and `--requeue`), Slurm sends USR1 to this shell that
# long before the time limit. The ranks then get SIGTERM (scancel --signal=TERM reaches every
# process of the job's steps, as a preemption does): each finishes its step, the run saves it and
# exits 143; then this job requeues itself and its next run resumes from that checkpoint.
pan_warned=0
# shellcheck disable=SC2317 # run by the trap below
pan_on_warning() {
  pan_warned=1
  echo "pan launch: warning signal (USR1: time limit or preemption ahead): every rank saves and stops"
  scancel --signal=TERM "$SLURM_JOB_ID" || true
}
# A SIGTERM to this shell (scancel, preemption, the time limit) reaches the ranks too: they save and
# stop. This shell waits for them, so that the job ends with their status (143), not killed by it.
# shellcheck disable=SC2317 # run by the trap below
pan_on_sigterm() {
  echo "pan launch: SIGTERM (scancel, preemption or the time limit): waiting for the ranks to save and stop"
}
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  trap pan_on_warning USR1
  trap pan_on_sigterm TERM
fi

set +e
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  # In the background, so that the trap runs while it trains (a foreground command defers it).
  "${pan_cmd[@]}" &
  pan_child=$!
  wait "$pan_child"
  pan_rc=$?
  while kill -0 "$pan_child" 2>/dev/null; do # a trapped signal ends `wait` early
    wait "$pan_child"
    pan_rc=$?
  done
else
  "${pan_cmd[@]}" # in the foreground: Ctrl-C reaches torchrun
  pan_rc=$?
fi
set -e
echo "pan launch: the ranks' status is $pan_rc"
# A run that finished, or was refused, is not requeued: the next run would do nothing or be refused.
if ((pan_warned && pan_rc != 0 && pan_rc != 2)) && [[ -n "${SLURM_JOB_ID:-}" && "${PAN_REQUEUE:-1}" == 1 ]]; then
  echo "pan launch: requeueing job $SLURM_JOB_ID: its next run resumes from the checkpoint just saved"
  if scontrol requeue "$SLURM_JOB_ID"; then
    exit 0 # Slurm ends this run of the job and queues it again
  fi
  echo "pan launch: the job cannot be requeued (submit with --requeue); resubmit it to resume" >&2
fi
exit "$pan_rc"
