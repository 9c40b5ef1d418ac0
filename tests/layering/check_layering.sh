#!/usr/bin/env bash
# The folder rules of docs/architecture.md, checked on the built programs and on the sources:
#   - the hpctrial command loads no CUDA, NCCL or LibTorch (it starts fast on a login node);
#   - a rank (the trainer, hpctrial-worker) loads no scheduler library; the rank runtime
#     (rank/) no LibTorch and nothing of the trainer;
#   - the trainer's folders: data/, parallel/, state/, adaptive/ and observe/ never include the
#     loop (loop/) or the API's internals (api/);
#   - tests and benchmarks reach a library's internals only through its include path (for the
#     trainer: hpctrial_trainer_internal), never by a relative path into its src/;
#   - core/ in three floors: os/ < config/ (yaml-cpp private to it) < contract/; core names no
#     scheduler's options (each scheduler declares its own);
#   - the launcher uses no MPI C API, CUDA or NCCL; schedulers never LibTorch;
#   - the read model (view/) asks a scheduler only through core::Scheduler, and runs no rank code;
#   - nothing outside slurm/, pbs/ and the registry compares scheduler names;
#   - one process spawner (core/src/os/subprocess.cpp) and one atomic publisher (core/src/os/files.cpp);
#   - the experiment and trial directories' file and folder names spelled in one file
#     (core/src/contract/layout.cpp: core::ExperimentLayout, core::TrialLayout);
#   - MPI communicators are owned by comm::MpiComm, CUDA streams and events by comm's handles;
#   - no product source file over 500 lines; no function over 80 in launcher/, core/, cli/, rank/, view/,
#     trainer/ and comm/.
# usage: check_layering.sh SOURCE_DIR BUILD_DIR
set -u
src=$1
build=$2
failed=0
fail() { echo "FAIL: $*"; failed=1; }

needed() { ldd "$1" | awk '{print $1}'; }

cli=$build/cli/hpctrial
[[ -x $cli ]] || fail "no $cli"
for lib in libcudart libnccl libtorch libc10 libhpctrial_trainer libhpctrial_comm; do
  needed "$cli" | grep -q "^$lib" && fail "hpctrial loads $lib"
done

for rank_side in "$build/trainer/libhpctrial_trainer.so" "$build/trainer/hpctrial-worker"; do
  [[ -e $rank_side ]] || { fail "no $rank_side"; continue; }
  for lib in libhpctrial_slurm libhpctrial_pbs libhpctrial_launcher; do
    needed "$rank_side" | grep -q "^$lib" && fail "$(basename "$rank_side") loads $lib"
  done
done

rank_lib=$build/rank/libhpctrial_rank.so
[[ -e $rank_lib ]] || fail "no $rank_lib"
needed "$rank_lib" | grep -Eq '^lib(torch|c10|hpctrial_trainer|hpctrial_slurm|hpctrial_pbs|hpctrial_launcher)' &&
  fail "libhpctrial_rank loads LibTorch, the trainer, a scheduler or the launcher"

for scheduler in slurm pbs; do
  lib=$build/$scheduler/libhpctrial_$scheduler.so
  needed "$lib" | grep -Eq '^lib(torch|c10|cudart|nccl|mpi)' && fail "libhpctrial_$scheduler loads LibTorch, CUDA, NCCL or MPI"
done

# Sources: which headers each folder may include.
if grep -rEn '#include <(mpi|cuda_runtime|nccl|torch/)' "$src/launcher" "$src/cli" "$src/slurm" "$src/pbs" "$src/core" "$src/tensorboard" "$src/search" "$src/view"; then
  fail "a host-side folder includes MPI, CUDA, NCCL or LibTorch"
fi
if grep -rEn '#include "hpctrial/(slurm|pbs|launcher)/' "$src/trainer" "$src/rank" "$src/comm" "$src/checkpoint" "$src/core"; then
  fail "rank-side code includes a scheduler or the launcher"
fi
# The read model reads what the others wrote: it asks a scheduler only through core::Scheduler.
if grep -rEn '#include "hpctrial/(slurm|pbs|launcher|trainer|comm|rank)/' "$src/view"; then
  fail "the read model (view/) includes a scheduler, the launcher or the rank side"
fi
if grep -rEn '#include <torch/|#include "hpctrial/trainer' "$src/rank"; then
  fail "the rank runtime (rank/) includes LibTorch or the trainer"
fi
for folder in data parallel state adaptive observe; do
  if grep -rEn '#include "(loop|api)/' "$src/trainer/src/$folder"; then
    fail "trainer/src/$folder includes the loop or the API's internals"
  fi
