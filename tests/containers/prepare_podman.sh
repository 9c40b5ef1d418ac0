#!/usr/bin/env bash
# Makes rootless Podman work for USER on this host, then builds the test image as USER
# (make_image.sh). Run as root. What it changes, only where it is missing:
# - USER, made as scripts/local-pbs.sh makes it (with its subuid and subgid ranges).
# - /dev/mqueue: `podman run --ipc=host` mounts the host's; a sandbox may not have one.
# - USER's containers.conf names runc where the host's cgroups are mixed v1 and v2 (no
#   /sys/fs/cgroup/cgroup.controllers), on which crun refuses to start a container.
# - USER's storage.conf names the overlay driver, where the kernel mounts overlays for ordinary
#   users (Linux 5.13 and later): without one, Podman 4.3 falls back to vfs, which copies the
#   whole image for every container it starts (seconds for each rank). Its storage starts empty.
#   prepare_podman.sh USER IMAGE PROGRAM[=PATH_IN_IMAGE]...
set -euo pipefail
user=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
# One at a time: the slurm tier's test and the benchmarks' smoke run may prepare at once.
exec 9>/tmp/hpctrial-prepare-podman.lock
flock 9
# The pbs tier's script may make the same user at the same moment.
id "$user" >/dev/null 2>&1 || useradd -m -s /bin/bash "$user" || id "$user" >/dev/null
if [[ ! -d /dev/mqueue ]] || ! mountpoint -q /dev/mqueue; then
  mkdir -p /dev/mqueue
  mount -t mqueue mqueue /dev/mqueue
fi
home=$(getent passwd "$user" | cut -d: -f6)
conf="$home/.config/containers/containers.conf"
if [[ ! -f /sys/fs/cgroup/cgroup.controllers && ! -f $conf ]]; then
  runuser -u "$user" -- mkdir -p "$(dirname "$conf")"
  printf '[engine]\nruntime = "runc"\n' | runuser -u "$user" -- tee "$conf" >/dev/null
fi
storage="$home/.config/containers/storage.conf"
as_user() { runuser -u "$user" -- env -i HOME="$home" PATH=/usr/local/bin:/usr/bin:/bin "$@"; }
kernel=$(uname -r)
major=${kernel%%.*}
minor=${kernel#*.}
minor=${minor%%.*}
if [[ ! -f $storage ]] && (( major > 5 || (major == 5 && minor >= 13) )); then
  (cd / && as_user podman system reset --force >/dev/null 2>&1) || true
  runuser -u "$user" -- mkdir -p "$(dirname "$storage")"
  printf '[storage]\ndriver = "overlay"\n' | runuser -u "$user" -- tee "$storage" >/dev/null
fi
cd /
as_user "$here/make_image.sh" "$@"
