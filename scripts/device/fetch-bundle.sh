#!/usr/bin/env bash
# Fetches, on a machine with a network, the packages that build and test hpctrial on a GPU
# machine that has no network: Ubuntu 24.04's Open MPI, parallel HDF5, yaml-cpp,
# Boost.Program_options, fmt, nlohmann-json, protobuf, libpng and GoogleTest, as .deb files in one
# folder, with their sums. scripts/device/run.sh unpacks them there, into a prefix of their own.
#   scripts/device/fetch-bundle.sh [FOLDER]       (default: .device-bundle in the repository)
# What the GPU machine is assumed to have already: Ubuntu 24.04 with a compiler (build-essential),
# a CMake of its own, Python 3 with PyTorch (its LibTorch), the CUDA toolkit and NCCL. The runtime libraries
# those depend on are left out; the rest of the packages' runtime closure is taken. The -dev
# packages are taken alone (their headers, CMake and pkg-config files, not what they depend on).
# Needs apt-get, dpkg-deb, gpg and curl; no root. Git ignores the default folder (.gitignore).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/.device-bundle}
mirror=${HPCTRIAL_UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
suite=noble
# The Ubuntu archive's keyring, by its sum; apt checks every index against it.
keyring_deb=pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb
keyring_sha256=36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8

# Libraries (and programs) hpctrial links or runs, with what they load; and the protobuf module
# with which the tests read TensorBoard's event files back.
runtime=(openmpi-bin libopenmpi3t64 libhdf5-openmpi-103-1t64 libyaml-cpp0.8 libboost-program-options1.83.0
         libfmt9 libprotobuf32t64 libprotobuf-lite32t64 libprotoc32t64 protobuf-compiler libpng16-16t64
         python3-protobuf)
# Headers and the files that find them, alone.
headers=(libopenmpi-dev libhdf5-openmpi-dev libyaml-cpp-dev libboost-program-options1.83-dev libboost1.83-dev
         libfmt-dev nlohmann-json3-dev libprotobuf-dev libpng-dev zlib1g-dev libgtest-dev libgmock-dev googletest)
# What the GPU machine has: not carried. (Its CMake is PyPI's, which brings no libraries.)
present=(build-essential python3)
# Pulled in only by plugins or programs hpctrial never loads (hwloc's OpenCL, X and PCI plugins,
# UCX's ROCm test, ssh for remote nodes and the account tools under it): 50 MB, mostly LLVM.
unused=(libllvm17t64 libamd-comgr2 libamdhip64-5 libhsa-runtime64-1 libhsakmt1 libdrm-amdgpu1 libdrm-common libdrm2
        libelf1t64 ocl-icd-libopencl1 libx11-6 libx11-data libxau6 libxcb1 libxdmcp6 libxext6 libxnvctrl0
        libhwloc-plugins libpciaccess0 openssh-client libfido2-1 libcbor0.10 libedit2 passwd adduser libpam0g
        libpam-modules libpam-modules-bin libsemanage-common libsemanage2 libsepol2 libaudit-common libaudit1
        libcap-ng0 libbsd0)

for tool in apt-get dpkg-deb gpg curl sha256sum; do
  command -v "$tool" >/dev/null || { echo "fetch-bundle: $tool is missing; install it (Debian: apt-get install $tool)" >&2; exit 1; }
done
work=$(mktemp -d "${TMPDIR:-/tmp}/hpctrial-bundle.XXXXXX")
trap 'rm -rf "$work"' EXIT
curl -fsS -o "$work/keyring.deb" "$mirror/$keyring_deb"
if [[ $(sha256sum <"$work/keyring.deb" | cut -d' ' -f1) != "$keyring_sha256" ]]; then
  echo "fetch-bundle: $mirror/$keyring_deb does not have the expected SHA-256 $keyring_sha256" >&2
  exit 1
fi
dpkg-deb -x "$work/keyring.deb" "$work/keyring"
keyring=$work/keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg

mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/parts" "$work/prefs"
touch "$work/status"
for s in "$suite" "$suite-updates" "$suite-security"; do
  echo "deb [arch=amd64 signed-by=$keyring] $mirror $s main universe"
done >"$work/sources.list"
apt=(apt-get -q -o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=$work/parts"
     -o "Dir::Etc::Preferences=$work/prefs/none" -o "Dir::Etc::PreferencesParts=$work/prefs"
     -o "Dir::State::Lists=$work/lists" -o "Dir::State::status=$work/status" -o "Dir::Cache=$work/cache"
     -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o APT::Install-Recommends=false
     -o Debug::NoLocking=true)
# As root, apt downloads as its own user, who cannot write into a private folder: it would warn.
[[ $(id -u) -eq 0 ]] && apt+=(-o APT::Sandbox::User=root)
echo "fetch-bundle: reading Ubuntu $suite's package lists from $mirror"
"${apt[@]}" update >/dev/null
# The packages an install onto an empty system would unpack, by name.
closure() { "${apt[@]}" -s install "$@" | awk '$1 == "Inst" { print $2 }' | sort -u; }
closure "${present[@]}" >"$work/present"
printf '%s\n' "${unused[@]}" | sort -u >"$work/unused"
{ closure "${runtime[@]}" | comm -23 - "$work/present" | comm -23 - "$work/unused"; printf '%s\n' "${headers[@]}"; } |
  sort -u >"$work/wanted"

rm -rf "$out.partial"
mkdir -p "$out.partial"
(cd "$out.partial" && xargs "${apt[@]}" download <"$work/wanted" >/dev/null)
(cd "$out.partial" && sha256sum ./*.deb >SHA256SUMS)
{
  echo "suite=$suite"
  echo "fetched=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$out.partial/BUNDLE"
rm -rf "$out"
mv "$out.partial" "$out"
echo "fetch-bundle: $(find "$out" -name '*.deb' | wc -l) packages, $(du -sh "$out" | cut -f1), in $out"
