// What `hpctrial run` and `hpctrial launch` share: finding hpctrial-worker, and the parent
// mpirun starts in place of each rank.
#pragma once

#include <string>
#include <vector>

namespace hpctrial::cli {

// hpctrial-worker: $HPCTRIAL_WORKER, else beside the hpctrial program (installed), else in the
// build tree's trainer/ folder. Empty when none exists.
std::string find_worker();

// `hpctrial _rank --`: this very program as the parent of each rank (see rank_verb.cpp).
std::vector<std::string> rank_parent_command();

}  // namespace hpctrial::cli
