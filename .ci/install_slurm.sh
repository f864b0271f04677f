#!/bin/bash
# Install what the launch-script tests need: what scripts/local_slurm.sh runs (Debian 12's Slurm
# 22.05 and munge) and shellcheck (the scripts are linted). Idempotent: does nothing when the
# programs are already there. CI runs it as root; elsewhere it uses sudo.
# The packages' services are not started here: local_slurm.sh runs private daemons under a temp dir.
set -euo pipefail

needed=(slurmctld slurmd munged sbatch srun scontrol sinfo shellcheck)
missing=()
for prog in "${needed[@]}"; do
  command -v "$prog" >/dev/null || [[ -x /usr/sbin/$prog ]] || missing+=("$prog")
done
if ((${#missing[@]} == 0)); then
  echo "install_slurm: already installed (slurmctld $(dpkg-query -W -f='${Version}' slurmctld))"
  exit 0
fi
echo "install_slurm: missing ${missing[*]}; installing"

sudo_cmd=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "install_slurm: run as root or install sudo" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
"${sudo_cmd[@]}" apt-get update
"${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge shellcheck
echo "install_slurm: installed (slurmctld $(dpkg-query -W -f='${Version}' slurmctld))"
