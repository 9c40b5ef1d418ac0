// zero_memory: the largest model that trains on 2 ranks when each rank may allocate a fixed
// budget of memory, at ZeRO stages 0 to 3, at stage 3 with offload_optimizer on nvme, and with
// offload_param on nvme too (ZeRO-Infinity); the goal is stage 3 with offload >= 4x stage 0's.
//
//   build/benchmarks/zero_memory [--quick] [--budget-mb M] [--hidden H] [--prefetch ELEMENTS] [--mpirun PATH]
//                                [--dir DIR]
//
// (A probe alone, as the tests run one: --probe --stage S --layers L [--nvme] [--param]
// [--batches N] [--keep] [--prefetch ELEMENTS]; with --keep it resumes from the checkpoint a probe
// before left in --dir.)
//
// The model is a stack of layers of H x H (context.layered_module: ZeRO-3 gathers one layer at
// a time), trained with Adam for 3 global batches and a checkpoint, as an engine trial, with
// buckets of gradients (reduce_bucket_size) of two layers, sub-groups of about two layers' parts,
// a prefetch (stage3_prefetch_bucket_size) of one layer's weight and each layer released after
// its forward (stage3_max_reuse_distance 0). Each try
// is a run of its own (mpirun -np 2 of this program with --probe), in which every rank sets
// RLIMIT_DATA to its own data size after start-up plus the budget: an allocation past it fails,
// and the run with it. For each setting the layers double from 1 until a run fails, then halve
// the gap to the largest that trains. --quick: a budget of 96 MiB, layers of 256 x 256, doubling
// only, stage 0 and stage 3 with both offloads (the test suite's smoke run).
#include <dlfcn.h>
#include <malloc.h>
#include <mpi.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/shell_quote.h"
#include "hpctrial/trainer/training_loop.h"

namespace {

struct Options {
  bool quick = false, probe = false;
  std::int64_t budget_mb = 512, hidden = 512, layers = 1;
  int stage = 0;
  bool nvme = false, param = false;  // offload_optimizer, and offload_param, on nvme
  std::int64_t batches = 3;  // a probe trains this many global batches in all
  bool keep = false;         // a probe resumes from the trial directory another left
  std::int64_t prefetch = -1;  // stage3_prefetch_bucket_size; -1: one layer's weight
  std::string mpirun = "mpirun";
  std::string dir = "/tmp/hpctrial-bench-zero-memory";
};

std::int64_t batches_here = 0;  // trained by this process

class StackTrial : public hpctrial::EngineTrial {
 public:
  explicit StackTrial(hpctrial::EngineTrialContext& context) : context_(context) {
    const auto hidden = context.hparam<std::int64_t>("hidden");
    const auto layers = context.hparam<std::int64_t>("layers");
    torch::manual_seed(1);
    auto x = torch::randn({64, hidden});
    data_ = std::make_shared<hpctrial::TensorDataset>(x, x.sum(1, true));
    std::vector<hpctrial::LayerSpec> specs;
    for (std::int64_t k = 0; k < layers; ++k) {
      specs.push_back(hpctrial::LayerSpec::of<torch::nn::Linear>(hidden, hidden));
      specs.push_back(hpctrial::LayerSpec::function("tanh", [](const torch::Tensor& t) { return torch::tanh(t); }));
    }
    specs.push_back(hpctrial::LayerSpec::of<torch::nn::Linear>(hidden, std::int64_t{1}));
    model_ = context.layered_module(std::move(specs), [](const torch::Tensor& out, const torch::Tensor& target) {
      return torch::mse_loss(out, target);
    });
    auto optimizer = std::make_shared<torch::optim::Adam>(model_->parameters(), torch::optim::AdamOptions(1e-4));
    engine_ = context.wrap_model_engine(std::make_shared<hpctrial::ModelEngine>(model_.ptr(), optimizer));
  }
  hpctrial::Metrics train_batch(hpctrial::DataIterator& data, std::int64_t, std::int64_t) override {
    hpctrial::Batch batch = data.next();
    auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    engine_->backward(loss);
    engine_->step();
    ++batches_here;
    return {{"loss", loss}};
  }
  hpctrial::Metrics evaluate_batch(hpctrial::DataIterator& data, std::int64_t) override {
    hpctrial::Batch batch = data.next();
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }
  hpctrial::DataLoader build_training_data_loader() override {
    return {data_, context_.train_micro_batch_size_per_gpu()};
  }
  hpctrial::DataLoader build_validation_data_loader() override { return {data_, 8, false}; }

 private:
  hpctrial::EngineTrialContext& context_;
  std::shared_ptr<hpctrial::TensorDataset> data_;
  hpctrial::PipelineModule model_{nullptr};
  std::shared_ptr<hpctrial::ModelEngine> engine_;
};

// This process's data size (VmData: its private writable memory, what RLIMIT_DATA bounds).
std::int64_t data_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmData:", 0) == 0) return std::stoll(line.substr(7)) * 1024;
  }
  return 0;
}

