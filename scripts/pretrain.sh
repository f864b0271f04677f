#!/bin/bash
# Pretraining. Usage, from the repository root (or with PAN_ROOT set to it):
#   sbatch scripts/pretrain.sh [config.yaml] [train.py overrides...]
# Everything about the run is in the YAML; this header only owns the cluster side.
#SBATCH --job-name=pan-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --exclude=
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@300   # 5 min before the time limit: save, then requeue (scripts/_launch.sh)
#SBATCH --requeue
#SBATCH --open-mode=append     # a requeued job appends to the same output file
##SBATCH --partition=<partition>
##SBATCH --qos=<qos>
##SBATCH --account=<account>
# `--nodes=1` is for debugging; `--exclude` takes known-bad nodes, e.g. `--exclude=node[017,042]`.
# `--exclusive` gives the job every GPU and core of its nodes; add `--gpus-per-node=8` where the
# cluster requires GPUs to be requested explicitly.
set -euo pipefail
export PAN_ROOT="${PAN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}" # sbatch runs a spool copy of this file
PAN_DEFAULT_CONFIG=config/pretrain_29B_720p.yaml
source "$PAN_ROOT/scripts/_launch.sh" "$@"
