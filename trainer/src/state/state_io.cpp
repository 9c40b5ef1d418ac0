#include "state/state_io.h"

#include <torch/serialize.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <optional>
#include <sstream>
#include <type_traits>
#include <utility>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace {

using checkpoint::DType;
using json = nlohmann::json;

struct Writer {
  checkpoint::Contents& contents;
  std::string prefix;
  Deferred* deferred = nullptr;
  json scalars = json::object();
  bool view = false;  // every tensor into `deferred`, wherever it lives: nothing is copied
  void tensor(const std::string& name, const torch::Tensor& t) {
    if (!t.defined()) return;
    if (view) {
      deferred->push_back({prefix + "/" + name, t.detach()});
    } else {
      add_or_defer(contents, deferred, prefix + "/" + name, t);
    }
  }
  void tensors(const std::string& name, const std::deque<torch::Tensor>& list) {
    scalars[name + "_count"] = list.size();
    for (std::size_t k = 0; k < list.size(); ++k) tensor(name + "/" + std::to_string(k), list[k]);
  }
};

struct Reader {
  const checkpoint::Contents& contents;
  std::string prefix;
  json scalars;
  std::string file;
  torch::Device device;
  torch::Tensor tensor(const std::string& name) const {
    const checkpoint::Dataset* d = contents.find(prefix + "/" + name);
    if (d == nullptr) return {};
    return tensor_of(*d).to(device).clone();
  }
  std::deque<torch::Tensor> tensors(const std::string& name) const {
    std::deque<torch::Tensor> out;
    const std::size_t count = scalars.value(name + "_count", std::size_t{0});
    for (std::size_t k = 0; k < count; ++k) out.push_back(tensor(name + "/" + std::to_string(k)));
    return out;
  }
  template <typename T>
  T scalar(const char* name) const {
    if (!scalars.contains(name)) {
      throw CheckpointError(file + ": " + prefix + "/scalars has no '" + name + "'");
    }
    return scalars.at(name).get<T>();
  }
};

// One optimizer type: its options and per-parameter state, both ways.
struct OptimizerCodec {
  const char* name;
  bool (*matches)(torch::optim::Optimizer&);
  json (*save_options)(torch::optim::OptimizerOptions&);
  void (*load_options)(const json&, torch::optim::OptimizerOptions&);
  void (*save_state)(torch::optim::OptimizerParamState&, Writer&);
  std::unique_ptr<torch::optim::OptimizerParamState> (*load_state)(const Reader&);
};

template <typename O>
bool is(torch::optim::Optimizer& optimizer) {
  return dynamic_cast<O*>(&optimizer) != nullptr;
}

template <typename Options>
Options& options_as(torch::optim::OptimizerOptions& options) {
  return dynamic_cast<Options&>(options);
}

std::tuple<double, double> betas_of(const json& j) { return {j.at(0).get<double>(), j.at(1).get<double>()}; }

// Adam and AdamW share their options and state fields.
template <typename Opt, typename Options, typename State>
OptimizerCodec adam_codec(const char* name) {
  return {name, &is<Opt>,
          [](torch::optim::OptimizerOptions& o) -> json {
            auto& s = options_as<Options>(o);
            return {{"lr", s.lr()}, {"betas", {std::get<0>(s.betas()), std::get<1>(s.betas())}}, {"eps", s.eps()},
                    {"weight_decay", s.weight_decay()}, {"amsgrad", s.amsgrad()}};
          },
          [](const json& j, torch::optim::OptimizerOptions& o) {
            auto& s = options_as<Options>(o);
            s.lr(j.at("lr")).betas(betas_of(j.at("betas"))).eps(j.at("eps")).weight_decay(j.at("weight_decay"));
            s.amsgrad(j.at("amsgrad"));
          },
          [](torch::optim::OptimizerParamState& p, Writer& w) {
            auto& s = static_cast<State&>(p);
            w.scalars["step"] = s.step();
            w.tensor("exp_avg", s.exp_avg());
            w.tensor("exp_avg_sq", s.exp_avg_sq());
            w.tensor("max_exp_avg_sq", s.max_exp_avg_sq());
          },
          [](const Reader& r) -> std::unique_ptr<torch::optim::OptimizerParamState> {
            auto s = std::make_unique<State>();
            s->step(r.scalar<std::int64_t>("step")).exp_avg(r.tensor("exp_avg")).exp_avg_sq(r.tensor("exp_avg_sq"));
            s->max_exp_avg_sq(r.tensor("max_exp_avg_sq"));
            return s;
          }};
}

