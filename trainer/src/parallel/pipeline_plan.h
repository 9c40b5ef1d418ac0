// Where a pipeline's layers go, and the order in which a stage runs its micro-batches (internal
// to the trainer; no LibTorch).
//
// Partitions cut the layers, in order, into one contiguous run per stage; each is given as its
// bounds: stage s holds layers [bounds[s], bounds[s + 1]). Every stage holds at least one layer.
//   uniform     balances the number of layers (DeepSpeed's partition_method "uniform": the first
//               layers % stages stages take one layer more)
//   parameters  balances a weight per layer, the count of parameters that train (DeepSpeed's
//               "parameters"), by DeepSpeed's partition_balanced: the cut that makes the spread
//               between the heaviest and the lightest stage smallest, found as its dynamic
//               program finds it (deepspeed/runtime/utils.py), ties to the later cut
//   type:REGEX  the same over a weight of 1 for each layer whose name REGEX finds (DeepSpeed's
//               "type:"), 0 for the others
//   explicit    the bounds a trial gives, checked
//
// The schedule is 1F1B (PipeDream-Flush, as Megatron-LM runs it, and DeepSpeed's TrainSchedule
// in effect): stage s of S runs min(S - s - 1, M) forwards to fill the pipeline, then one
// forward and one backward in turn, then the backwards left, so that it holds the activations of
// at most min(S - s, M) micro-batches at a time (GPipe holds all M). Each forward of a stage but
// the first takes its input from the stage before; each backward of a stage but the last takes
// its output's gradient from the stage after.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hpctrial::trainer::detail {

std::vector<std::size_t> partition_uniform(std::size_t layers, int stages);
// `weights`: one per layer, 0 or more.
std::vector<std::size_t> partition_balanced(const std::vector<std::int64_t>& weights, int stages);
// ConfigError unless `bounds` has stages + 1 entries from 0 to `layers`, each above the last.
std::vector<std::size_t> partition_explicit(const std::vector<std::size_t>& bounds, std::size_t layers, int stages);

struct PipeOp {
  enum class Kind { kForward, kBackward };
  Kind kind = Kind::kForward;
  std::int64_t micro_batch = 0;
  bool operator==(const PipeOp& other) const { return kind == other.kind && micro_batch == other.micro_batch; }
};

// Stage `stage`'s forwards and backwards of `micro_batches` micro-batches, in the order it runs them.
std::vector<PipeOp> schedule_1f1b(int stages, int stage, std::int64_t micro_batches);
// The most micro-batches whose activations the stage holds at once under that schedule.
std::int64_t in_flight_1f1b(int stages, int stage, std::int64_t micro_batches);
// "F0 F1 B0 F2 B1 B2": a schedule in one line (docs, tests, logs).
std::string to_string(const std::vector<PipeOp>& schedule);

}  // namespace hpctrial::trainer::detail
