// What the engine and loss-scaling tests share: a small MLP and its data, a directory every rank
// sees, and comparisons of parameter lists.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/trainer/data.h"
#include "mpi_test_env.h"

namespace hpctrial::testing_mpi {

struct MlpImpl : torch::nn::Module {
  MlpImpl() : a(register_module("a", torch::nn::Linear(3, 8))), b(register_module("b", torch::nn::Linear(8, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b->forward(torch::tanh(a->forward(x))); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Mlp);

// 64 samples of a noisy nonlinear function.
inline std::shared_ptr<trainer::TensorDataset> mlp_dataset() {
  torch::manual_seed(0);
  auto x = torch::randn({64, 3});
  auto y = torch::sin(x.matmul(torch::tensor({1.0f, -2.0f, 0.5f}))).unsqueeze(1) + 0.1 * torch::randn({64, 1});
  return std::make_shared<trainer::TensorDataset>(x, y);
}

inline void remove_dir(const std::string& dir) {
  comm::MpiCommunicator(env().world()).barrier();
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

inline double max_relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double scale = std::max(1e-12, b[i].abs().max().item<double>());
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

inline bool bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size() || a.empty()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace hpctrial::testing_mpi