// One try, on the ranks mpirun started: exit 0 when it trained.
int probe(const Options& o, int argc, char** argv) {
  // Every allocation of 128 KiB or more its own mapping, returned when freed: glibc's default
  // raises that threshold as large blocks are freed and serves them from its heap after, whose
  // holes count against the limit though nothing uses them.
  ::mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  // The trainer raises that threshold (to 32 MiB, keeping data batches' buffers) unless these say
  // otherwise: then every tensor of a model's layer would come from the heap, whose holes count.
  ::setenv("MALLOC_MMAP_THRESHOLD_", "131072", 1);
  ::setenv("MALLOC_TRIM_THRESHOLD_", "131072", 1);
  // One arena for every thread: glibc gives the threads that allocate (the trial's, the
  // communicator's) arenas of their own, whose heaps it shrinks after a free with madvise and
  // leaves writable, so that their high-water mark, not what they hold, counts against the limit.
  ::mallopt(M_ARENA_MAX, 1);
  // Every thread's stack 1 MiB of address space, not RLIMIT_STACK's 8 MiB: RLIMIT_DATA counts a
  // thread's whole stack, of which it touches a few pages, so that each thread a run starts after
  // start-up (a checkpoint's writer, stage 3's prefetch communicator) would take 8 MiB of the
  // budget that no memory limit of resident pages would.
  pthread_attr_t stack;
  if (::pthread_attr_init(&stack) != 0 || ::pthread_attr_setstacksize(&stack, 1 << 20) != 0 ||
      ::pthread_setattr_default_np(&stack) != 0) {
    std::fprintf(stderr, "cannot set the threads' stack size\n");
    return 2;
  }
  ::pthread_attr_destroy(&stack);
  hpctrial::comm::MpiEnvironment environment(&argc, &argv);
  hpctrial::core::set_log_level(hpctrial::core::LogLevel::kError);
  torch::set_num_threads(1);
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(1);
  // OpenBLAS takes its work buffer (128 MiB) at its first product, and retries for ever when it
  // cannot: taken before the limit, it is start-up.
  (void)torch::mm(torch::ones({64, 64}), torch::ones({64, 64}));
  hpctrial::comm::MpiCommunicator comm(environment.world());
  const std::string trial_dir = o.dir + "/trial";
  const std::string nvme = o.dir + "/nvme";
  if (comm.is_chief()) {
    if (!o.keep) std::filesystem::remove_all(trial_dir);
    std::filesystem::create_directories(nvme);
  }
  comm.barrier();
  // Buckets of gradients of about two layers (reduce_bucket_size's default, 5e8, makes one bucket
  // of the model, whose send buffer would hold every gradient); sub-groups of about two layers'
  // parts; the next layer's weight gathered while a layer computes.
  const std::int64_t bucket = 2 * o.hidden * o.hidden, sub_group = o.hidden * o.hidden;
  const std::string yaml =
      "name: zero-memory\nentrypoint: ./zero_memory\nsearcher: {name: single, metric: validation_loss, max_length: "
      "{batches: " + std::to_string(o.batches) + "}}\nhyperparameters: {global_batch_size: 16, hidden: " + std::to_string(o.hidden) +
      ", layers: " + std::to_string(o.layers) + "}\nengine: {zero_optimization: {stage: " + std::to_string(o.stage) +
      ", reduce_bucket_size: " + std::to_string(bucket) + ", sub_group_size: " + std::to_string(sub_group) +
      ", stage3_param_persistence_threshold: 0, stage3_max_reuse_distance: 0, stage3_prefetch_bucket_size: " +
      std::to_string(o.prefetch >= 0 ? o.prefetch : o.hidden * o.hidden) +
      (o.nvme ? ", offload_optimizer: {device: nvme, nvme_path: " + nvme + "}" : std::string()) +
      (o.param ? ", offload_param: {device: nvme, nvme_path: " + nvme + "}" : std::string()) + "}}\n"
      "min_validation_period: {batches: 1000}\nscheduling_unit: 1000000\n";
  hpctrial::core::Diagnostics d;
  const auto config = hpctrial::core::parse_experiment_config(hpctrial::core::parse_config_text(yaml, "bench", d), d);
  if (!d.empty()) {
    std::fprintf(stderr, "%s\n", d.to_string().c_str());
    return 2;
  }
  const rlim_t limit = static_cast<rlim_t>(data_bytes() + o.budget_mb * 1024 * 1024);
  const rlimit data{limit, limit};
  if (::setrlimit(RLIMIT_DATA, &data) != 0) {
    std::perror("setrlimit(RLIMIT_DATA)");
    return 2;
  }
  hpctrial::trainer::LoopOptions loop;
  loop.trial_dir = trial_dir;
  loop.progress_interval_s = 0;
  loop.distributed = {comm.rank(), comm.size(), comm.rank(), comm.size(), 1};
  try {
    const auto result = hpctrial::trainer::run_training(
        config, [](hpctrial::TrialContext& c) { return hpctrial::trainer::make_engine_trial<StackTrial>(c); }, comm,
        loop);
    if (comm.is_chief()) std::printf("trained %lld batches in this run\n", static_cast<long long>(batches_here));
    return result.batches_trained == o.batches ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", comm.rank(), e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);  // the other rank may wait in a collective
    return 1;
  }
}

