#!/bin/bash
# Pyramid-Flow full-sequence (non-AR) fine-tuning of a released DiT: the original's
# scripts/train_pyramid_flow_without_ar.sh. Usage, from the repository root (or with PAN_ROOT set to it):
#   sbatch scripts/train_pyramid_flow_without_ar.sh [config.yaml] [train.py overrides...]
# The default YAML is the 384p video run; config/pyramid_flow_768p.yaml and
# config/pyramid_flow_image.yaml are its 768p video and image siblings. Everything about the run is
# in the YAML; this header only owns the cluster side.
#SBATCH --job-name=pan-pyramid-flow
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
# One node of 8 GPUs, as the original's GPUS=8; `--exclude` takes known-bad nodes, e.g.
# `--exclude=node[017,042]`. Add `--gpus-per-node=8` where the cluster requires GPUs to be requested.
set -euo pipefail
export PAN_ROOT="${PAN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}" # sbatch runs a spool copy of this file
PAN_DEFAULT_CONFIG=config/pyramid_flow_384p.yaml
source "$PAN_ROOT/scripts/_launch.sh" "$@"
