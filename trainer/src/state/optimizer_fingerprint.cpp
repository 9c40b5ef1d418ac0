// Bytes to compare an optimizer's options by, around the hooks that run on the chief alone
// (state_io.h): made without text, so that taking them around every validation costs next to
// nothing.
#include <torch/torch.h>

#include <string>
#include <tuple>

#include "state/state_io.h"

namespace hpctrial::trainer::detail {

namespace {

// The bytes of `values`, one after another.
template <typename... T>
void put_bytes(std::string& out, const T&... values) {
  (out.append(reinterpret_cast<const char*>(&values), sizeof values), ...);
}

// Every value of one param group's options as bytes, for the six types the codecs of
// state_io.cpp know (the same fields as their save_options); false for another options class.
bool append_options_bytes(torch::optim::OptimizerOptions& o, std::string& out) {
  namespace optim = torch::optim;
  if (auto* s = dynamic_cast<optim::SGDOptions*>(&o)) {
    put_bytes(out, 's', s->lr(), s->momentum(), s->dampening(), s->weight_decay(), s->nesterov());
  } else if (auto* s = dynamic_cast<optim::AdamOptions*>(&o)) {
    put_bytes(out, 'a', s->lr(), std::get<0>(s->betas()), std::get<1>(s->betas()), s->eps(), s->weight_decay(),
              s->amsgrad());
  } else if (auto* s = dynamic_cast<optim::AdamWOptions*>(&o)) {
    put_bytes(out, 'w', s->lr(), std::get<0>(s->betas()), std::get<1>(s->betas()), s->eps(), s->weight_decay(),
              s->amsgrad());
  } else if (auto* s = dynamic_cast<optim::AdagradOptions*>(&o)) {
    put_bytes(out, 'g', s->lr(), s->lr_decay(), s->weight_decay(), s->initial_accumulator_value(), s->eps());
  } else if (auto* s = dynamic_cast<optim::RMSpropOptions*>(&o)) {
    put_bytes(out, 'r', s->lr(), s->alpha(), s->eps(), s->weight_decay(), s->momentum(), s->centered());
  } else if (auto* s = dynamic_cast<optim::LBFGSOptions*>(&o)) {
    const bool bounded = s->max_eval().has_value();
    const std::int64_t max_eval = bounded ? *s->max_eval() : 0;
    put_bytes(out, 'l', s->lr(), s->max_iter(), bounded, max_eval, s->tolerance_grad(), s->tolerance_change(),
              s->history_size());
    out += s->line_search_fn() ? "+" + *s->line_search_fn() : std::string("-");
    out += '\0';
  } else {
    return false;
  }
  return true;
}

}  // namespace

void append_optimizer_options_fingerprint(torch::optim::Optimizer& optimizer, std::string& out) {
  const std::size_t start = out.size();
  put_bytes(out, optimizer.param_groups().size());
  for (auto& group : optimizer.param_groups()) {
    if (!append_options_bytes(group.options(), out)) {
      out.resize(start);
      out += optimizer_options_text(optimizer);
      return;
    }
  }
}

}  // namespace hpctrial::trainer::detail
