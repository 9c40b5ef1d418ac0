#!/usr/bin/env bash
# Builds a container image offline, from this machine's own files: a root filesystem holding the
# given programs (at the paths they have here, or at PATH_IN_IMAGE), every library they and Open
# MPI's plugins load (ldd's closure, at the paths they have here), Open MPI's and PMIx's data, and
# the loader's cache, imported with `podman import`. The image has what the ranks need inside,
# and nothing of a distribution.
#   make_image.sh IMAGE PROGRAM[=PATH_IN_IMAGE]...
# Run it as the user whose podman storage should hold the image.
set -euo pipefail
image=$1
shift
rootfs=$(mktemp -d "${TMPDIR:-/tmp}/hpctrial-rootfs.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT
chmod 755 "$rootfs"
cd /  # cp --parents keeps each folder's attributes from the path as given
# Debian's merged /usr: /lib is /usr/lib, as here.
mkdir -p "$rootfs/usr/lib" "$rootfs/usr/lib64" "$rootfs/usr/bin" "$rootfs/usr/sbin" "$rootfs/tmp" "$rootfs/etc"
ln -s usr/lib "$rootfs/lib"
ln -s usr/lib64 "$rootfs/lib64"
ln -s usr/bin "$rootfs/bin"
ln -s usr/sbin "$rootfs/sbin"
chmod 1777 "$rootfs/tmp"

multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
plugins=()
for dir in "/usr/lib/$multiarch/openmpi" "/usr/lib/$multiarch/pmix2"; do
  [[ -d $dir ]] && plugins+=("$dir")
done
programs=()
for arg in "$@"; do programs+=("${arg%%=*}"); done
objects=("${programs[@]}" /bin/sh)
while IFS= read -r -d '' so; do objects+=("$so"); done < <(find "${plugins[@]}" -name '*.so' -print0)

# Each object and each library it loads, at the path the loader finds it under.
declare -A seen=()
for object in "${objects[@]}"; do
  while read -r path; do seen[$path]=1; done < <(ldd "$object" 2>/dev/null | grep -o '/[^ ]*' || true)
done
# The same files as the image holds (by path, size and time): nothing to build.
key=$(for path in "${!seen[@]}" "${programs[@]}" "$@"; do echo "$path"; stat -L -c '%s %Y' "$path" 2>/dev/null || true; done |
  LC_ALL=C sort | sha256sum | cut -c1-32)
if [[ $(podman image inspect --format '{{index .Labels "hpctrial.files"}}' "$image" 2>/dev/null) == "$key" ]]; then
  echo "$image"
  exit 0
fi
copy() { cp -L --parents "$1" "$rootfs"; }
for path in "${!seen[@]}"; do copy "$path"; done
copy /bin/sh
for arg in "$@"; do
  if [[ $arg == *=* ]]; then
    mkdir -p "$rootfs$(dirname "${arg#*=}")"
    cp -L "${arg%%=*}" "$rootfs${arg#*=}"
  else
    copy "$arg"
  fi
done
for dir in "${plugins[@]}" /usr/share/openmpi /usr/share/pmix /etc/openmpi /etc/pmix; do
  [[ -e $dir ]] && cp -a --parents "$dir" "$rootfs"
done
cp /etc/ld.so.cache "$rootfs/etc/"
previous=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
tar -C "$rootfs" -cf - . | podman import -q --change "LABEL hpctrial.files=$key" - "$image" >/dev/null
# The image this tag named before is left untagged (1.6 GB of layers of its own each): removed,
# or every rebuild of the tests keeps one more, until the disk is full. Kept if a container
# still uses it.
if [[ -n $previous && $previous != "$(podman image inspect --format '{{.Id}}' "$image")" ]]; then
  podman rmi "$previous" >/dev/null 2>&1 || true
fi
echo "$image"
