#!/bin/bash
# Causal video VAE training (Pyramid-Flow's two stages). Usage, from the repository root (or with
# PAN_ROOT set to it):
#   sbatch scripts/train_causal_video_vae.sh                                   # stage 1
#   sbatch scripts/train_causal_video_vae.sh config/causal_vae_stage2.yaml     # stage 2
#   sbatch scripts/train_causal_video_vae.sh [config.yaml] [train.py overrides...]
# `pan launch-command --workflow causal-video-vae --stage both` prints both, stage 2 chained after
# stage 1. Everything about the run is in the YAML; this header only owns the cluster side.
#SBATCH --job-name=pan-causal-vae
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
# One node of 8 GPUs is the original's setup; stage 2's context groups (context_size) sit inside a
# node. `--exclude` takes known-bad nodes; add `--gpus-per-node=8` where the cluster requires it.
set -euo pipefail
export PAN_ROOT="${PAN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}" # sbatch runs a spool copy of this file
PAN_DEFAULT_CONFIG=config/causal_vae_stage1.yaml
source "$PAN_ROOT/scripts/_launch.sh" "$@"
