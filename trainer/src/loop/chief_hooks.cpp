// State that hooks running on the chief alone change, given to every rank (docs/trial-api.md,
// "State changed on the chief").
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/error.h"
#include "loop/loop.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {

// What hooks that run on the chief alone (on_validation_step_end, on_validation_end,
// on_checkpoint_end) may change and every rank must then hold alike: each wrapped optimizer's
// param-group options (lr, momentum, betas, weight decay, ...) and each wrapped LR scheduler's
// step count. The reference's ReduceLROnPlateau recipe changes the learning rate in
// on_validation_end; without this the chief would train with the new rate, the others the old.
std::string Loop::chief_hook_state() {
  nlohmann::json state = {{"optimizers", nlohmann::json::array()}, {"schedulers", nlohmann::json::array()}};
  for (const auto& optimizer : context_->optimizers()) state["optimizers"].push_back(optimizer_options_text(*optimizer));
  for (const auto& wrapped : context_->lr_schedulers()) state["schedulers"].push_back(scheduler_step_count(*wrapped.scheduler));
  return state.dump();
}

// The same state as bytes to compare, made without text (state_io.h): taken before and after
// every wrap of the hooks, where the text is made only when they differ.
std::string Loop::chief_hook_fingerprint() {
  std::string bytes;
  for (const auto& optimizer : context_->optimizers()) append_optimizer_options_fingerprint(*optimizer, bytes);
  for (const auto& wrapped : context_->lr_schedulers()) {
    const unsigned count = scheduler_step_count(*wrapped.scheduler);
    bytes.append(reinterpret_cast<const char*>(&count), sizeof count);
  }
  return bytes;
}

// After chief-only hooks ran (with_chief_hooks): the chief compares the state with `before` (its
// fingerprint), and broadcasts it when it changed. Its length goes first, 8 bytes on the calling
// thread, and when nothing changed that is all. Model weights and the trial's own members do not
// travel (replica_check_period finds a rank whose weights differ).
void Loop::share_chief_hook_changes(const std::string& before) {
  std::string state;
  if (chief() && chief_hook_fingerprint() != before) state = chief_hook_state();
  comm_.broadcast(state, 0);
  if (state.empty() || chief()) return;
  const nlohmann::json shared = nlohmann::json::parse(state);
  const auto& optimizers = context_->optimizers();
  const auto& schedulers = context_->lr_schedulers();
  if (shared.at("optimizers").size() != optimizers.size() || shared.at("schedulers").size() != schedulers.size()) {
    throw ConfigError("a hook that runs on the chief alone changed an optimizer's options or stepped an LR scheduler, "
                      "and rank " + std::to_string(comm_.rank()) + " wraps " + std::to_string(optimizers.size()) +
                      " optimizers and " + std::to_string(schedulers.size()) + " LR schedulers where the chief wraps " +
                      std::to_string(shared.at("optimizers").size()) + " and " +
                      std::to_string(shared.at("schedulers").size()) + ": make the change in a hook that runs on "
                      "every rank (on_training_epoch_end, or train_batch)");
  }
  for (std::size_t i = 0; i < optimizers.size(); ++i) {
    load_optimizer_options_text(*optimizers[i], shared["optimizers"][i].get<std::string>(),
                                "optimizer " + std::to_string(i) + " changed by a hook on the chief");
  }
  for (std::size_t i = 0; i < schedulers.size(); ++i) {
    scheduler_step_count(*schedulers[i].scheduler) = shared["schedulers"][i].get<unsigned>();
  }
}

}  // namespace hpctrial::trainer::detail
