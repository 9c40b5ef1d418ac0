#!/usr/bin/env bash
# Builds and tests hpctrial on a GPU machine that has no network: Ubuntu 24.04 with a compiler,
# CMake, the CUDA toolkit, NCCL and PyTorch (whose LibTorch hpctrial builds against), but no Open
# MPI, HDF5, yaml-cpp, Boost, fmt, protobuf or GoogleTest. Those come in the bundle that
# scripts/device/fetch-bundle.sh fetched beforehand, unpacked here into a prefix of their own.
#   scripts/device/run.sh [BUNDLE [RESULTS]]
# BUNDLE: the bundle's folder (default .device-bundle in the repository). RESULTS: where the logs
# go (default $OUT when set, else build-device/results): versions.txt, configure.log, build.log,
# gpu.log, mpi.log, summary.txt. Exit status: 0 when both tiers pass.
# Environment: HPCTRIAL_DEPS_PREFIX (default /tmp/hpctrial-deps), HPCTRIAL_TORCH_PREFIX (LibTorch's
# CMake prefix; default PyTorch's, from python3), HPCTRIAL_BUILD_DIR (default build-device),
# HPCTRIAL_JOBS (default every core), HPCTRIAL_DEVICE_TIERS (default "gpu mpi"; a tier without
# tests fails).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bundle=$(cd "${1:-$root/.device-bundle}" && pwd)
results=${2:-${OUT:-$root/build-device/results}}
deps=${HPCTRIAL_DEPS_PREFIX:-/tmp/hpctrial-deps}
build=${HPCTRIAL_BUILD_DIR:-$root/build-device}
jobs=${HPCTRIAL_JOBS:-$(nproc)}
mkdir -p "$results"
summary=$results/summary.txt
: >"$summary"
say() { echo "device: $*" | tee -a "$summary"; }
fail() { say "FAILED: $*"; exit 1; }
started=$SECONDS

