// The mlp example's trial, keeping copies of its final weights for comparison.
#pragma once

#include <vector>

#include "mlp_trial.h"

namespace hpctrial::testing_support {

class CapturingMlp : public mlp_example::MlpTrial {
 public:
  CapturingMlp(TrialContext& context, std::vector<torch::Tensor>* out) : MlpTrial(context), out_(out) {}
  ~CapturingMlp() override {
    for (const auto& p : model()->parameters()) out_->push_back(p.detach().clone());
  }

 private:
  std::vector<torch::Tensor>* out_;
};

}  // namespace hpctrial::testing_support