OptimizerCodec sgd_codec() {
  return {"sgd", &is<torch::optim::SGD>,
          [](torch::optim::OptimizerOptions& o) -> json {
            auto& s = options_as<torch::optim::SGDOptions>(o);
            return {{"lr", s.lr()}, {"momentum", s.momentum()}, {"dampening", s.dampening()},
                    {"weight_decay", s.weight_decay()}, {"nesterov", s.nesterov()}};
          },
          [](const json& j, torch::optim::OptimizerOptions& o) {
            auto& s = options_as<torch::optim::SGDOptions>(o);
            s.lr(j.at("lr")).momentum(j.at("momentum")).dampening(j.at("dampening"));
            s.weight_decay(j.at("weight_decay")).nesterov(j.at("nesterov"));
          },
          [](torch::optim::OptimizerParamState& p, Writer& w) {
            w.tensor("momentum_buffer", static_cast<torch::optim::SGDParamState&>(p).momentum_buffer());
          },
          [](const Reader& r) -> std::unique_ptr<torch::optim::OptimizerParamState> {
            auto s = std::make_unique<torch::optim::SGDParamState>();
            s->momentum_buffer(r.tensor("momentum_buffer"));
            return s;
          }};
}

OptimizerCodec adagrad_codec() {
  return {"adagrad", &is<torch::optim::Adagrad>,
          [](torch::optim::OptimizerOptions& o) -> json {
            auto& s = options_as<torch::optim::AdagradOptions>(o);
            return {{"lr", s.lr()}, {"lr_decay", s.lr_decay()}, {"weight_decay", s.weight_decay()},
                    {"initial_accumulator_value", s.initial_accumulator_value()}, {"eps", s.eps()}};
          },
          [](const json& j, torch::optim::OptimizerOptions& o) {
            auto& s = options_as<torch::optim::AdagradOptions>(o);
            s.lr(j.at("lr")).lr_decay(j.at("lr_decay")).weight_decay(j.at("weight_decay"));
            s.initial_accumulator_value(j.at("initial_accumulator_value")).eps(j.at("eps"));
          },
          [](torch::optim::OptimizerParamState& p, Writer& w) {
            auto& s = static_cast<torch::optim::AdagradParamState&>(p);
            w.scalars["step"] = s.step();
            w.tensor("sum", s.sum());
          },
          [](const Reader& r) -> std::unique_ptr<torch::optim::OptimizerParamState> {
            auto s = std::make_unique<torch::optim::AdagradParamState>();
            s->step(r.scalar<std::int64_t>("step")).sum(r.tensor("sum"));
            return s;
          }};
}

