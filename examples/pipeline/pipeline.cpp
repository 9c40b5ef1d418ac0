#include "pipeline_trial.h"

HPCTRIAL_MAIN(pipeline_example::ClassifierTrial)
