# shellcheck shell=bash
# Shared by the stand-ins for PBS's commands in the integration tier, which runs without a PBS
# server (the pbs tier runs against a real OpenPBS; docs/pbs.md says what each covers). State
# lives in $FAKE_PBS_DIR: calls (every command line, one per line), next (the last job number),
# and per job ID.state (Q, H, R, F), ID.script (what qsub was given), ID.pid (the job's login
# shell, the leader of its session, written by the test that runs it), ID.stime and ID.env (the
# -v variables' values). A file server-down makes qstat fail as it does when the server cannot
# be reached; a file qsub-down does the same to qsub.
set -euo pipefail
dir=${FAKE_PBS_DIR:?FAKE_PBS_DIR is not set}
record() { printf '%s\n' "$*" >>"$dir/calls"; }
known() { [[ -f $dir/$1.state ]] || { echo "$2: Unknown Job Id $1" >&2; exit 153; }; }
