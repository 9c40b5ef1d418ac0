// The final model, optimizer and loss scale of two checkpoints (each part's, of a model split over
// ranks), compared byte for byte: what "resumed exactly where it stopped" means in the tests.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "hpctrial/checkpoint/format.h"

namespace hpctrial::testing_support {

inline void expect_same_weights(const std::string& a_path, const std::string& b_path) {
  const auto a = checkpoint::read_checkpoint(a_path);
  const auto b = checkpoint::read_checkpoint(b_path);
  int compared = 0;
  for (const auto& d : a.datasets) {
    std::string name = d.name;
    const std::string parts = "model_parallel/";  // a part: model_parallel/<k>/model/...
    if (name.rfind(parts, 0) == 0 && name.find('/', parts.size()) != std::string::npos) {
      name = name.substr(name.find('/', parts.size()) + 1);
    }
    if (name.rfind("model/", 0) != 0 && name.rfind("optimizer/", 0) != 0 && name.rfind("scaler/", 0) != 0) continue;
    const auto* other = b.find(d.name);
    ASSERT_NE(other, nullptr) << d.name << " is missing from " << b_path;
    ASSERT_EQ(d.nbytes(), other->nbytes()) << d.name;
    EXPECT_EQ(std::memcmp(d.data->data(), other->data->data(), d.nbytes()), 0) << d.name << " differs";
    ++compared;
  }
  EXPECT_GE(compared, 2) << "no model and optimizer datasets in " << a_path;
}

}  // namespace hpctrial::testing_support