done
# core/ in three floors: os/ (errors, logging, files, processes) < config/ (the experiment config,
# yaml-cpp private to it) < contract/ (launch contract, experiment and trial directories, Scheduler).
core_os='(digest|env|error|files|ignore_rules|json_file|logging|paths|shell_quote|subprocess|text)'
core_config='(config_node|config_compare|diagnostics|experiment_config|search|metric_order)'
core_header() { echo "$src/core/include/hpctrial/core/$1.h"; }
os_files=("$src"/core/src/os/*.cpp)
config_files=("$src"/core/src/config/*.cpp "$src"/core/src/config/*.h)
for name in digest env error files ignore_rules json_file logging paths shell_quote subprocess text; do os_files+=("$(core_header "$name")"); done
for name in config_node config_compare diagnostics experiment_config search metric_order; do config_files+=("$(core_header "$name")"); done
if grep -En '#include "hpctrial/core/' "${os_files[@]}" | grep -Ev "hpctrial/core/$core_os\.h\""; then
  fail "core's OS utilities (core/src/os/) include the config or the contracts"
fi
if grep -En '#include "hpctrial/core/' "${config_files[@]}" | grep -Ev "hpctrial/core/($core_os|$core_config)\.h\""; then
  fail "core's config (core/src/config/) includes the contracts"
fi
if grep -rEln '#include <yaml-cpp' "$src" --include='*.cpp' --include='*.h' | grep -v '/core/src/config/' | grep -v '^'"$src"'/build'; then
  fail "yaml-cpp is included outside core/src/config/"
fi
# core names no scheduler's options: each scheduler declares its own (Scheduler::options).
if grep -rEn '\.(partition|qos|queue)\b|"(partition|qos|queue)"' --include='*.cpp' --include='*.h' "$src/core" |
   grep -vE '^[^:]+:[0-9]+: *//'; then
  fail "core/ names a scheduler's option; declare it in slurm/ or pbs/ (Scheduler::options)"
fi
if grep -rEn '#include "(\.\./)+[a-z]+/src/' "$src/tests" "$src/benchmarks" "$src/examples"; then
  fail "a test or benchmark includes a library's src/ by a relative path (link its include path instead)"
fi
if grep -rEn '#include "hpctrial/(slurm|pbs)/' "$src/cli"; then
  fail "the CLI includes a scheduler's own header instead of core/scheduler.h and the registry"
fi
# Scheduler names compared as strings: only in slurm/, pbs/ and the registry.
if grep -rEn '== *"(slurm|pbs)"|"(slurm|pbs)" *==|!= *"(slurm|pbs)"' \
     --include='*.cpp' --include='*.h' "$src/cli" "$src/launcher" "$src/core" "$src/trainer" "$src/comm" \
     "$src/checkpoint" "$src/rank" | grep -v 'launcher/src/schedulers.cpp'; then
  fail "a scheduler name is compared outside slurm/, pbs/ and launcher/src/schedulers.cpp"
fi

product=(cli core comm launcher rank trainer checkpoint tensorboard slurm pbs search view)
sources() { for d in "${product[@]}"; do find "$src/$d" -name '*.cpp' -o -name '*.h'; done; }
# One way to start a process and one way to publish a file.
if sources | xargs grep -En '::(fork|vfork|execv|execvp|execvpe|execve|posix_spawnp?)\(' | grep -v 'core/src/os/subprocess.cpp'; then
  fail "a process is started outside core::spawn_process (core/src/os/subprocess.cpp)"
fi
if sources | xargs grep -En '(::rename|[^_]rename)\(' | grep -Ev 'core/(src/os/files.cpp|include/hpctrial/core/files.h)'; then
  fail "a file is renamed into place outside core::publish_file (core/src/os/files.cpp)"
fi
# The experiment and trial directory layout: every name spelled once, in core/src/contract/layout.cpp
# (core::ExperimentLayout, core::TrialLayout). A literal that is the name, or path parts ending in
# '/' and then the name; "logs" and "launch" only after '/' or '+' (they are verbs too).
path_start='"(/|[A-Za-z0-9_.{}-]*/)?'
names='(experiment\.(yaml|json)|\.experiment\.lock|plot\.png|search-events\.jsonl|\.search\.lock|metrics\.jsonl|failures\.jsonl|runs\.jsonl|elastic\.json|launcher-state\.json|effective-config\.yaml|core-state\.json|stop-request|\.launcher\.lock|mpirun\.log|hostfile)"'
if sources | xargs grep -nE \
     -e "${path_start}${names}" \
     -e '"(checkpoints|tensorboard|traces|heartbeat)/?"' \
     -e '(/|\+) *"(logs|launch)"' \
     -e '"/(checkpoints|tensorboard|traces|logs|launch|heartbeat)(/|")' \
     -e "${path_start}(trial-[^a-z]|rank-|abort-|verdict-)" |
   grep -vE '^[^:]+:[0-9]+: *//' | grep -v '/core/src/contract/layout\.cpp:'; then
  fail "a file or folder name of the experiment layout is spelled outside core/src/contract/layout.cpp (use core::ExperimentLayout / core::TrialLayout)"
fi
# Handles own what must be freed once: MPI communicators, CUDA streams and events.
if sources | xargs grep -En 'MPI_Comm_(dup|free)\(' | grep -v 'comm/src/mpi_comm.cpp'; then
  fail "an MPI communicator is duplicated or freed outside comm::MpiComm (comm/src/mpi_comm.cpp)"
fi
if sources | xargs grep -En '(cudaStream|cudaEvent)(Create|Destroy)' | grep -v 'comm/src/cuda_handles.h'; then
  fail "a CUDA stream or event is made or destroyed outside comm/src/cuda_handles.h"
fi
# Top-level function bodies: at most 80 lines each, in the folders held to it so far.
long=$(find "$src"/launcher "$src"/core "$src"/cli "$src"/rank "$src"/trainer "$src"/comm "$src"/search "$src"/view -name '*.cpp' -print0 |
       xargs -0 awk -v max=80 -f "$src/tests/layering/function_lengths.awk")
[[ -n $long ]] && fail "functions over 80 lines (file:line: lines): $long"
while read -r lines file; do
  [[ $file == total ]] && continue
  (( lines > 500 )) && fail "$file has $lines lines (split it: at most 500)"
done < <(sources | xargs wc -l)

[[ $failed == 0 ]] && echo "layering holds"
exit $failed
