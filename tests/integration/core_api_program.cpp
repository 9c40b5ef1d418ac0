// A program that is not a trial, using hpctrial's core API.
//   core_api_program [hpctrial options] request|signal|wait STEPS
// request: the last rank asks to stop at step 5; signal: rank 0 raises SIGUSR2 at step 3;
// wait: steps of 20 ms until a stop request arrives from outside; throw (throw-chief): the last
// rank (rank 0) throws at step 3, caught in main, outside the CoreContext's scope.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <hpctrial/trainer.h>

#include <stdexcept>

namespace {

int run(int argc, char** argv) {
  hpctrial::CoreContext context(argc, argv);
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
