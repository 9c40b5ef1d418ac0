#!/usr/bin/env bash
# Installs, by Debian package name, everything hpctrial's build, tests and quickstart need.
# Idempotent: silent and quick when every package is already present; runs `apt-get update`
# once, and only when something is missing.
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake pkg-config ccache git
  # LibTorch (CPU), with OpenBLAS as its BLAS (Debian's default, the reference BLAS, is about
  # ten times slower); Open MPI; parallel HDF5
  libtorch-dev libopenblas0-pthread openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools
  # configuration, command line, formatting, JSON
  libyaml-cpp-dev libboost-program-options-dev libfmt-dev nlohmann-json3-dev
  # TensorBoard event files (protobuf messages, PNG images); `hpctrial plot` (PLplot, its cairo
  # driver for PNG and SVG)
  libprotobuf-dev protobuf-compiler libpng-dev libplplot-dev plplot-driver-cairo
  # tests and benchmarks (valgrind: harness_overhead --instructions counts them with callgrind)
  libgtest-dev libgmock-dev libbenchmark-dev shellcheck valgrind
  # the integration tier: a real local Slurm cluster
  slurmctld slurmd slurm-client munge
  # the install tier: modulefiles loaded by a real Lmod (Environment Modules conflicts with it in
  # Debian; its Tcl modulefile is loaded by Lmod and read by tclsh)
  lmod tcl
  # the manual pages, written from the command's help texts; bash completion's loader (the
  # install tier finds hpctrial's completion through it)
  help2man bash-completion
  # `hpctrial report`'s test opens each page in a real browser, headless
  chromium
  # containers (environment.image): rootless Podman with runc, which runs on the hosts whose
  # cgroups are mixed v1 and v2, where crun refuses to
  podman runc uidmap
  # reference comparisons (PyTorch DDP baseline, reading checkpoints from Python)
  python3 python3-torch python3-h5py
  # reading TensorBoard event files back in tests
  python3-protobuf
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "install-deps: these packages are missing and installing them needs root: ${missing[*]}" >&2
    echo "install-deps: run this script as root, or ask your administrator to install them." >&2
    exit 1
  fi
fi

echo "install-deps: installing ${#missing[@]} package(s): ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