OptimizerCodec rmsprop_codec() {
  return {"rmsprop", &is<torch::optim::RMSprop>,
          [](torch::optim::OptimizerOptions& o) -> json {
            auto& s = options_as<torch::optim::RMSpropOptions>(o);
            return {{"lr", s.lr()}, {"alpha", s.alpha()}, {"eps", s.eps()}, {"weight_decay", s.weight_decay()},
                    {"momentum", s.momentum()}, {"centered", s.centered()}};
          },
          [](const json& j, torch::optim::OptimizerOptions& o) {
            auto& s = options_as<torch::optim::RMSpropOptions>(o);
            s.lr(j.at("lr")).alpha(j.at("alpha")).eps(j.at("eps")).weight_decay(j.at("weight_decay"));
            s.momentum(j.at("momentum")).centered(j.at("centered"));
          },
          [](torch::optim::OptimizerParamState& p, Writer& w) {
            auto& s = static_cast<torch::optim::RMSpropParamState&>(p);
            w.scalars["step"] = s.step();
            w.tensor("square_avg", s.square_avg());
            w.tensor("momentum_buffer", s.momentum_buffer());
            w.tensor("grad_avg", s.grad_avg());
          },
          [](const Reader& r) -> std::unique_ptr<torch::optim::OptimizerParamState> {
            auto s = std::make_unique<torch::optim::RMSpropParamState>();
            s->step(r.scalar<std::int64_t>("step")).square_avg(r.tensor("square_avg"));
            s->momentum_buffer(r.tensor("momentum_buffer")).grad_avg(r.tensor("grad_avg"));
            return s;
          }};
}

OptimizerCodec lbfgs_codec() {
  return {"lbfgs", &is<torch::optim::LBFGS>,
          [](torch::optim::OptimizerOptions& o) -> json {
            auto& s = options_as<torch::optim::LBFGSOptions>(o);
            return {{"lr", s.lr()}, {"max_iter", s.max_iter()},
                    {"max_eval", s.max_eval() ? json(*s.max_eval()) : json(nullptr)},
                    {"tolerance_grad", s.tolerance_grad()}, {"tolerance_change", s.tolerance_change()},
                    {"history_size", s.history_size()},
                    {"line_search_fn", s.line_search_fn() ? json(*s.line_search_fn()) : json(nullptr)}};
          },
          [](const json& j, torch::optim::OptimizerOptions& o) {
            auto& s = options_as<torch::optim::LBFGSOptions>(o);
            s.lr(j.at("lr")).max_iter(j.at("max_iter")).tolerance_grad(j.at("tolerance_grad"));
            s.tolerance_change(j.at("tolerance_change")).history_size(j.at("history_size"));
            s.max_eval(j.at("max_eval").is_null() ? c10::optional<std::int64_t>()
                                                  : j.at("max_eval").get<std::int64_t>());
            s.line_search_fn(j.at("line_search_fn").is_null() ? c10::optional<std::string>()
                                                              : j.at("line_search_fn").get<std::string>());
          },
          [](torch::optim::OptimizerParamState& p, Writer& w) {
            auto& s = static_cast<torch::optim::LBFGSParamState&>(p);
            w.scalars["func_evals"] = s.func_evals();
            w.scalars["n_iter"] = s.n_iter();
            w.scalars["t"] = s.t();
            w.scalars["prev_loss"] = s.prev_loss();
            w.tensor("d", s.d());
            w.tensor("H_diag", s.H_diag());
            w.tensor("prev_flat_grad", s.prev_flat_grad());
            w.tensors("old_dirs", s.old_dirs());
            w.tensors("old_stps", s.old_stps());
            w.tensors("ro", s.ro());
            w.scalars["has_al"] = s.al().has_value();
            if (s.al()) w.tensors("al", std::deque<torch::Tensor>(s.al()->begin(), s.al()->end()));
          },
          [](const Reader& r) -> std::unique_ptr<torch::optim::OptimizerParamState> {
            auto s = std::make_unique<torch::optim::LBFGSParamState>();
            s->func_evals(r.scalar<std::int64_t>("func_evals")).n_iter(r.scalar<std::int64_t>("n_iter"));
            s->t(r.scalar<double>("t")).prev_loss(r.scalar<double>("prev_loss"));
            s->d(r.tensor("d")).H_diag(r.tensor("H_diag")).prev_flat_grad(r.tensor("prev_flat_grad"));
            s->old_dirs(r.tensors("old_dirs")).old_stps(r.tensors("old_stps")).ro(r.tensors("ro"));
            if (r.scalar<bool>("has_al")) {
              const auto al = r.tensors("al");
              s->al(std::vector<torch::Tensor>(al.begin(), al.end()));
            }
            return s;
          }};
}

