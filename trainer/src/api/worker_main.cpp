// hpctrial-worker: runs a trial from a shared library named by the experiment config's
// `entrypoint: ./libmodel.so:MyTrial`.
#include "hpctrial/trainer/trial_library.h"

int main(int argc, char** argv) { return hpctrial::trainer::run_worker(argc, argv); }
