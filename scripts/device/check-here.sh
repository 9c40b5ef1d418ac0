#!/usr/bin/env bash
# Runs scripts/device/run.sh here, as the GPU machine would, in a clean Ubuntu 24.04 root
# (debootstrap: a compiler, CMake, Ninja and Python, nothing of hpctrial's dependencies) with the
# bundle, this machine's LibTorch copied in for PyTorch's and its CUDA toolkit mounted: the
# bundle unpacks, the build finds everything in it, the mpi tier runs against the bundle's Open
# MPI, and the gpu tier's tests skip without a GPU.
#   scripts/device/check-here.sh [BUNDLE]   (as root; default bundle: .device-bundle)
# The root is kept in $HPCTRIAL_CHECK_ROOT (default /var/tmp/hpctrial-noble) for the next check;
# the results land in its /results.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
bundle=$(cd "${1:-$repo/.device-bundle}" && pwd)
chroot_dir=${HPCTRIAL_CHECK_ROOT:-/var/tmp/hpctrial-noble}
mirror=${HPCTRIAL_UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
[[ $(id -u) -eq 0 ]] || { echo "check-here: debootstrap and chroot need root" >&2; exit 1; }
command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
torch_config=$(find /usr/lib /usr/local/lib /opt -name TorchConfig.cmake -path '*cmake/Torch/*' 2>/dev/null | head -n 1)
[[ -n $torch_config ]] || { echo "check-here: no LibTorch here to stand in for PyTorch's (Debian: libtorch-dev)" >&2; exit 1; }

if [[ ! -x $chroot_dir/usr/bin/cmake ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # The keyring as fetch-bundle.sh checks it.
  deb=$(sed -n 's/^keyring_deb=//p' "$repo/scripts/device/fetch-bundle.sh")
  sum=$(sed -n 's/^keyring_sha256=//p' "$repo/scripts/device/fetch-bundle.sh")
  curl -fsS -o "$work/keyring.deb" "$mirror/$deb"
  [[ $(sha256sum <"$work/keyring.deb" | cut -d' ' -f1) == "$sum" ]] || { echo "check-here: $deb: wrong SHA-256" >&2; exit 1; }
  dpkg-deb -x "$work/keyring.deb" "$work/keyring"
  rm -rf "$chroot_dir"
  debootstrap --variant=minbase --components=main,universe \
    --keyring="$work/keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg" \
    --include=build-essential,cmake,ninja-build,python3 noble "$chroot_dir" "$mirror" \
    /usr/share/debootstrap/scripts/gutsy >/dev/null
  rm -rf "$work"  # the trap below replaces this one
fi

# This machine's LibTorch (its files and the libraries they load, where the root has none of its
# own) for PyTorch's.
torch_dir=$(dirname "$torch_config")
torch_files=("$torch_dir" "$(dirname "$torch_dir")/Caffe2" /usr/include/torch /usr/include/ATen /usr/include/c10
             /usr/include/caffe2)
for lib in /usr/lib/x86_64-linux-gnu/lib{torch,torch_cpu,c10,torch_global_deps,shm}.so*; do torch_files+=("$lib"); done
# Debian's LibTorch finds gflags and glog, whose headers it includes, beside it.
while read -r f; do [[ -f $f || -L $f ]] && torch_files+=("$f"); done < <(dpkg -L libgflags-dev libgflags2.2 libgoogle-glog-dev libgoogle-glog1 2>/dev/null)
# Whether PATH names a file in the root, following links as they resolve in there.
in_root() {
  local path=$1 target i
  for ((i = 0; i < 8; i++)); do
    [[ -L $chroot_dir$path ]] || break
    target=$(readlink "$chroot_dir$path")
    if [[ $target == /* ]]; then path=$target; else path=$(dirname "$path")/$target; fi
  done
  [[ -e $chroot_dir$path && ! -L $chroot_dir$path ]]
}
for f in "${torch_files[@]}"; do
  if [[ -e $f ]] && ! in_root "$f"; then
    rm -f "$chroot_dir$f"  # a link that names nothing in the root
    mkdir -p "$chroot_dir$(dirname "$f")"
    cp -a -L "$f" "$chroot_dir$f"
  fi
done
# The libraries it loads, where the loader looks (some live in folders of their own here, found
# through this machine's loader cache: OpenBLAS's libblas.so.3); the root's own are kept.
while read -r lib; do
  to=/usr/lib/x86_64-linux-gnu/$(basename "$lib")
  if ! in_root "$to"; then
    rm -f "$chroot_dir$to"
    cp -L "$lib" "$chroot_dir$to"
  fi
done < <(ldd /usr/lib/x86_64-linux-gnu/libtorch.so 2>/dev/null | grep -o '/[^ ]*')

# The tree as committed plus what is changed, the bundle, and the results.
rm -rf "$chroot_dir/src" "$chroot_dir/bundle" "$chroot_dir/results"
mkdir -p "$chroot_dir/src" "$chroot_dir/results"
(cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 cp -a --parents -t "$chroot_dir/src")
cp -a "$bundle" "$chroot_dir/bundle"
mounts=()
for m in proc sys dev dev/pts dev/shm; do
  mount --bind "/$m" "$chroot_dir/$m" && mounts=("$chroot_dir/$m" "${mounts[@]}")
done
trap 'for m in "${mounts[@]}"; do umount "$m"; done' EXIT
# This machine's CUDA toolkit (with NCCL), as the GPU machine has one: the gpu tier builds, and
# its tests skip without a GPU. Without one here, the mpi tier alone.
tiers="gpu mpi"
cuda=$(readlink -f /usr/local/cuda 2>/dev/null || true)
if [[ -n $cuda && -x $cuda/bin/nvcc ]]; then
  mkdir -p "$chroot_dir$cuda"
  mount --bind "$cuda" "$chroot_dir$cuda" && mounts=("$chroot_dir$cuda" "${mounts[@]}")
  ln -sfn "$cuda" "$chroot_dir/usr/local/cuda"
else
  tiers=mpi
fi
status=0
chroot "$chroot_dir" /usr/bin/env -i PATH=/usr/local/cuda/bin:/usr/bin:/bin HOME=/root HPCTRIAL_DEVICE_TIERS="$tiers" \
  HPCTRIAL_TORCH_PREFIX="$(dirname "$(dirname "$torch_dir")")" HPCTRIAL_BUILD_DIR=/build \
  HPCTRIAL_JOBS="${HPCTRIAL_JOBS:-$(nproc)}" /bin/bash /src/scripts/device/run.sh /bundle /results || status=$?
echo "check-here: the results are in $chroot_dir/results"
exit "$status"
