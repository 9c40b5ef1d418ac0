#!/usr/bin/env bash
# Makes rootless Podman work for USER on this host, then builds the test image as USER
# (make_image.sh). Run as root. What it changes, only where it is missing:
# - USER, made as scripts/local-pbs.sh makes it (with its subuid and subgid ranges).
# - /dev/mqueue: `podman run --ipc=host` mounts the host's; a sandbox may not have one.
# - USER's containers.conf names runc where the host's cgroups are mixed v1 and v2 (no
#   /sys/fs/cgroup/cgroup.controllers), on which crun refuses to start a container.
#   prepare_podman.sh USER IMAGE PROGRAM[=PATH_IN_IMAGE]...
set -euo pipefail
user=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
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
cd /
runuser -u "$user" -- env -i HOME="$home" PATH=/usr/local/bin:/usr/bin:/bin podman rmi -f "$1" >/dev/null 2>&1 || true
runuser -u "$user" -- env -i HOME="$home" PATH=/usr/local/bin:/usr/bin:/bin "$here/make_image.sh" "$@"
