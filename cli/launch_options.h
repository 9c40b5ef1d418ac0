// What `hpctrial run` and `hpctrial launch` share: finding hpctrial-worker.
#pragma once

#include <string>

namespace hpctrial::cli {

// hpctrial-worker: $HPCTRIAL_WORKER, else beside the hpctrial program (installed), else in the
// build tree's trainer/ folder. Empty when none exists.
std::string find_worker();

}  // namespace hpctrial::cli
