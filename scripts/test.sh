#!/usr/bin/env bash
# Installs the dependencies, builds hpctrial, and runs every test tier with CTest:
# unit, mpi (under mpirun with 2 and 4 ranks), integration (the real hpctrial command and
# mpirun), slurm (a real local Slurm cluster), pbs (a real local OpenPBS, built from its source
# once per machine by scripts/local-pbs.sh) and gpu (skipped where no GPU is visible).
# Extra arguments go to ctest, e.g. `scripts/test.sh -L unit` or `scripts/test.sh -R Config`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${HPCTRIAL_BUILD_DIR:-$root/build}

"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
# A munged that was killed leaves its socket, and PMIx then spends 2.3 s in every mpirun retrying
# it; the slurm tier needs munged anyway.
"$root/scripts/local-slurm.sh" munge
cd "$build_dir"
# Each test asks CTest for the cores it keeps busy (cmake/HpctrialTesting.cmake); the two more
# slots are for the slurm and pbs tiers, whose tests mostly wait on their scheduler.
ctest --output-on-failure --parallel "${HPCTRIAL_JOBS:-$(($(nproc) + 2))}" --timeout 600 "$@"
