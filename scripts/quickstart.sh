#!/usr/bin/env bash
# From a fresh clone to a checked experiment: installs the dependencies (Debian packages,
# idempotent), builds hpctrial, and validates the example experiment.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${HPCTRIAL_BUILD_DIR:-$root/build}
example=$root/examples/linear_regression/experiment.yaml

echo "==> installing dependencies (scripts/install-deps.sh)"
"$root/scripts/install-deps.sh"
echo "==> building hpctrial into $build_dir"
"$root/scripts/build.sh"
hpctrial=$build_dir/cli/hpctrial

echo "==> $("$hpctrial" --version | head -n 1)"
echo "==> checking the example experiment"
"$hpctrial" config validate "$example"
echo
echo "hpctrial is built: $hpctrial"
echo "The example's effective config (template merged, defaults filled in):"
echo "  $hpctrial config show $example"
echo
echo "Training the example on this workstation needs hpctrial's trainer, which this version"
echo "does not include yet; 'hpctrial --help' lists what this version can do."
