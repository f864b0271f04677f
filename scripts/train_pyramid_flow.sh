#!/bin/bash
# Pyramid-Flow autoregressive temporal-pyramid fine-tuning of a released DiT (video sync groups):
# the original's scripts/train_pyramid_flow.sh. Usage, from the repository root (or with PAN_ROOT set to it):
#   sbatch scripts/train_pyramid_flow.sh [config.yaml] [train.py overrides...]
# The default YAML is the 384p run; config/pyramid_flow_ar_768p.yaml is its 768p sibling (gradient
# checkpointing on). Everything about the run is in the YAML; this header only owns the cluster side.
#SBATCH --job-name=pan-pyramid-flow-ar
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
# One node of 8 GPUs, as the original's GPUS=8 (a sync group of 8 on 8 ranks; fewer GPUs work with
# gradient_accumulation_steps: ranks x micro-batches must be a multiple of video_sync_group).
# `--exclude` takes known-bad nodes, e.g. `--exclude=node[017,042]`. Add `--gpus-per-node=8` where
# the cluster requires GPUs to be requested.
set -euo pipefail
export PAN_ROOT="${PAN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}" # sbatch runs a spool copy of this file
PAN_DEFAULT_CONFIG=config/pyramid_flow_ar_384p.yaml
source "$PAN_ROOT/scripts/_launch.sh" "$@"
