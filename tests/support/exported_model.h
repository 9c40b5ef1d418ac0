// A model `hpctrial checkpoint export` wrote, read in Python (tests/python/exported_model.py):
// from the archive through torch.jit.load and from the checkpoint through the Python reader,
// which must agree; each tensor's CRC-32C by its name, for a test to compare with the model's.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>

#include "hpctrial/core/subprocess.h"

namespace hpctrial::testing_support {

// `state_dict`: where the Python reader writes the checkpoint's model (a path of the test's).
inline std::map<std::string, std::uint32_t> exported_model_crcs(const std::string& checkpoint,
                                                                const std::string& archive,
                                                                const std::string& state_dict) {
  core::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  const auto python = core::run_process({"/usr/bin/python3", HPCTRIAL_SOURCE_DIR "/tests/python/exported_model.py",
                                         HPCTRIAL_SOURCE_DIR "/scripts", checkpoint, archive, state_dict},
                                        options);
  EXPECT_TRUE(python.ok()) << python.describe() << "\n" << python.err;
  std::map<std::string, std::uint32_t> read;
  std::istringstream lines(python.out);
  for (std::string name, crc; lines >> name >> crc;) read[name] = static_cast<std::uint32_t>(std::stoul(crc));
  return read;
}

}  // namespace hpctrial::testing_support