// Whether `layers` train under the budget in a run of their own.
bool trains(const Options& o, const char* self, int stage, bool nvme, bool param, std::int64_t layers) {
  std::vector<std::string> args = {o.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", self, "--probe",
                                   "--stage", std::to_string(stage), "--layers", std::to_string(layers),
                                   "--hidden", std::to_string(o.hidden), "--budget-mb", std::to_string(o.budget_mb),
                                   "--dir", o.dir};
  if (nvme) args.push_back("--nvme");
  if (param) args.push_back("--param");
  if (o.prefetch >= 0) args.insert(args.end(), {"--prefetch", std::to_string(o.prefetch)});
  const std::string command =
      hpctrial::core::shell_join(args) + " > " + hpctrial::core::shell_quote(o.dir + "/probe.log") + " 2>&1";
  const int status = std::system(command.c_str());
  return status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// The most layers that train: doubling from 1 until a run fails, then (unless quick) bisecting.
std::int64_t largest(const Options& o, const char* self, int stage, bool nvme, bool param) {
  std::int64_t good = 0, bad = 1;
  while (bad <= 4096 && trains(o, self, stage, nvme, param, bad)) {
    good = bad;
    bad *= 2;
  }
  if (o.quick) return good;
  while (bad - good > 1) {
    const std::int64_t mid = (good + bad) / 2;
    (trains(o, self, stage, nvme, param, mid) ? good : bad) = mid;
  }
  return good;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "zero_memory: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--quick") {
      o.quick = true;
      o.budget_mb = 96;
      o.hidden = 256;
    } else if (arg == "--probe") {
      o.probe = true;
    } else if (arg == "--nvme") {
      o.nvme = true;
    } else if (arg == "--param") {
      o.param = true;
    } else if (arg == "--keep") {
      o.keep = true;
    } else if (arg == "--batches") {
      o.batches = std::stoll(value());
    } else if (arg == "--prefetch") {
      o.prefetch = std::stoll(value());
    } else if (arg == "--budget-mb") {
      o.budget_mb = std::stoll(value());
    } else if (arg == "--hidden") {
      o.hidden = std::stoll(value());
    } else if (arg == "--layers") {
      o.layers = std::stoll(value());
    } else if (arg == "--stage") {
      o.stage = std::stoi(value());
    } else if (arg == "--mpirun") {
      o.mpirun = value();
    } else if (arg == "--dir") {
      o.dir = value();
    } else {
      std::fprintf(stderr,
                   "usage: zero_memory [--quick] [--budget-mb M] [--hidden H] [--prefetch ELEMENTS] [--mpirun PATH] "
                   "[--dir DIR]\n");
      std::exit(2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.probe) return probe(o, argc, argv);
  std::filesystem::create_directories(o.dir);
  const std::string self = std::filesystem::canonical("/proc/self/exe").string();
  struct Setting {
    const char* name;
    int stage;
    bool nvme, param;
  };
  std::vector<Setting> settings = {{"0", 0, false, false}, {"1", 1, false, false}, {"2", 2, false, false},
                                   {"3", 3, false, false}, {"3+nvme", 3, true, false}, {"3+nvme+param", 3, true, true}};
  if (o.quick) settings = {{"0", 0, false, false}, {"3+nvme+param", 3, true, true}};
  const std::int64_t per_layer = o.hidden * o.hidden + o.hidden;
  std::printf("ranks 2, Adam, layers of %lld x %lld (%lld parameters), %lld MiB a rank above start-up\n",
              static_cast<long long>(o.hidden), static_cast<long long>(o.hidden), static_cast<long long>(per_layer),
              static_cast<long long>(o.budget_mb));
  std::printf("stage        largest model that trains (layers)  parameters\n");
  std::vector<std::int64_t> found;
  for (const auto& s : settings) {
    found.push_back(largest(o, self.c_str(), s.stage, s.nvme, s.param));
    std::printf("%-12s %10lld %14lld\n", s.name, static_cast<long long>(found.back()),
                static_cast<long long>(found.back() * per_layer + o.hidden + 1));
    std::fflush(stdout);
  }
  std::filesystem::remove_all(o.dir);
  if (found.front() == 0) {
    std::printf("stage 0 trains no model in the budget: raise --budget-mb\n");
    return 1;
  }
  if (!o.quick) {
    std::printf("largest model, stage 3 with offload_optimizer nvme / stage 0: %.4f\n",
                static_cast<double>(found[4]) / static_cast<double>(found.front()));
  }
  std::printf("largest model, stage 3 with offload_optimizer and offload_param nvme / stage 0: %.4f (goal >= 4)\n",
              static_cast<double>(found.back()) / static_cast<double>(found.front()));
  return 0;
}