const OptimizerCodec kCodecs[] = {
    sgd_codec(),
    adam_codec<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState>("adam"),
    adam_codec<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState>("adamw"),
    adagrad_codec(),
    rmsprop_codec(),
    lbfgs_codec(),
};

const OptimizerCodec* codec_for(torch::optim::Optimizer& optimizer) {
  for (const auto& codec : kCodecs) {
    if (codec.matches(optimizer)) return &codec;
  }
  return nullptr;
}

struct SchedulerAccess : torch::optim::LRScheduler {
  static unsigned& count(torch::optim::LRScheduler& scheduler) { return scheduler.*(&SchedulerAccess::step_count_); }
};

}  // namespace

void add_tensor(checkpoint::Contents& contents, const std::string& name, const torch::Tensor& tensor) {
  const torch::Tensor host = tensor.detach().to(torch::kCPU).contiguous();
  auto buffer = std::make_shared<checkpoint::Buffer>(static_cast<std::size_t>(host.nbytes()));
  if (buffer->size() > 0) std::memcpy(buffer->data(), host.data_ptr(), buffer->size());
  contents.add(name, checkpoint_dtype(host.scalar_type()), host.sizes().vec(), std::move(buffer));
}

void add_or_defer(checkpoint::Contents& contents, Deferred* deferred, const std::string& name,
                  const torch::Tensor& tensor) {
  if (deferred != nullptr && tensor.device().is_cpu()) {
    deferred->push_back({name, tensor.detach()});
  } else {
    add_tensor(contents, name, tensor);
  }
}

torch::Tensor tensor_of(const checkpoint::Dataset& dataset) {
  auto keep = checkpoint::bytes_of(dataset);
  return torch::from_blob(const_cast<void*>(keep->data()), dataset.shape, [keep](void*) {},
                          torch::TensorOptions().dtype(to_scalar_type(dataset.dtype)));
}

void load_into(const checkpoint::Contents& contents, const std::string& name, torch::Tensor& target,
               const std::string& file) {
  const checkpoint::Dataset* d = contents.find(name);
  if (d == nullptr) {
    throw ConfigError(file + " has no " + name + ", which the model has: the model changed since the checkpoint "
                      "(a different architecture or hyperparameters); start a new trial, or resume with the "
                      "config that wrote it");
  }
  if (d->shape != target.sizes().vec() || to_scalar_type(d->dtype) != target.scalar_type()) {
    throw ConfigError(file + ": " + name + " is " + checkpoint::to_string(d->dtype) + " " +
                      c10::str(c10::IntArrayRef(d->shape)) + " in the checkpoint but " +
                      checkpoint::to_string(checkpoint_dtype(target.scalar_type())) + " " + c10::str(target.sizes()) +
                      " in the model: the config changed the model since the checkpoint");
  }
  torch::NoGradGuard no_grad;
  target.copy_(tensor_of(*d));
}

namespace {

void write_optimizer(checkpoint::Contents& contents, const std::string& prefix, torch::optim::Optimizer& optimizer,
                     Deferred* deferred, bool view) {
  const OptimizerCodec* codec = codec_for(optimizer);
  if (codec == nullptr) {
    // Another optimizer class: LibTorch's own serialization keeps it whole.
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    contents.add_text(prefix + "/torch_archive", bytes.str());
    contents.add_text(prefix + "/type", "torch_archive");
    return;
  }
  contents.add_text(prefix + "/type", codec->name);
  json groups = json::array();
  std::size_t index = 0;
  for (auto& group : optimizer.param_groups()) {
    json params = json::array();
    for (auto& p : group.params()) {
      const auto it = optimizer.state().find(optimizer_state_key(p));
      if (it != optimizer.state().end()) {
        Writer w{contents, prefix + "/state/" + std::to_string(index), deferred};
        w.view = view;
        codec->save_state(*it->second, w);
        contents.add_text(w.prefix + "/scalars", w.scalars.dump());
      }
      params.push_back(index++);
    }
    groups.push_back({{"params", params}, {"options", codec->save_options(group.options())}});
  }
  contents.add_text(prefix + "/param_groups", groups.dump());
}

}  // namespace

