#!/usr/bin/env bash
# From a fresh clone to a trial that was stopped and resumed: installs the dependencies (Debian
# packages, idempotent), builds what the example needs - the command, the worker, the trainer
# library and the mlp example (the tests are scripts/test.sh's) - and runs the mlp example with
# `hpctrial run` on 2 ranks of this machine: stops it part way with SIGINT (every rank
# checkpoints, exit 75), runs the same command again to resume it to the end, describes it and
# plots its metrics.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${HPCTRIAL_BUILD_DIR:-$root/build}
jobs=${HPCTRIAL_JOBS:-$(nproc)}
experiment=$build_dir/quickstart/mlp
started=$SECONDS

echo "==> installing dependencies (scripts/install-deps.sh)"
"$root/scripts/install-deps.sh"
echo "==> building the command, the worker and the mlp example into $build_dir"
cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE="${HPCTRIAL_BUILD_TYPE:-RelWithDebInfo}" >/dev/null
cmake --build "$build_dir" --parallel "$jobs" --target hpctrial hpctrial-worker mlp mlp_make_dataset
hpctrial=$build_dir/cli/hpctrial
echo "==> $("$hpctrial" --version | head -n 1)"

data=$build_dir/quickstart/data
echo "==> writing a synthetic dataset into $data"
"$build_dir/examples/mlp/mlp_make_dataset" "$data"
if [[ $(id -u) -eq 0 ]]; then
  # Open MPI refuses to run as root unless told to.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# The example's config names ./mlp and data/*.h5 beside it; here they are the build's.
run=("$hpctrial" run "$root/examples/mlp/experiment.yaml" --experiment "$experiment"
     --set "entrypoint=$build_dir/examples/mlp/mlp" --set "data.train=$data/train.h5"
     --set "data.validation=$data/validation.h5" --set searcher.max_length.batches=3000)
[[ $(nproc) -lt 2 ]] && run+=(--oversubscribe)
rm -rf "$experiment"

echo "==> training the mlp example on 2 ranks: ${run[*]}"
"${run[@]}" &
pid=$!
metrics=$experiment/trial-0/metrics.jsonl
# Stopped once it has validated twice: as Ctrl-C would, every rank checkpoints after its step.
until [[ $(grep -c '"kind":"validation"' "$metrics" 2>/dev/null) -ge 2 ]] || ! kill -0 "$pid" 2>/dev/null; do
  sleep 0.2
done
echo "==> stopping it (SIGINT)"
kill -INT "$pid" 2>/dev/null || true
status=0
wait "$pid" || status=$?
if [[ $status -eq 75 ]]; then
  echo "==> it stopped with exit code 75 after a durable checkpoint: running the same command resumes it"
elif [[ $status -ne 0 ]]; then
  echo "quickstart: the run failed with exit code $status; its logs are in $experiment/trial-0/logs" >&2
  exit "$status"
fi
"${run[@]}"

echo
echo "==> hpctrial describe $experiment"
"$hpctrial" describe "$experiment"
echo
echo "The trial's metrics (one JSON line per report) are in $metrics; its last validation:"
grep '"kind":"validation"' "$metrics" | tail -n 1
echo
echo "==> hpctrial plot $experiment"
"$hpctrial" plot "$experiment" -o "$experiment/plot.png" -o "$experiment/plot.svg"
echo "TensorBoard reads the event files in $experiment/trial-0/tensorboard (tensorboard --logdir $experiment)"
echo "quickstart took $((SECONDS - started)) s"
