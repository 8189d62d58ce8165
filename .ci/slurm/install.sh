#!/usr/bin/env bash
# Install Slurm (slurmctld, slurmd, the client commands) and MUNGE from Debian's packages,
# for tests/slurm/. Does nothing when sbatch, slurmctld, slurmd and munged are already there.
# Needs root (or passwordless sudo) and apt-get; otherwise says so and exits 1.
set -euo pipefail

have_all() {
    command -v sbatch && command -v slurmctld && command -v slurmd && command -v munged
} >/dev/null 2>&1
version() {  # sbatch --version wants a slurm.conf; ask the package manager instead
    dpkg-query -W -f='slurm ${Version}' slurm-client 2>/dev/null || echo "slurm"
    dpkg-query -W -f=', munge ${Version}' munge 2>/dev/null || true
}
# Debian puts munged in /usr/sbin, which a non-login root shell may not have on PATH.
export PATH="$PATH:/usr/sbin:/sbin"

if have_all; then
    echo "slurm: already installed ($(version))"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "slurm: cannot install slurm-wlm and munge: not root and no passwordless sudo" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "slurm: cannot install slurm-wlm and munge: no apt-get (install them by hand)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# The packages' postinst scripts try to start the services; without systemd or an init
# system they only warn, and tests/slurm starts its own daemons on a private config.
if ! { "${as_root[@]}" apt-get update -qq &&
       "${as_root[@]}" apt-get install -y -qq --no-install-recommends \
           slurm-wlm munge >/dev/null; }; then
    echo "slurm: apt-get could not install slurm-wlm and munge" >&2
    exit 1
fi
if ! have_all; then
    echo "slurm: slurm-wlm and munge installed, but sbatch/slurmctld/slurmd/munged not found" >&2
    exit 1
fi
echo "slurm: installed ($(version))"
