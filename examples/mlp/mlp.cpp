#include "mlp_trial.h"

HPCTRIAL_MAIN(mlp_example::MlpTrial)
