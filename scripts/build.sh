#!/usr/bin/env bash
# Configures and builds hpctrial into build/ (or $HPCTRIAL_BUILD_DIR) with a job a core
# (or $HPCTRIAL_JOBS). Used by quickstart.sh and test.sh; assumes install-deps.sh has run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${HPCTRIAL_BUILD_DIR:-$root/build}
jobs=${HPCTRIAL_JOBS:-$(nproc)}

cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE="${HPCTRIAL_BUILD_TYPE:-RelWithDebInfo}" >/dev/null
cmake --build "$build_dir" --parallel "$jobs"