# 1. The bundle, checked and unpacked.
[[ -f $bundle/SHA256SUMS ]] || fail "$bundle has no SHA256SUMS: fetch the bundle first (scripts/device/fetch-bundle.sh)"
(cd "$bundle" && sha256sum --quiet -c SHA256SUMS) || fail "a package in $bundle does not match its sum in SHA256SUMS"
rm -rf "$deps"
mkdir -p "$deps"
for deb in "$bundle"/*.deb; do dpkg-deb -x "$deb" "$deps"; done
usr=$deps/usr
multiarch=x86_64-linux-gnu
# The links the packages' installation would make (Debian's alternatives: mpicc, mpirun, h5pcc,
# libpsm_infinipath.so.1), read from their postinst scripts, under the prefix.
for deb in "$bundle"/*.deb; do dpkg-deb -I "$deb" postinst 2>/dev/null || true; done |
  sed -e ':a' -e '/\\$/{N;s/\\\n//;ba}' | { grep -o -e '--\(install\|slave\)\([[:space:]]\+[^[:space:]]\+\)\{3\}' || true; } |
  while read -r _ link _ target; do
    if [[ -e $deps$target && ! -e $deps$link ]]; then
      mkdir -p "$(dirname "$deps$link")"
      ln -s "$deps$target" "$deps$link"
    fi
  done
# A -dev package's link to a library this machine has (libz.so -> libz.so.1.3), to this machine's.
while IFS= read -r -d '' link; do
  name=$(basename "$(readlink "$link")")
  if [[ -e /usr/lib/$multiarch/$name ]]; then ln -sf "/usr/lib/$multiarch/$name" "$link"; fi
done < <(find "$usr/lib" -xtype l -print0)
# HDF5's compiler wrapper names its own prefix, and the libraries a static link needs (-lcurl,
# -lcrypto: their -dev packages are not carried); a shared link needs none of them.
sed -i -e "s|^prefix=\"/usr\"|prefix=\"$usr\"|" -e 's|^H5BLD_LIBS=.*|H5BLD_LIBS="-ldl -lm"|' "$usr/bin/h5pcc.openmpi"
export HDF5_USE_SHLIB=yes
export PATH=$usr/bin:$PATH
export LD_LIBRARY_PATH=$usr/lib/$multiarch:$usr/lib/$multiarch/openmpi/lib:$usr/lib/$multiarch/hdf5/openmpi:$usr/lib/$multiarch/pmix2/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The tests read TensorBoard's event files back with the bundle's protobuf module.
export PYTHONPATH=$usr/lib/python3/dist-packages${PYTHONPATH:+:$PYTHONPATH}
# Open MPI and PMIx find their plugins and data under the prefix they were moved to.
export OPAL_PREFIX=$usr PMIX_PREFIX=$usr/lib/$multiarch/pmix2
export PMIX_MCA_mca_base_component_path=$usr/lib/$multiarch/pmix2/lib/pmix
# mpirun refuses to start without a remote shell on its PATH, even for ranks on this machine
# alone, which it never uses one for; the bundle carries none.
command -v ssh >/dev/null || command -v rsh >/dev/null || export OMPI_MCA_plm_rsh_agent=false
[[ $(id -u) -eq 0 ]] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say "unpacked $(find "$bundle" -name '*.deb' | wc -l) packages into $deps ($((SECONDS - started)) s)"

# 2. Every library the bundle's programs and libraries load is there or on this machine (plugins
# for hardware this machine has no use for aside).
missing=$(find "$usr/bin" "$usr/lib/$multiarch" -type f \( -perm -u+x -o -name '*.so*' \) \
            -not -path '*/hwloc/*' -not -path '*/ucx/*' -not -path '*/libfabric/*' -print0 |
          { xargs -0 ldd 2>/dev/null || true; } | awk '/not found/ { print $1 }' | sort -u | tr '\n' ' ')
[[ -z $missing ]] || fail "libraries the bundle needs and neither it nor this machine has: $missing"

# 3. LibTorch, CUDA and NCCL as this machine has them.
torch_prefix=${HPCTRIAL_TORCH_PREFIX:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)}
[[ -n $torch_prefix && -d $torch_prefix ]] ||
  fail "no LibTorch: python3 cannot import torch; set HPCTRIAL_TORCH_PREFIX to LibTorch's CMake prefix"
nccl=()
nccl_dir=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
if [[ -n $nccl_dir && -f $nccl_dir/include/nccl.h ]]; then
  nccl=(-DNCCL_INCLUDE_DIR="$nccl_dir/include" -DNCCL_LIBRARY="$(find "$nccl_dir/lib" -name 'libnccl.so*' | sort | head -n 1)")
fi
{
  echo "machine: $(uname -srm), $(nproc) cores"
  grep PRETTY_NAME /etc/os-release || true
  "${CXX:-c++}" --version | head -n 1
  cmake --version | head -n 1
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())'
  echo "LibTorch: $torch_prefix"
  echo "NCCL: ${nccl[*]:-from the CUDA toolkit}"
  echo "bundle: $(tr '\n' ' ' <"$bundle/BUNDLE")"
} >"$results/versions.txt" 2>&1 || true

# 4. The build: the GPU machine's CUDA and NCCL, the bundle's libraries, no PLplot.
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
phase=$SECONDS
rm -f "$build/CMakeCache.txt"  # what an earlier configure found elsewhere is not kept
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHPCTRIAL_PLOT=OFF \
      -DCMAKE_PREFIX_PATH="$usr;$torch_prefix" -DMPI_C_COMPILER="$usr/bin/mpicc" \
      -DMPI_CXX_COMPILER="$usr/bin/mpicxx" -DHDF5_C_COMPILER_EXECUTABLE="$usr/bin/h5pcc" "${nccl[@]}" \
      >"$results/configure.log" 2>&1 || fail "configure (see configure.log)"
grep -- "-- hpctrial " "$results/configure.log" | tee -a "$summary" || true
cmake --build "$build" --parallel "$jobs" >"$results/build.log" 2>&1 || fail "build (see build.log)"
say "configured and built in $((SECONDS - phase)) s on $jobs cores"

# 5. The gpu and mpi tiers.
status=0
for tier in ${HPCTRIAL_DEVICE_TIERS:-gpu mpi}; do
  phase=$SECONDS
  if (cd "$build" && ctest -L "^$tier\$" --output-on-failure --timeout 300 -j 4 --no-tests=error) >"$results/$tier.log" 2>&1; then
    say "$tier tier: $(grep -E 'tests passed' "$results/$tier.log" | tail -n 1) ($((SECONDS - phase)) s)"
  else
    status=1
    say "$tier tier FAILED: $(grep -E 'tests passed' "$results/$tier.log" | tail -n 1) ($((SECONDS - phase)) s; see $tier.log)"
  fi
done
say "done in $((SECONDS - started)) s"
exit "$status"
