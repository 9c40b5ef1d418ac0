#include "parallel/pipeline_plan.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace {

void check_fill(std::size_t layers, int stages) {
  if (stages < 1) throw ConfigError("a pipeline needs 1 stage or more, not " + std::to_string(stages));
  if (layers < static_cast<std::size_t>(stages)) {
    throw ConfigError("a pipeline of " + std::to_string(layers) + " layer(s) cannot fill " + std::to_string(stages) +
                      " stages: each stage holds one layer or more; use fewer stages (engine.pipeline.stages)");
  }
}

}  // namespace

std::vector<std::size_t> partition_uniform(std::size_t layers, int stages) {
  check_fill(layers, stages);
  const std::size_t per = layers / static_cast<std::size_t>(stages);
  const std::size_t extra = layers % static_cast<std::size_t>(stages);
  std::vector<std::size_t> bounds = {0};
  for (std::size_t s = 0; s < static_cast<std::size_t>(stages); ++s) bounds.push_back(bounds.back() + per + (s < extra));
  return bounds;
}

// DeepSpeed's partition_balanced (deepspeed/runtime/utils.py at 38327e0, lines 583-621), step for
// step: over the first i layers in j stages, the last stage starting at k, keep the k whose stages'
// spread (heaviest - lightest, along the cuts kept before) is smallest, the last such k on a tie,
// in doubles with infinity for what cannot be cut, as its numpy arrays hold them.
std::vector<std::size_t> partition_balanced(const std::vector<std::int64_t>& weights, int stages) {
  check_fill(weights.size(), stages);
  for (std::size_t i = 0; i < weights.size(); ++i) {
    if (weights[i] < 0) throw InternalError("layer " + std::to_string(i) + " weighs " + std::to_string(weights[i]));
  }
  const std::size_t n = weights.size(), m = static_cast<std::size_t>(stages);
  if (n <= m) return partition_uniform(n, stages);
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const auto table = [&](double value) { return std::vector<std::vector<double>>(n + 1, std::vector<double>(m + 1, value)); };
  auto most = table(kInf), least = table(kInf), cost = table(kInf);
  std::vector<std::vector<std::size_t>> position(n + 1, std::vector<std::size_t>(m + 1, 0));
  std::vector<double> prefix(n + 1, 0.0);
  for (std::size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + static_cast<double>(weights[i]);
  most[0][0] = 0;
  cost[0][0] = 0;
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= std::min(i, m); ++j) {
      for (std::size_t k = 0; k < i; ++k) {
        const double part = prefix[i] - prefix[k];
        const double high = std::max(most[k][j - 1], part), low = std::min(least[k][j - 1], part);
        const double spread = high - low;
        if (cost[i][j] >= spread) {
          cost[i][j] = spread;
          most[i][j] = high;
          least[i][j] = low;
          position[i][j] = k;
        }
      }
    }
  }
  std::vector<std::size_t> bounds = {n};
  for (std::size_t j = m; j >= 1; --j) bounds.push_back(position[bounds.back()][j]);
  std::reverse(bounds.begin(), bounds.end());
  return bounds;
}

std::vector<std::size_t> partition_explicit(const std::vector<std::size_t>& bounds, std::size_t layers, int stages) {
  check_fill(layers, stages);
  std::string given;
  for (const auto bound : bounds) given += (given.empty() ? "" : ", ") + std::to_string(bound);
  const std::string what = "the pipeline's stage bounds [" + given + "]";
  if (bounds.size() != static_cast<std::size_t>(stages) + 1) {
    throw ConfigError(what + " name " + std::to_string(bounds.size()) + " bounds; " + std::to_string(stages) +
                      " stages need " + std::to_string(stages + 1) + ": the first layer of each stage, then " +
                      std::to_string(layers) + " (the number of layers)");
  }
  if (bounds.front() != 0 || bounds.back() != layers) {
    throw ConfigError(what + " must start at 0 and end at " + std::to_string(layers) + " (the number of layers)");
  }
  for (std::size_t s = 1; s < bounds.size(); ++s) {
    if (bounds[s] <= bounds[s - 1]) {
      throw ConfigError(what + " leave stage " + std::to_string(s - 1) +
                        " without a layer; each bound must be above the one before");
    }
  }
  return bounds;
}

std::vector<PipeOp> schedule_1f1b(int stages, int stage, std::int64_t micro_batches) {
  if (stages < 1 || stage < 0 || stage >= stages || micro_batches < 1) {
    throw InternalError("a 1F1B schedule of stage " + std::to_string(stage) + " of " + std::to_string(stages) +
                        " over " + std::to_string(micro_batches) + " micro-batch(es)");
  }
  const std::int64_t warmup = std::min<std::int64_t>(stages - stage - 1, micro_batches);
  std::vector<PipeOp> ops;
  std::int64_t forward = 0, backward = 0;
  for (; forward < warmup; ++forward) ops.push_back({PipeOp::Kind::kForward, forward});
  for (; forward < micro_batches; ++forward, ++backward) {
    ops.push_back({PipeOp::Kind::kForward, forward});
    ops.push_back({PipeOp::Kind::kBackward, backward});
  }
  for (; backward < micro_batches; ++backward) ops.push_back({PipeOp::Kind::kBackward, backward});
  return ops;
}

std::int64_t in_flight_1f1b(int stages, int stage, std::int64_t micro_batches) {
  return std::min<std::int64_t>(stages - stage, micro_batches);
}

std::string to_string(const std::vector<PipeOp>& schedule) {
  std::string out;
  for (const auto& op : schedule) {
    out += (out.empty() ? "" : " ") + std::string(op.kind == PipeOp::Kind::kForward ? "F" : "B") +
           std::to_string(op.micro_batch);
  }
  return out;
}

}  // namespace hpctrial::trainer::detail
