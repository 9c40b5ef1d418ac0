// A program that is not a trial, using hpctrial's core API.
//   core_api_program [hpctrial options] request|signal|wait STEPS
// request: the last rank asks to stop at step 5; signal: rank 0 raises SIGUSR2 at step 3;
// wait: steps of 20 ms until a stop request arrives from outside; throw (throw-chief): the last
// rank (rank 0) throws at step 3, caught in main, outside the CoreContext's scope.
//   core_api_program [hpctrial options] epochs EPOCHS STOP_AT   (see run_epochs)
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <hpctrial/trainer.h>

#include <stdexcept>

namespace {

// epochs EPOCHS STOP_AT: 40 samples in global batches of 8 for EPOCHS epochs through
// remaining_epochs_until, counted by an accumulator; the last rank asks to stop after STOP_AT
// batches in all (0: never), when the program saves its state and exits 75 to be resumed.
int run_epochs(hpctrial::CoreContext& context, long epochs, long stop_at) {
  const int rank = context.distributed().rank, size = context.distributed().size;
  auto seen = context.make_accumulator("seen");
  const nlohmann::json& saved = context.restored_state();
  long batches = saved.is_null() ? 0 : saved.at("batches").get<long>();
  hpctrial::TrainingSampler sampler(hpctrial::StreamOrder(40, 9, true), 8, rank, size);
  for (std::int64_t epoch : context.remaining_epochs_until(epochs)) {
    const bool resumed_here = !saved.is_null() && saved.at("epoch").get<std::int64_t>() == epoch;
    sampler.set_epoch(static_cast<std::uint64_t>(epoch), resumed_here ? saved.at("index").get<std::uint64_t>() : 0);
    std::printf("rank %d epoch %lld from %llu\n", rank, static_cast<long long>(*context.current_epoch()),
                static_cast<unsigned long long>(sampler.index()));
    try {
      for (auto inner : context.remaining_epochs_until(epochs)) (void)inner;
    } catch (const hpctrial::ConfigError& e) {
      if (epoch == 0 && rank == 0) std::printf("nested: %s\n", e.what());
    }
    {
      auto data_loop = context.data_loop();  // resumes where it saved: its synchronizations are never replayed
      while (sampler.epoch() == static_cast<std::uint64_t>(epoch)) {
        for (std::int64_t index : sampler.next_batch()) {
          (*seen)["records"] += 1;
          (*seen)["index_sum"] += static_cast<double>(index);
          (*seen)["epoch" + std::to_string(epoch)] += 1;
        }
        ++batches;
        if (batches == stop_at && rank == size - 1) context.request_stop();
        if (context.should_stop()) {
          context.save_state(nlohmann::json{{"batches", batches}, {"epoch", epoch}, {"index", sampler.index()}});
          std::printf("rank %d saved after %ld batches\n", rank, batches);
          return 75;
        }
      }
    }
    if (rank == 0) (*seen)["epochs_counted"] += 1;
    auto epoch_end = seen->synchronized();  // between loops: recorded, for a replay after a restart
  }
  auto guard = seen->synchronized();
  if (rank == 0) {
    std::printf("finished %lld epochs:", static_cast<long long>(context.finished_epochs()));
    for (const auto& [key, value] : seen->values()) std::printf(" %s=%.0f", key.c_str(), value);
    std::printf("\n");
  }
  return 0;
}

// epoch-exits: leaves one epoch loop by a break in epoch 1 and the next by an exception in
// epoch 2; each ends the epoch it left, as AdaptDL's does.
int run_epoch_exits(hpctrial::CoreContext& context) {
  for (std::int64_t epoch : context.remaining_epochs_until(5)) {
    if (epoch == 1) break;
  }
  std::printf("after a break in epoch 1: finished %lld\n", static_cast<long long>(context.finished_epochs()));
  try {
    for (std::int64_t epoch : context.remaining_epochs_until(5)) {
      if (epoch == 2) throw std::runtime_error("out of epoch 2");
    }
  } catch (const std::runtime_error& e) {
    std::printf("after an exception in epoch 2: finished %lld, current %s\n",
                static_cast<long long>(context.finished_epochs()), context.current_epoch() ? "set" : "none");
  }
  return 0;
}

int run(int argc, char** argv) {
  hpctrial::CoreContext context(argc, argv);
  if (argc == 4 && std::string(argv[1]) == "epochs") return run_epochs(context, std::atol(argv[2]), std::atol(argv[3]));
  if (argc == 2 && std::string(argv[1]) == "epoch-exits") return run_epoch_exits(context);
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s [hpctrial options] request|signal|wait STEPS\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const long steps = std::atol(argv[2]);
  const int rank = context.distributed().rank;
  long step = 1;
  for (; step <= steps; ++step) {
    if (mode == "request" && step == 5 && rank == context.distributed().size - 1) context.request_stop();
    if (mode == "signal" && step == 3 && rank == 0) ::raise(SIGUSR2);
    if (mode == "wait") ::usleep(20000);
    const bool thrower = mode == "throw" ? rank == context.distributed().size - 1 : mode == "throw-chief" && rank == 0;
    if (thrower && step == 3) throw std::runtime_error("bad record");
    if (step % 2 == 0) {
      context.report_training_metrics(step, {{"loss", 1.0 / static_cast<double>(step)}, {"rank", rank}});
    }
    if (context.should_stop()) break;
  }
  if (step > steps) step = steps;
  std::printf("rank %d stopped at step %ld\n", rank, step);
  std::fflush(stdout);
  context.report_validation_metrics(step, {{"steps", static_cast<double>(step)}});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "caught: %s\n", e.what());
    return 3;
  }
}