void save_optimizer(checkpoint::Contents& contents, const std::string& prefix, torch::optim::Optimizer& optimizer,
                    Deferred* deferred) {
  write_optimizer(contents, prefix, optimizer, deferred, /*view=*/false);
}

Deferred view_optimizer(checkpoint::Contents& texts, const std::string& prefix, torch::optim::Optimizer& optimizer) {
  Deferred tensors;
  write_optimizer(texts, prefix, optimizer, &tensors, /*view=*/true);
  return tensors;
}

void load_optimizer(const checkpoint::Contents& contents, const std::string& prefix,
                    torch::optim::Optimizer& optimizer, const std::string& file) {
  const std::string type = contents.at(prefix + "/type", file).text();
  const OptimizerCodec* codec = codec_for(optimizer);
  const std::string mine = codec != nullptr ? codec->name : "torch_archive";
  if (type != mine) {
    throw ConfigError(file + ": " + prefix + " was a " + type + " optimizer and is now " + mine +
                      ": the trial changed since the checkpoint");
  }
  if (codec == nullptr) {
    const std::string bytes = contents.at(prefix + "/torch_archive", file).text();
    std::istringstream in(bytes);
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    optimizer.load(archive);
    return;
  }
  json groups;
  try {
    groups = json::parse(contents.at(prefix + "/param_groups", file).text());
  } catch (const json::exception& e) {
    throw CheckpointError(file + ": " + prefix + "/param_groups is not valid JSON: " + e.what());
  }
  auto& mine_groups = optimizer.param_groups();
  if (!groups.is_array() || groups.size() != mine_groups.size()) {
    throw ConfigError(file + ": " + prefix + " has " + std::to_string(groups.size()) +
                      " parameter groups in the checkpoint and " + std::to_string(mine_groups.size()) +
                      " in the trial: the trial changed since the checkpoint");
  }
  std::size_t index = 0;
  try {
    for (std::size_t g = 0; g < mine_groups.size(); ++g) {
      auto& group = mine_groups[g];
      if (groups[g].at("params").size() != group.params().size()) {
        throw ConfigError(file + ": " + prefix + " group " + std::to_string(g) + " has " +
                          std::to_string(groups[g].at("params").size()) + " parameters in the checkpoint and " +
                          std::to_string(group.params().size()) + " in the trial");
      }
      codec->load_options(groups[g].at("options"), group.options());
      for (auto& p : group.params()) load_parameter_state(contents, prefix + "/state/" + std::to_string(index++), optimizer, p, file);
    }
  } catch (const json::exception& e) {
    throw CheckpointError(file + ": " + prefix + ": malformed optimizer state: " + e.what());
  }
}

void load_parameter_state(const checkpoint::Contents& contents, const std::string& state_prefix,
                          torch::optim::Optimizer& optimizer, const torch::Tensor& parameter, const std::string& file) {
  const OptimizerCodec* codec = codec_for(optimizer);
  if (codec == nullptr) throw InternalError("load_parameter_state: an optimizer of another class than LibTorch's six");
  const checkpoint::Dataset* scalars = contents.find(state_prefix + "/scalars");
  optimizer.state().erase(optimizer_state_key(parameter));
  if (scalars == nullptr) return;  // no state yet for this parameter
  try {
    Reader r{contents, state_prefix, json::parse(scalars->text()), file, parameter.device()};
    optimizer.state()[optimizer_state_key(parameter)] = codec->load_state(r);
  } catch (const json::exception& e) {
    throw CheckpointError(file + ": " + state_prefix + ": malformed optimizer state: " + e.what());
  }
}

