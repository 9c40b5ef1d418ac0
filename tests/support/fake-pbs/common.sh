# shellcheck shell=bash
# Shared by the stand-ins for PBS's commands in the tests (no PBS server exists on these
# machines; docs/pbs.md says what was and was not tested against a real one). State lives in
# $FAKE_PBS_DIR: calls (every command line, one per line), next (the last job number), and per
# job ID.state (Q, H, R, F), ID.script (what qsub was given), ID.pid (the job's shell, written by
# the test that runs it), ID.stime and ID.env (the -v variables' values). A file server-down
# makes qstat fail as it does when the server cannot be reached.
set -euo pipefail
dir=${FAKE_PBS_DIR:?FAKE_PBS_DIR is not set}
record() { printf '%s\n' "$*" >>"$dir/calls"; }
known() { [[ -f $dir/$1.state ]] || { echo "$2: Unknown Job Id $1" >&2; exit 153; }; }
