#!/usr/bin/env bash
# The installed tree: `cmake --install` into a temporary prefix, then, with nothing set but a
# plain PATH, the installed hpctrial runs, a project of one's own configures against the
# exported CMake package, and the modulefiles load in a real Lmod (the Lua one, and the Tcl one
# for Environment Modules), and, with nothing but `module load hpctrial`, the stand-alone
# example builds and trains 2 ranks and `hpctrial new-trial` writes it renamed, and the projects of
# `new-trial --engine` and `--pipeline` build and train; most of it again, at the same time, in a
# second install moved after it was installed. No build path may remain in what
# was installed.
#   install_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fail() { echo "install_test: $*" >&2; exit 1; }
# A user's plain shell. Debian's `getconf PATH` is /bin:/usr/bin, which leads CMake to packages
# through the /lib usrmerge link: the user flow runs with that PATH too.
user_path=/usr/local/bin:/usr/bin:/bin
clean() { env -i HOME="$HOME" PATH="$user_path" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$@"; }

check_prefix() {
  local prefix=$1
  for f in bin/hpctrial bin/hpctrial-worker include/hpctrial/trainer.h include/hpctrial/build_config.h \
           lib/cmake/hpctrial/hpctrialConfig.cmake lib/cmake/hpctrial/hpctrialTargets.cmake; do
    [[ -e $prefix/$f ]] || fail "$prefix/$f was not installed"
  done
  local version
  version=$(clean "$prefix/bin/hpctrial" --version) || fail "the installed hpctrial --version failed"
  grep -q '^hpctrial [0-9]' <<<"$version" || fail "unexpected --version output: $version"
  # Every installed program and library finds hpctrial's libraries relative to itself.
  local elf
  for elf in "$prefix"/bin/* "$prefix"/lib/libhpctrial_*.so.*; do
    [[ -L $elf ]] && continue
    if readelf -d "$elf" | grep -E 'R(UN)?PATH' | grep -qF "$build"; then
      fail "$elf keeps the build directory in its RPATH"
    fi
  done
  if grep -rqF "$build" "$prefix/lib/cmake/hpctrial"; then fail "the CMake package names the build directory"; fi
  # The modulefiles, each loaded by Lmod in a clean shell; the Tcl one alone as well.
  local lmod=/usr/share/lmod/lmod/init/bash modules=$prefix/share/modulefiles/hpctrial version
  [[ -r $lmod ]] || fail "no Lmod at $lmod (scripts/install-deps.sh installs it)"
  version=$(basename "$(ls "$modules"/*.lua)" .lua)
  [[ -f $modules/$version ]] || fail "no Tcl modulefile $modules/$version"
  [[ $(echo "puts [info complete [read [open {$modules/$version}]]]" | tclsh) == 1 ]] || fail "the Tcl modulefile is not complete Tcl"
  local flavour loaded
  for flavour in lua tcl; do
    [[ $flavour == tcl ]] && mv "$modules/$version.lua" "$work/hidden.lua"
    # Also: the manual pages through MANPATH, the Python readers through PYTHONPATH, and the
    # completion through bash-completion's own loader (XDG_DATA_DIRS).
    loaded=$(clean bash -c "source $lmod; module use '$prefix/share/modulefiles' && module load hpctrial &&
                            echo \"root=\$HPCTRIAL_ROOT cmake=\$CMAKE_PREFIX_PATH\" && hpctrial --version &&
                            echo \"man=\$(man -w hpctrial-run)\" && man -P cat hpctrial-run 2>/dev/null | grep -m1 -o 'hpctrial run EXP.yaml' &&
                            python3 -c 'import hpctrial_metrics, hpctrial_checkpoint; print(\"python=\" + hpctrial_metrics.__file__)' &&
                            source /usr/share/bash-completion/bash_completion && __load_completion hpctrial &&
                            COMP_WORDS=(hpctrial lo) COMP_CWORD=1 && _hpctrial && echo \"complete=\${COMPREPLY[*]}\"" 2>&1) ||
      fail "module load hpctrial ($flavour) failed: $loaded"
    [[ $flavour == tcl ]] && mv "$work/hidden.lua" "$modules/$version.lua"
    grep -qxF "root=$prefix cmake=$prefix" <<<"$loaded" || fail "the $flavour modulefile set: $loaded"
    grep -q '^hpctrial [0-9]' <<<"$loaded" || fail "hpctrial did not run after module load ($flavour): $loaded"
    grep -qxF "man=$prefix/share/man/man1/hpctrial-run.1" <<<"$loaded" || fail "man hpctrial-run ($flavour): $loaded"
    grep -qxF "hpctrial run EXP.yaml" <<<"$loaded" || fail "man hpctrial-run shows no synopsis ($flavour): $loaded"
    grep -qxF "python=$prefix/share/hpctrial/python/hpctrial_metrics.py" <<<"$loaded" ||
      fail "the Python readers are not on PYTHONPATH ($flavour): $loaded"
    grep -qxF "complete=logs" <<<"$loaded" || fail "bash completion ($flavour): $loaded"
  done
  # A project of one's own finds the package.
  mkdir -p "$work/project"
  cat >"$work/project/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.18)
project(user_project CXX)
find_package(hpctrial 0.1 CONFIG REQUIRED)
foreach(t trainer core checkpoint comm launcher slurm pbs)
  if(NOT TARGET hpctrial::${t})
    message(FATAL_ERROR "no hpctrial::${t}")
  endif()
endforeach()
message(STATUS "hpctrial found in ${hpctrial_DIR}")
CMAKE
  rm -rf "$work/project/build"
  clean cmake -S "$work/project" -B "$work/project/build" -DCMAKE_PREFIX_PATH="$prefix" >"$work/configure.log" 2>&1 ||
    { cat "$work/configure.log"; fail "find_package(hpctrial) failed against $prefix"; }
  grep -qF "hpctrial found in $prefix/lib/cmake/hpctrial" "$work/configure.log" ||
    { cat "$work/configure.log"; fail "the package was found elsewhere than $prefix"; }
}

# The installed stand-alone example, with nothing set but `module load hpctrial`, builds against
# the prefix and trains 2 ranks.
build_and_run_example() {
  local prefix=$1 check_renamed=$2 project=$work/standalone
  rm -rf "$project"
  cp -r "$prefix/share/hpctrial/examples/standalone" "$project"
  local steps="source /usr/share/lmod/lmod/init/bash && module use '$prefix/share/modulefiles' && module load hpctrial"
  if ! clean bash -c "$steps && cmake -S '$project' -B '$project/build' && cmake --build '$project/build'" \
       >"$work/example.log" 2>&1; then
    cat "$work/example.log"
    fail "the stand-alone example did not build against $prefix"
  fi
  clean bash -c "$steps && cd '$project' && hpctrial run experiment.yaml" >"$work/run.log" 2>&1 ||
    { cat "$work/run.log"; fail "the stand-alone example did not run"; }
  [[ -f $project/runs/my-trial/trial-0/checkpoints/ckpt-300.h5 ]] ||
    { cat "$work/run.log"; fail "the stand-alone example left no final checkpoint"; }
  grep -q "starting 2 rank(s)" "$work/run.log" || { cat "$work/run.log"; fail "the example did not run 2 ranks"; }
  # `hpctrial new-trial` writes from every prefix the project it wrote from the first one, and
  # that project is the stand-alone example just built and trained, its names renamed (its own
  # build would compile the same source again).
  rm -rf "$work/demo"
  clean bash -c "$steps && hpctrial new-trial demo_trial --dir '$work/demo'" >"$work/new.log" 2>&1 ||
    { cat "$work/new.log"; fail "hpctrial new-trial failed from $prefix"; }
  diff -r "$tmp/demo-written" "$work/demo" >"$work/new.diff" ||
    { cat "$work/new.diff"; fail "hpctrial new-trial from $prefix wrote another project than from the first prefix"; }
  if [[ $check_renamed == yes ]]; then
    local source renamed
    for source in "$prefix/share/hpctrial/examples/standalone"/*; do
      renamed=$(basename "$source"); renamed=$work/demo/${renamed/my_trial/demo_trial}
      [[ -f $renamed ]] || fail "hpctrial new-trial wrote no $renamed for $source"
      sed 's/my_trial/demo_trial/g; s/MyTrial/DemoTrial/g; s/my-trial/demo-trial/g' "$source" |
        diff - "$renamed" >"$work/new.diff" ||
        { cat "$work/new.diff"; fail "$renamed is not $source renamed"; }
    done
    [[ $(ls "$work/demo" | wc -l) == $(ls "$prefix/share/hpctrial/examples/standalone" | wc -l) ]] ||
      fail "hpctrial new-trial wrote other files than the stand-alone example's: $(ls "$work/demo")"
  fi
  # The centre's defaults in PREFIX/etc/hpctrial/site.yaml reach every config the command reads.
  mkdir -p "$prefix/etc/hpctrial"
  printf 'scheduler: {type: slurm, partition: centre-gpu, account: centre-acct}\n' >"$prefix/etc/hpctrial/site.yaml"
  local shown
  shown=$(clean bash -c "$steps && hpctrial submit '$project/experiment.yaml' --dry-run" 2>&1) ||
    fail "hpctrial submit --dry-run with the site's defaults failed: $shown"
  grep -q '^#SBATCH --partition=centre-gpu$' <<<"$shown" || fail "the site's defaults did not reach the script: $shown"
  grep -q '^#SBATCH --account=centre-acct$' <<<"$shown" || fail "the site's account did not reach the script: $shown"
  rm "$prefix/etc/hpctrial/site.yaml"
}

# What `hpctrial new-trial NAME --TEMPLATE` writes builds and trains as its experiment says:
#   build_and_run_template PREFIX TEMPLATE NAME LINE   (LINE: what the run's log must say)
# --engine: an engine trial with ZeRO-2; --pipeline: a model in 2 pipeline stages.
build_and_run_template() {
  local prefix=$1 template=$2 name=$3 line=$4 project=$work/$2
  local steps="source /usr/share/lmod/lmod/init/bash && module use '$prefix/share/modulefiles' && module load hpctrial"
  rm -rf "$project"
  if ! clean bash -c "$steps && hpctrial new-trial $name --$template --dir '$project' && cd '$project' &&
                      cmake -S . -B build && cmake --build build && hpctrial run experiment.yaml" >"$project.log" 2>&1; then
    cat "$project.log"
    fail "the project of hpctrial new-trial --$template did not build and run"
  fi
  [[ -f $project/runs/${name//_/-}/trial-0/checkpoints/ckpt-300.h5 ]] ||
    { cat "$project.log"; fail "the --$template project left no final checkpoint"; }
  grep -qF "$line" "$project.log" || { cat "$project.log"; fail "the --$template project did not train as its experiment says"; }
}

# Installed twice: one prefix used where it was installed, one moved after its install.
cmake --install "$build" --prefix "$tmp/first" >/dev/null
cmake --install "$build" --prefix "$tmp/installed" >/dev/null
mv "$tmp/installed" "$tmp/moved"
clean "$tmp/first/bin/hpctrial" new-trial demo_trial --dir "$tmp/demo-written" >/dev/null ||
  fail "hpctrial new-trial failed from $tmp/first"
in_place() {
  check_prefix "$tmp/first"
  build_and_run_example "$tmp/first" yes
  build_and_run_template "$tmp/first" engine big_model \
    "engine: train_batch_size 64 = micro-batch 16 x 2 accumulation step(s) x 2 rank(s)"
}
moved() {
  check_prefix "$tmp/moved"
  build_and_run_example "$tmp/moved" no
  build_and_run_template "$tmp/moved" pipeline deep_model \
    "engine: train_batch_size 64 = micro-batch 16 x 4 accumulation step(s) x 1 replica(s) of 2 pipeline stages"
  user_path=/bin:/usr/bin
  check_prefix "$tmp/moved"
  build_and_run_example "$tmp/moved" no
}
# The two prefixes at once (each build is one translation unit, one core), each in a work
# directory of its own; a failure shows that chain's output.
pids=()
for chain in in_place moved; do
  mkdir "$tmp/work-$chain"
  (work=$tmp/work-$chain; "$chain") >"$tmp/$chain.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in 0 1; do
  chain=$([[ $i == 0 ]] && echo in_place || echo moved)
  wait "${pids[$i]}" || { cat "$tmp/$chain.log" >&2; failed=1; }
done
[[ $failed == 0 ]] || exit 1
echo "install_test: in place and after a move, with PATH /usr/local/bin:/usr/bin:/bin and /bin:/usr/bin: installed, run, found by CMake and Lmod; the stand-alone example and the engine project of new-trial built and trained, new-trial's plain project the example renamed"