std::string optimizer_options_text(torch::optim::Optimizer& optimizer) {
  const OptimizerCodec* codec = codec_for(optimizer);
  json groups = json::array();
  for (auto& group : optimizer.param_groups()) {
    if (codec != nullptr) {
      groups.push_back(codec->save_options(group.options()));
      continue;
    }
    // Another optimizer class: LibTorch's archive of the options, as hexadecimal text; an
    // options class that cannot serialize itself gives its learning rate alone, or nothing.
    try {
      torch::serialize::OutputArchive archive;
      group.options().serialize(archive);
      std::ostringstream bytes;
      archive.save_to(bytes);
      static constexpr char kHex[] = "0123456789abcdef";
      std::string hex;
      for (const unsigned char c : bytes.str()) (hex += kHex[c >> 4]) += kHex[c & 15];
      groups.push_back(hex);
    } catch (const c10::Error&) {
      try {
        groups.push_back({{"lr", group.options().get_lr()}});
      } catch (const c10::Error&) {
        groups.push_back(nullptr);
      }
    }
  }
  return json{{"type", codec != nullptr ? codec->name : "torch_archive"}, {"groups", groups}}.dump();
}

void load_optimizer_options_text(torch::optim::Optimizer& optimizer, const std::string& text, const std::string& what) {
  const json options = json::parse(text);
  const OptimizerCodec* codec = codec_for(optimizer);
  const std::string type = codec != nullptr ? codec->name : "torch_archive";
  auto& groups = optimizer.param_groups();
  if (options.at("type") != type || options.at("groups").size() != groups.size()) {
    throw ConfigError(what + " is a " + options.at("type").get<std::string>() + " optimizer of " +
                      std::to_string(options.at("groups").size()) + " parameter groups there and a " + type +
                      " optimizer of " + std::to_string(groups.size()) + " here");
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const json& group = options.at("groups")[g];
    if (codec != nullptr) {
      codec->load_options(group, groups[g].options());
      continue;
    }
    if (group.is_null()) continue;
    if (group.is_object()) {
      groups[g].options().set_lr(group.at("lr").get<double>());
      continue;
    }
    const std::string hex = group.get<std::string>();
    std::string bytes(hex.size() / 2, '\0');
    const auto digit = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
    for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(digit(hex[2 * i]) << 4 | digit(hex[2 * i + 1]));
    std::istringstream in(bytes);
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    groups[g].options().serialize(archive);
  }
}

std::int64_t optimizer_state_elements(torch::optim::Optimizer& optimizer) {
  checkpoint::Contents texts;
  std::int64_t elements = 0;
  for (const auto& d : view_optimizer(texts, "o", optimizer)) {
    // A tensor whose storage is swapped out to a file (offload) holds none in memory.
    if (d.tensor.storage().nbytes() > 0 && d.tensor.scalar_type() != torch::kUInt8) elements += d.tensor.numel();
  }
  return elements;
}

bool has_state_codec(torch::optim::Optimizer& optimizer) { return codec_for(optimizer) != nullptr; }

std::vector<torch::Tensor> parameter_state_tensors(torch::optim::Optimizer& optimizer, const torch::Tensor& parameter) {
  const OptimizerCodec* codec = codec_for(optimizer);
  const auto it = optimizer.state().find(optimizer_state_key(parameter));
  if (codec == nullptr || it == optimizer.state().end()) return {};
  checkpoint::Contents texts;
  Deferred tensors;
  Writer w{texts, "p", &tensors};
  w.view = true;
  codec->save_state(*it->second, w);
  std::vector<torch::Tensor> out;
  for (auto& d : tensors) out.push_back(std::move(d.tensor));
  return out;
}

unsigned& scheduler_step_count(torch::optim::LRScheduler& scheduler) { return SchedulerAccess::count(scheduler); }

}  // namespace hpctrial::trainer::detail
