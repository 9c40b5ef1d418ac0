// The loop's metrics: training metrics reduced over a reporting period, validation (by batch
// or evaluate_full_dataset), custom reducers.
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "parallel/autocast.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/layout.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/metric_order.h"
#include "hpctrial/tensorboard/event_writer.h"
#include "hpctrial/trainer/summary_writer.h"
#include "loop/loop.h"

namespace hpctrial::trainer::detail {

using comm::DType;
using comm::ReduceOp;

namespace {

// A JSON value as bytes that keep every double exact (CBOR: NaN and infinities included).
std::string cbor_bytes(const nlohmann::json& value) {
  const std::vector<std::uint8_t> bytes = nlohmann::json::to_cbor(value);
  return std::string(bytes.begin(), bytes.end());
}

nlohmann::json from_cbor_bytes(const std::string& bytes, std::size_t from = 0) {
  return nlohmann::json::from_cbor(bytes.begin() + static_cast<std::ptrdiff_t>(from), bytes.end());
}

// The metrics one reducer's result stands for: itself under its name, or, registered without a
// name, each member of the object it returned.
void add_reducer_result(MetricValues& results, const TrialContext::WrappedReducer& wrapped, const MetricValue& result) {
  const nlohmann::json value = result.value();
  auto add = [&](const std::string& name, const MetricValue& metric) {
    if (!results.emplace(name, metric).second) {
      throw ConfigError("two custom reducers report the metric '" + name + "'; give each metric one reducer");
    }
  };
  if (wrapped.name) {
    if (value.is_object()) {
      throw ConfigError("the reducer '" + *wrapped.name + "' returned an object (" + result.to_json().dump() +
                        "); a named reducer reports one value: register it without a name (wrap_reducer(reducer)) to "
                        "report each member as a metric");
    }
    add(*wrapped.name, result);
    return;
  }
  if (!value.is_object()) {
    throw ConfigError("the " + wrapped.key + " returned " + result.to_json().dump() +
                      ", not an object of metrics by name; a reducer without a name returns an object, or give it a "
                      "name in wrap_reducer to report this value under it");
  }
  for (auto it = value.begin(); it != value.end(); ++it) add(it.key(), MetricValue(it.value()));
}

}  // namespace

// Custom reducers: every rank's per-slot value goes to the chief (as CBOR, doubles exact), which
// runs cross_slot_reduce once; every rank gets the results, or the chief's error.
MetricValues Loop::reduce_custom(bool training) {
  MetricValues results;
  std::string failure;
  bool any = false;
  for (const auto& wrapped : context_->reducers()) {
    if (training ? !wrapped.for_training : !wrapped.for_validation) continue;
    any = true;
    // '+' and the value; '-' from a rank whose model-parallel unit reports no metrics; '!' and
    // the error from a rank whose per_slot_reduce failed.
    std::string bytes = "-";
    if (reports_metrics()) {
      try {
        bytes = "+" + cbor_bytes(wrapped.reducer->per_slot_reduce());
      } catch (const std::exception& e) {
        bytes = "!per_slot_reduce of the reducer '" + wrapped.key + "' failed on rank " + std::to_string(comm_.rank()) +
                ": " + e.what();
      }
    }
    const auto parts = comm_.gather(bytes, 0);
    if (chief() && failure.empty()) {
      try {
        std::vector<nlohmann::json> per_slot;
        for (const auto& part : parts) {
          if (!part.empty() && part[0] == '!') throw ConfigError(part.substr(1));
          if (!part.empty() && part[0] == '+') per_slot.push_back(from_cbor_bytes(part, 1));
        }
        add_reducer_result(results, wrapped, wrapped.reducer->cross_slot_reduce(per_slot));
      } catch (const std::exception& e) {
        failure = e.what();  // told to every rank below, so that none waits for a chief that failed
      }
    }
    wrapped.reducer->reset();
  }
  if (!any) return {};
  nlohmann::json shared = nlohmann::json::object();
  if (chief()) {
    if (failure.empty()) {
      for (const auto& [name, value] : results) shared["metrics"][name] = value.value();
    } else {
      shared["error"] = failure;
    }
  }
  std::string text = chief() ? cbor_bytes(shared) : std::string();
  comm_.broadcast(text, 0);
  shared = from_cbor_bytes(text);
  if (shared.contains("error")) {
    throw ConfigError((training ? "a custom training reducer failed on the chief: " : "a custom validation reducer "
                       "failed on the chief: ") + shared.at("error").get<std::string>());
  }
  results.clear();
  if (shared.contains("metrics")) {
    for (const auto& [name, value] : shared.at("metrics").items()) results.emplace(name, MetricValue(value));
  }
  return results;
}

// What the run writes besides checkpoints: metrics.jsonl and the TensorBoard events (the chief),
// the profiler's traces, the progress lines.
void Loop::start_outputs() {
  // Where each rank runs, for the run's record (hpctrial describe): one gather at the start.
  std::string devices;
  for (const auto& device : context_->devices()) devices += (devices.empty() ? "" : "+") + device.str();
  const nlohmann::json place = {{"host", core::host_name()},
                                {"cpus", core::cpu_affinity()},
                                {"device", devices.empty() ? context_->device().str() : devices}};
  const std::vector<std::string> placement = comm_.gather(place.dump(), 0);
  if (chief()) {
    core::create_directories(options_.trial_dir, config_.checkpoint_storage.group_readable ? 0750 : 0700);
    result_.metrics_path = core::TrialLayout{options_.trial_dir}.metrics_file();
    log_ = std::make_unique<detail::MetricsLog>(result_.metrics_path);
    tensorboard::EventWriter* events = context_->tensorboard_writer().events();
    log_->set_events(events, [this] { return context_->get_enable_tensorboard_logging(); });
    // TensorBoard drops what a crashed run wrote past the checkpoint, as trim_metrics does here.
    if (batches_trained_ > 0) events->purge_from(batches_trained_ + 1);
    record_run(placement);
  }
  nvtx_ = detail::make_nvtx_marker();
  timings_.set_marker(nvtx_.get());
  if (const auto& window = context_->profiler_window()) {
    // A run that resumes inside the window records the rest of it into a file of its own, named
    // from its first batch: the stopped run's trace of the window's start stays as it was.
    const std::int64_t first = std::clamp(batches_trained_ + 1, window->first, window->last);
    const std::string trace = core::TrialLayout{options_.trial_dir}.profiler_trace(comm_.rank(), first, window->last);
    profiler_ = std::make_unique<detail::BatchProfiler>(window->first, window->last, trace, timings_);
  }
  progress_ = std::make_unique<detail::Progress>(max_batches_, global_batch_, options_.progress_interval_s,
                                                 chief() && options_.progress_interval_s > 0);
  if (config_.profiling.system_metrics_period_seconds > 0) {
    const torch::Device device = context_->device();
    system_ = std::make_unique<detail::SystemMonitor>(device.is_cuda() ? std::max<int>(0, device.index()) : -1);
    last_system_sample_ = Clock::now();
  }
}

bool Loop::time_to_sample_system() const {
  return system_ && chief() &&
         std::chrono::duration<double>(Clock::now() - last_system_sample_).count() >=
             static_cast<double>(config_.profiling.system_metrics_period_seconds);
}

// Written as "rank<R>/<name>": each rank's own figures, the chief's among them.
void Loop::report_system() {
  if (!system_) return;
  const std::string mine = core::json_numbers(system_->sample()).dump();
  const auto parts = comm_.gather(mine, 0);
  last_system_sample_ = Clock::now();
  if (!log_) return;
  MetricValues metrics;
  for (std::size_t rank = 0; rank < parts.size(); ++rank) {
    const nlohmann::json figures = nlohmann::json::parse(parts[rank]);  // alive through the loop over its items
    for (const auto& [name, value] : figures.items()) {
      metrics["rank" + std::to_string(rank) + "/" + name] = core::number_of(value).value_or(std::nan(""));
    }
  }
  log_->write("system", batches_trained_, trained_epoch(), records_trained(), metrics);
}

// Lines a run wrote after its last checkpoint (it crashed, or was killed) would be written again
// by the resumed run: they go, so that metrics.jsonl reads as one uninterrupted run.
void Loop::trim_metrics(std::int64_t batches) {
  const std::string path = core::TrialLayout{options_.trial_dir}.metrics_file();
  std::error_code ignored;
  if (!std::filesystem::is_regular_file(path, ignored)) return;  // none yet, or not a file to rewrite
  std::ifstream in(path);
  if (!in) return;
  std::string kept;
  std::int64_t dropped = 0;
  for (std::string line; std::getline(in, line);) {
    bool keep = true;
    try {
      const auto j = nlohmann::json::parse(line);
      keep = j.value("batches", std::int64_t{0}) <= batches;
    } catch (const nlohmann::json::exception&) {
      keep = false;  // a line cut short by the crash
    }
    if (keep) {
      kept += line + "\n";
    } else {
      ++dropped;
    }
  }
  if (dropped == 0) return;
  core::write_file_atomic(path, kept);
  if (batches == 0) {
    core::log_info("dropped {} line(s) of {} written by a run that ended before its first checkpoint", dropped, path);
  } else {
    core::log_info("dropped {} line(s) of {} written after the checkpoint at batch {}", dropped, path, batches);
  }
}

void Loop::report_training() {
  if (period_batches_ == 0) return;
  MetricValues values;
  std::vector<double> means;
  {
    // Determined's from_device: the period's metrics to the host, summed where the values live
    // (one device-to-host copy per metric and period), widened exactly (at once where alike).
    detail::PhaseTimings::Scope from_device(timings_, "from_device");
    for (auto& [name, list] : period_values_) {
      const torch::Device device = list.front().device();
      const auto type = list.front().scalar_type();
      if (!std::all_of(list.begin(), list.end(), [&](auto& v) { return v.scalar_type() == type && v.device() == device; })) {
        for (auto& v : list) v = v.to(device, torch::kFloat64);
      }
      const torch::Tensor values = torch::stack(list).to(torch::kFloat64);
      means.push_back(values.sum().item<double>() / static_cast<double>(list.size()));
    }
  }
  detail::PhaseTimings::Scope t(timings_, "reduce_metrics");
  if (config_.optimizations.average_training_metrics && comm_.size() > 1) {
    // Over the ranks whose model-parallel unit reports metrics (every rank without one).
    const double weight = reports_metrics() ? 1.0 : 0.0;
    for (double& m : means) m *= weight;
    means.push_back(weight);
    comm_.allreduce(means, ReduceOp::kSum);
    const double reporting = means.back();
    means.pop_back();
    for (double& m : means) m /= reporting;
  }
  std::size_t i = 0;
  for (auto& [name, list] : period_values_) values[name] = means[i++];
  for (const auto& [name, value] : reduce_custom(true)) values[name] = value;
  if (values.count("loss")) last_loss_ = values["loss"];
  if (adaptive_) {
    for (const auto& [name, value] : adaptive_->metrics()) values[name] = value;
  }
  if (log_) {
    log_->write("training", batches_trained_, trained_epoch(), records_trained(), values);
    // The period's mean time of each phase, beside the metrics in TensorBoard.
    SummaryWriter& writer = context_->tensorboard_writer();
    for (const auto& [phase, ms] : timings_.period_means_ms()) {
      if (context_->get_enable_tensorboard_logging()) writer.add_scalar("timings/" + phase + "_ms", ms, batches_trained_);
    }
    writer.flush();
  }
  period_values_.clear();
  period_batches_ = 0;
  last_report_batches_ = batches_trained_;
}

namespace {

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

}  // namespace

void Loop::add_batch_metric(BatchMetric& into, const std::string& name, const torch::Tensor& value) const {
  const torch::Tensor t = value.to(torch::kCPU, torch::kFloat64).contiguous();
  const std::vector<std::int64_t> shape(t.sizes().begin(), t.sizes().end());
  const double* v = t.data_ptr<double>();
  const auto n = static_cast<std::size_t>(t.numel());
  if (into.batches == 0) {
    into.shape = shape;
    into.values.assign(v, v + n);
  } else {
    if (shape != into.shape) {
      if (into.error.empty()) {
        into.error = "evaluate_batch returned the metric '" + name + "' with shape " + shape_text(shape) + " after " +
                     shape_text(into.shape) + " on rank " + std::to_string(comm_.rank()) +
                     "; a metric has one shape in every batch (pad it, or report it through a reducer)";
      }
      return;
    }
    const Reducer reducer = reducers_.reducer_for(name);
    for (std::size_t i = 0; i < n; ++i) {
      double& acc = into.values[i];
      switch (reducer) {
        case Reducer::kAvg:
        case Reducer::kSum: acc += v[i]; break;
        case Reducer::kMax: acc = std::max(acc, v[i]); break;
        case Reducer::kMin: acc = std::min(acc, v[i]); break;
      }
    }
  }
  ++into.batches;
}

bool Loop::evaluate_local_batches(std::map<std::string, BatchMetric>& values) {
  // One batch; false when evaluate_batch is not overridden.
  const auto evaluate = [&](Batch batch) {
    call([](Callback& c) { c.on_validation_step_start(); });
    batch = context_->to_device(batch);
    Metrics metrics;
    try {
      const detail::AutocastScope autocast(context_->device(), context_->mixed_precision());
      metrics = trial_->evaluate_batch(batch);
    } catch (const detail::NotOverridden&) {
      return false;
    }
    MetricValues step;
    for (auto& [name, metric] : metrics) {
      const torch::Tensor& value = metric.tensor();
      if (chief()) step[name] = value.dim() == 0 ? MetricValue(value.item<double>()) : MetricValue(tensor_json(value));
      if (reports_metrics()) add_batch_metric(values[name], name, value);  // as its model-parallel unit says
    }
    if (chief()) call([&](Callback& c) { c.on_validation_step_end(step); });
    return true;
  };
  // A rank whose model-parallel unit reads no data evaluates its replica's batches without records.
  if (validation_loader_->is_stream()) {  // this replica's stream, pass 0
    for (Batch batch : *validation_loader_) {
      if (!evaluate(reads_data() ? std::move(batch) : Batch())) return false;
    }
    return true;
  }
  const auto batches = validation_batches(validation_loader_->dataset().size(),
                                          static_cast<std::uint64_t>(validation_loader_->batch_size()), replica(),
                                          replicas());
  for (const auto& indices : batches) {
    if (validation_loader_->drop_last() && static_cast<std::int64_t>(indices.size()) < validation_loader_->batch_size()) break;
    if (!evaluate(reads_data() ? validation_loader_->read(indices) : Batch())) return false;
  }
  return true;
}

MetricValues Loop::reduce_batch_metrics(std::map<std::string, BatchMetric>& values) {
  // Every rank reduces the same metrics, even one that had no batch, with the shape of the ranks
  // that had: "name\tshape\n" from every rank.
  // A rank's mistake is a line "!message": every rank fails with the first.
  std::string names;
  for (const auto& [name, metric] : values) {
    if (!metric.error.empty()) names += '!' + metric.error + '\n';
    names += name + '\t';
    for (std::int64_t size : metric.shape) names += std::to_string(size) + ',';
    names += '\n';
  }
  struct Shape {
    std::vector<std::int64_t> sizes;
    std::size_t rank;  // the first with it
  };
  std::map<std::string, Shape> shapes;
  const auto parts = comm_.allgather(names);
  for (const auto& part : parts) {  // rank order: the first rank's mistake
    std::istringstream lines(part);
    for (std::string line; std::getline(lines, line);) {
      if (!line.empty() && line[0] == '!') throw ConfigError(line.substr(1));
    }
  }
  for (std::size_t rank = 0; rank < parts.size(); ++rank) {
    std::istringstream lines(parts[rank]);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty() || line[0] == '!') continue;
      const std::size_t tab = line.find('\t');
      const std::string name = line.substr(0, tab);
      std::vector<std::int64_t> sizes;
      std::istringstream dims(line.substr(tab + 1));
      for (std::string dim; std::getline(dims, dim, ',');) sizes.push_back(std::stoll(dim));
      const auto [it, first] = shapes.emplace(name, Shape{sizes, rank});
      if (!first && it->second.sizes != sizes) {
        throw ConfigError("evaluate_batch returned the metric '" + name + "' with shape " + shape_text(it->second.sizes) +
                          " on rank " + std::to_string(it->second.rank) + " and " + shape_text(sizes) + " on rank " +
                          std::to_string(rank) + "; a metric has one shape in every batch");
      }
    }
  }
  MetricValues out;
  for (const auto& [name, known] : shapes) {
    const BatchMetric& mine = values[name];
    const std::vector<std::int64_t>& shape = known.sizes;
    std::int64_t numel = 1;
    for (std::int64_t size : shape) numel *= size;
    const auto n = static_cast<std::size_t>(numel);
    const Reducer reducer = reducers_.reducer_for(name);
    const bool max = reducer == Reducer::kMax;
    const double identity = reducer == Reducer::kAvg || reducer == Reducer::kSum
                                ? 0.0
                                : (max ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity());
    std::vector<double> reduced = mine.batches > 0 ? mine.values : std::vector<double>(n, identity);
    if (reducer == Reducer::kAvg) reduced.push_back(static_cast<double>(mine.batches));
    comm_.allreduce(reduced, reducer == Reducer::kMax ? ReduceOp::kMax
                             : reducer == Reducer::kMin ? ReduceOp::kMin
                                                        : ReduceOp::kSum);
    if (reducer == Reducer::kAvg) {
      const double batches = reduced.back();
      reduced.pop_back();
      for (double& v : reduced) v = batches > 0 ? v / batches : std::nan("");
    }
    if (shape.empty()) {
      out[name] = reduced.at(0);
    } else {
      out[name] = tensor_json(torch::from_blob(reduced.data(), shape, torch::kFloat64));
    }
  }
  return out;
}

