// Running a trial as a program: `HPCTRIAL_MAIN(MyTrial)` is the whole main() of a trial
// executable. It runs the same under `mpirun -np 4 ./my_trial --config exp.yaml`, under
// `hpctrial run`/`launch`, or alone on one rank.
//
//   ./my_trial --config exp.yaml [--template site.yaml] [--set key=value ...] [--trial-dir DIR]
//
// The launcher's contract overrides the defaults: HPCTRIAL_CONFIG (the effective config),
// HPCTRIAL_TRIAL_DIR, HPCTRIAL_TRIAL_ID. SIGUSR1, SIGUSR2, SIGTERM and SIGINT are stop requests,
// honoured at the next step boundary by every rank together.
//
// Exit codes: 0 the trial finished (also when it ended itself early with set_stop_requested:
// it is complete, and running it again trains nothing); 75 it stopped on request (a signal, the
// stop file of `hpctrial pause`) after a durable checkpoint, and running it again resumes it; 2
// the config or command line is wrong; 1 any other failure (one rank failing ends every rank
// through MPI_Abort).
#pragma once

#include <memory>

#include "hpctrial/trainer/engine_trial.h"
#include "hpctrial/trainer/training_loop.h"
#include "hpctrial/trainer/trial.h"

namespace hpctrial::trainer {

int run_main(int argc, char** argv, const TrialFactory& factory);

}  // namespace hpctrial::trainer

#define HPCTRIAL_MAIN(TrialClass)                                                          \
  int main(int argc, char** argv) {                                                        \
    return ::hpctrial::trainer::run_main(argc, argv, [](::hpctrial::trainer::TrialContext& c) { \
      return ::hpctrial::trainer::make_any_trial<TrialClass>(c);                               \
    });                                                                                    \
  }
