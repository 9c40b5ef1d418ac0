#include "cnn_trial.h"

HPCTRIAL_MAIN(cnn_example::CnnTrial)
