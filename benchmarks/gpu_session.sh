#!/usr/bin/env bash
# The first GPU hour of issue 19 in one command: every GPU check, results as JSON.
#
#   bash benchmarks/gpu_session.sh [--out DIR] [--budget SECONDS]   # on one GPU (sized for < 8 min on an H200)
#   bash benchmarks/gpu_session.sh --dry-run                        # the same steps on the CPU
#
# Writes DIR/session.json (default benchmarks/results/gpu_session/); see benchmarks/gpu_session.py
# for the steps. PYTHON picks the interpreter (default: the repo's .venv, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec "$PYTHON" -m benchmarks.gpu_session "$@"
