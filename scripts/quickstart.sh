#!/usr/bin/env bash
# From a fresh clone to a trained model: installs the dependencies (Debian packages,
# idempotent), builds hpctrial, and trains the mlp example on 2 ranks of this machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${HPCTRIAL_BUILD_DIR:-$root/build}
work=$build_dir/quickstart

echo "==> installing dependencies (scripts/install-deps.sh)"
"$root/scripts/install-deps.sh"
echo "==> building hpctrial into $build_dir"
"$root/scripts/build.sh"
echo "==> $("$build_dir/cli/hpctrial" --version | head -n 1)"

echo "==> checking the example experiment"
"$build_dir/cli/hpctrial" config validate "$root/examples/mlp/experiment.yaml"

echo "==> writing a synthetic dataset into $work/data"
mkdir -p "$work"
cd "$work"
"$build_dir/examples/mlp/mlp_make_dataset" data

echo "==> training the mlp example on 2 ranks (mpirun -np 2)"
mpirun_args=(-np 2)
[[ $(nproc) -lt 2 ]] && mpirun_args+=(--oversubscribe)
if [[ $(id -u) -eq 0 ]]; then
  # Open MPI refuses to run as root unless told to.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
trial_dir=$work/runs/mlp
rm -rf "$trial_dir"
mpirun "${mpirun_args[@]}" "$build_dir/examples/mlp/mlp" \
  --config "$root/examples/mlp/experiment.yaml" --trial-dir "$trial_dir" --progress-seconds 2

echo
echo "The mlp example trained on 2 ranks. What it wrote:"
echo "  metrics (one JSON line per report):  $trial_dir/metrics.jsonl"
echo "  the effective config of the run:     $trial_dir/effective-config.yaml"
echo "Its last validation:"
grep '"kind":"validation"' "$trial_dir/metrics.jsonl" | tail -n 1
