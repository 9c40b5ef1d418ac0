#include "engine_trial.h"

HPCTRIAL_MAIN(engine_example::ClassifierTrial)