void Loop::validate() {
  const rank::PhaseRecord phase(core::RankPhase::kValidation);
  faults_->at(rank::FaultPhase::kValidation, batches_trained_);
  detail::PhaseTimings::Scope t(timings_, "validation");
  call([](Callback& c) { c.on_validation_start(); });
  for (const auto& wrapped : context_->reducers()) {
    if (wrapped.for_validation) wrapped.reducer->reset();
  }
  for (auto& model : context_->models()) model->eval();
  MetricValues metrics;
  {
    torch::NoGradGuard no_grad;
    if (evaluate_by_batch_) {
      std::map<std::string, BatchMetric> values;  // per metric, over this rank's batches
      const bool overridden = evaluate_local_batches(values);
      if (!evaluation_agreed_) {
        // Only a rank with a validation batch learns whether evaluate_batch is overridden: every
        // rank takes the same path from here, or one would all-gather while another broadcasts.
        std::int64_t missing = overridden ? 0 : 1;
        comm_.allreduce(&missing, 1, DType::kInt64, ReduceOp::kMax);
        evaluation_agreed_ = true;
        evaluate_by_batch_ = missing == 0;
      }
      if (evaluate_by_batch_) metrics = reduce_batch_metrics(values);
    }
    if (!evaluate_by_batch_) {
      // evaluate_full_dataset runs on the chief; every rank gets its result.
      const rank::PhaseRecord evaluating(core::RankPhase::kEvaluate);
      faults_->at(rank::FaultPhase::kEvaluate, batches_trained_);
      std::string bytes;
      if (chief()) {
        try {
          const detail::AutocastScope autocast(context_->device(), context_->mixed_precision());
          nlohmann::json values = nlohmann::json::object();
          for (const auto& [name, value] : trial_->evaluate_full_dataset(*validation_loader_)) values[name] = value.value();
          bytes = cbor_bytes(values);
        } catch (const detail::NotOverridden&) {
          bytes = "missing";
        }
      }
      comm_.broadcast(bytes, 0);
      if (bytes == "missing") {
        throw ConfigError("the trial overrides neither evaluate_batch nor evaluate_full_dataset; "
                          "implement one of them to validate");
      }
      const nlohmann::json values = from_cbor_bytes(bytes);  // alive through the loop over its items
      for (const auto& [name, value] : values.items()) metrics.emplace(name, MetricValue(value));
    }
  }
  for (auto& model : context_->models()) model->train();
  for (const auto& [name, value] : reduce_custom(false)) metrics[name] = value;

  if (!checked_searcher_metric_) {
    checked_searcher_metric_ = true;
    if (metrics.count(config_.searcher.metric) == 0) {
      std::string names;
      for (const auto& [name, value] : metrics) names += (names.empty() ? "" : ", ") + name;
      throw ConfigError("searcher.metric is '" + config_.searcher.metric +
                        "' but validation reported only: " + (names.empty() ? "nothing" : names) +
                        "; return it from evaluate_batch or change searcher.metric");
    }
    if (!metrics.at(config_.searcher.metric).is_number()) {
      throw ConfigError("searcher.metric is '" + config_.searcher.metric + "', which validation reported as " +
                        metrics.at(config_.searcher.metric).to_json().dump() +
                        ", not a single number; the searcher compares numbers: name a scalar metric in searcher.metric");
    }
  }
  if (log_) {
    log_->write("validation", batches_trained_, trained_epoch(), records_trained(), metrics);
    context_->tensorboard_writer().flush();
  }
  result_.last_validation = metrics;
  last_validation_batches_ = batches_trained_;
  if (const auto it = metrics.find(config_.searcher.metric); it != metrics.end()) {
    const bool better = !best_metric_ || core::metric_better(it->second, *best_metric_, config_.searcher.smaller_is_better);
    if (better) best_metric_ = it->second;
  }
  last_validation_time_ = Clock::now();
  if (chief()) call([&](Callback& c) { c.on_validation_end(metrics); });  // the chief only, as in the reference
}

}  // namespace hpctrial::trainer::detail
