// The mlp trial as a shared library, for hpctrial-worker and
// `entrypoint: ./libmlp_trial.so:mlp_example::MlpTrial`.
#include <hpctrial/trainer/trial_library.h>

#include "mlp_trial.h"

HPCTRIAL_EXPORT_TRIAL(mlp_example::MlpTrial)
