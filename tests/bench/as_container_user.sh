#!/usr/bin/env bash
# Runs COMMAND as the ordinary user whose rootless Podman holds IMAGE, built first from PROGRAM
# (tests/containers/prepare_podman.sh): a benchmark's container side, from the root that runs the
# test suite. Exit 77 (skipped) where this is not root or Podman is not installed.
#   as_container_user.sh IMAGE PROGRAM -- COMMAND [ARG ...]
set -euo pipefail
image=$1
program=$2
shift 3
user=${HPCTRIAL_CONTAINER_USER:-pbsuser}
if [[ $(id -u) -ne 0 ]] || ! command -v podman >/dev/null; then
  echo "skipped: needs root (to run as $user) and podman (scripts/install-deps.sh)"
  exit 77
fi
"$(dirname "$0")/../containers/prepare_podman.sh" "$user" "$image" "$program"
home=$(getent passwd "$user" | cut -d: -f6)
cd /
exec runuser -u "$user" -- env -i HOME="$home" USER="$user" LOGNAME="$user" PATH=/usr/local/bin:/usr/bin:/bin \
  LANG=C.UTF-8 "$@"
