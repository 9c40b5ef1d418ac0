#!/usr/bin/env bash
# Writes the manual pages of the hpctrial command from its own help texts, with help2man:
# hpctrial(1) from `hpctrial --help`, and hpctrial-VERB(1) from `hpctrial VERB --help` for each
# verb `hpctrial --help` lists (its summary there is the page's NAME line).
#   make_man_pages.sh HPCTRIAL OUT_DIR VERSION HELP2MAN
set -euo pipefail
program=$1 out=$2 version=$3 help2man=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$out"
mkdir -p "$out"
page() {  # page NAME SUMMARY COMMAND...
  local name=$1 summary=$2
  shift 2
  # help2man names the page after the program it runs: a script of that name runs the verb,
  # with "usage:", its further lines and the headings ("options:") written as help2man knows them.
  {
    printf '#!/bin/bash\n'
    printf ' %q' "$@"
    printf ' "$@" | sed -e %q -e %q -e %q\n' 's/^usage:/Usage:/' 's/^       hpctrial /   or: hpctrial /' \
      's/^\([a-z][a-z ]*\):$/\u\1:/'
  } >"$work/$name"
  chmod +x "$work/$name"
  "$help2man" --no-info --no-discard-stderr --section=1 --version-string="$version" \
    --name="$summary" --output="$out/$name.1" "$work/$name"
}
page hpctrial "train LibTorch C++ trials on Slurm and PBS: configs, checkpoints, pause and resume" "$program"
"$program" --help | sed -n '/^verbs:/,/^$/s/^  \([a-z][a-z-]*\)  *\(.*\)$/\1 \2/p' |
  while read -r verb summary; do
    page "hpctrial-$verb" "$summary" "$program" "$verb"
  done
[[ -f $out/hpctrial-run.1 ]] || { echo "make_man_pages: no page for 'hpctrial run'" >&2; exit 1; }
