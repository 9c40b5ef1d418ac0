#include <string>

#include "hpctrial/build_config.h"
#include "verb.h"

namespace hpctrial::cli {

std::string version_text() {
  std::string text = std::string("hpctrial ") + HPCTRIAL_VERSION + " (git " + HPCTRIAL_GIT_REVISION + ")\n";
  text += std::string("  LibTorch ") + HPCTRIAL_TORCH_VERSION + "\n";
  text += std::string("  MPI      ") + HPCTRIAL_MPI_VERSION + "\n";
  text += std::string("  HDF5     ") + HPCTRIAL_HDF5_VERSION + " (parallel)\n";
  text += std::string("  CUDA     ") +
          (HPCTRIAL_WITH_CUDA ? std::string("yes (") + HPCTRIAL_CUDA_VERSION + ")" : "no") + "\n";
  text += std::string("  NCCL     ") + (HPCTRIAL_WITH_NCCL ? "yes" : "no") + "\n";
  text += std::string("  plot     ") + (HPCTRIAL_WITH_PLOT ? "yes (PLplot)" : "no (built with -DHPCTRIAL_PLOT=OFF)") + "\n";
  return text;
}

}  // namespace hpctrial::cli
