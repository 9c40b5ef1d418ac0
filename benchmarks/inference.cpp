// inference: batch inference through hpctrial (an experiment with `inference:`) against a plain
// LibTorch loop over the same data on one rank, and how hpctrial's rate grows with the ranks.
//
//   inference [--quick] [--records N] [--features N] [--hidden N] [--batch N] [--world-sizes 1,2]
//             [--rounds N] [--dir DIR]
//
// The data: --records synthetic records of --features float32 features in an HDF5 file; the
// model: an MLP features-hidden-hidden-10, its weights a checkpoint hpctrial trained for one
// batch. Both sides read the records with Hdf5Dataset in batches of --batch, run the model's
// forward under NoGradGuard on one thread a rank, and keep two outputs a record (the 10
// log-probabilities and the class), which end in a durable HDF5 file: the plain loop fills two
// tensors and writes them with the checkpoint writer at the end; hpctrial writes each rank's rows
// as it goes (loop/inference.cpp). Each side's time runs from nothing loaded to the file durable,
// weights and data read included. hpctrial runs under mpirun at each world size, in its own
// process (timed between barriers, so mpirun's start-up is not in it).
//
// Printed: records/s of the plain loop and of hpctrial at each world size (the median of
// --rounds, alternating which side goes first), hpctrial at 1 rank / plain (goal >= 0.95), and
// the scaling efficiency at N ranks, rate(N) / (N x rate(1)) (goal: near 1 while the ranks have
// cores of their own).
//
// --quick: 16384 records, 1 round, world sizes 1 and 2 - the test suite's smoke run.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/trainer.h"
#include "io_util.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  std::int64_t records = 131072;
  std::int64_t features = 128;
  std::int64_t hidden = 512;
  std::int64_t batch = 512;
  std::vector<int> world_sizes = {1, 2};
  int rounds = 3;
  std::string dir = "/tmp/hpctrial-bench-inference";
  bool worker = false;
  std::string run_dir;  // the worker's trial directory
};

struct NetImpl : torch::nn::Module {
  NetImpl(std::int64_t features, std::int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(features, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        out(register_module("out", torch::nn::Linear(hidden, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1->forward(x));
    x = torch::relu(fc2->forward(x));
    return torch::log_softmax(out->forward(x), 1);
  }
  torch::nn::Linear fc1, fc2, out;
};
TORCH_MODULE(Net);

class BenchTrial : public hpctrial::Trial {
 public:
  explicit BenchTrial(hpctrial::TrialContext& context) : context_(context) {
    data_ = std::make_shared<hpctrial::Hdf5Dataset>(context.data_config().at("records").get<std::string>());
    net_ = context.wrap_model(Net(context.hparam<std::int64_t>("features"), context.hparam<std::int64_t>("hidden")));
    optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(net_->parameters(), 0.01));
  }
  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t, std::int64_t) override {
    auto loss = torch::nll_loss(net_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    return {{"loss", loss}};
  }
  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override {
    return {{"validation_loss", torch::nll_loss(net_->forward(batch.data), batch.target)}};
  }
  hpctrial::Predictions predict_batch(hpctrial::Batch& batch) override {
    auto output = net_->forward(batch.data);
    return {{"log_probabilities", output}, {"class", output.argmax(1)}};
  }
  hpctrial::DataLoader build_training_data_loader() override { return {data_, context_.per_slot_batch_size()}; }
  hpctrial::DataLoader build_validation_data_loader() override {
    return {data_, context_.per_slot_batch_size(), false};
  }

 private:
  hpctrial::TrialContext& context_;
  std::shared_ptr<hpctrial::Hdf5Dataset> data_;
  Net net_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
};

std::string records_file(const Settings& s) { return s.dir + "/records.h5"; }
std::string trained_dir(const Settings& s) { return s.dir + "/trained"; }

hpctrial::core::ExperimentConfig config(const Settings& s, bool inference) {
  std::ostringstream yaml;
  yaml << "name: bench\nentrypoint: ./bench\n"
       << "hyperparameters: {global_batch_size: " << s.batch << ", features: " << s.features
       << ", hidden: " << s.hidden << "}\n";
  if (inference) {
    yaml << "inference: {checkpoint: " << trained_dir(s) << "/checkpoints, batch_size: " << s.batch
         << ", progress_period: {seconds: 30}}\n";
  } else {
    yaml << "searcher: {name: single, metric: validation_loss, max_length: {batches: 1}}\n";
  }
  yaml << "min_checkpoint_period: none\ndata: {records: " << records_file(s) << "}\n";
  const std::string path = s.dir + (inference ? "/inference.yaml" : "/train.yaml");
  std::ofstream(path) << yaml.str();
  return hpctrial::core::load_experiment_config({path, "", {}});
}

const hpctrial::trainer::TrialFactory kFactory = [](hpctrial::TrialContext& c) -> std::unique_ptr<hpctrial::Trial> {
  return std::make_unique<BenchTrial>(c);
};

// The records and the trained weights, once.
void prepare(const Settings& s) {
  std::filesystem::remove_all(s.dir);
  std::filesystem::create_directories(s.dir);
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({s.records, s.features});
  const torch::Tensor y = torch::randint(10, {s.records}, torch::kInt64);
  hpctrial::checkpoint::Contents contents;
  contents.add("x", hpctrial::core::DType::kFloat32, {s.records, s.features}, x.data_ptr());
  contents.add("y", hpctrial::core::DType::kInt64, {s.records}, y.data_ptr());
  hpctrial::checkpoint::write_checkpoint(records_file(s), contents);
  hpctrial::comm::LocalCommunicator alone;
  hpctrial::trainer::LoopOptions options;
  options.trial_dir = trained_dir(s);
  options.progress_interval_s = 0;
  hpctrial::trainer::run_training(config(s, false), kFactory, alone, options);
  config(s, true);  // written for the workers
}

// The plain loop: records/s from nothing loaded to the result durable.
double plain(const Settings& s, int round) {
  const auto started = Clock::now();
  Net net(s.features, s.hidden);
  const auto loaded = hpctrial::checkpoint::load_checkpoint_at(trained_dir(s) + "/checkpoints");
  for (auto& item : net->named_parameters()) {
    const hpctrial::checkpoint::Dataset& d = loaded.contents.at("model/0/" + item.key(), loaded.path);
    torch::NoGradGuard no_grad;
    std::memcpy(item.value().data_ptr(), d.data->data(), d.nbytes());
  }
  net->eval();
  hpctrial::Hdf5Dataset data(records_file(s));
  torch::Tensor probabilities = torch::empty({s.records, 10});
  torch::Tensor classes = torch::empty({s.records}, torch::kInt64);
  const torch::NoGradGuard no_grad;
  for (std::int64_t first = 0; first < s.records; first += s.batch) {
    const std::int64_t rows = std::min(s.batch, s.records - first);
    std::vector<std::int64_t> indices(static_cast<std::size_t>(rows));
    std::iota(indices.begin(), indices.end(), first);
    const hpctrial::Batch batch = data.get_batch(indices);
    const torch::Tensor output = net->forward(batch.data);
    probabilities.narrow(0, first, rows).copy_(output);
    classes.narrow(0, first, rows).copy_(output.argmax(1));
  }
  hpctrial::checkpoint::Contents result;
  result.add("log_probabilities", hpctrial::core::DType::kFloat32, {s.records, 10}, probabilities.data_ptr());
  result.add("class", hpctrial::core::DType::kInt64, {s.records}, classes.data_ptr());
  hpctrial::checkpoint::write_checkpoint(s.dir + "/plain-" + std::to_string(round) + ".h5", result);
  return static_cast<double>(s.records) / std::chrono::duration<double>(Clock::now() - started).count();
}

// One hpctrial run on this process's ranks: prints its records/s on the chief.
int worker(const Settings& s) {
  hpctrial::comm::MpiEnvironment mpi;
  hpctrial::comm::MpiCommunicator comm(mpi.world());
  hpctrial::trainer::LoopOptions options;
  options.trial_dir = s.run_dir;
  options.progress_interval_s = 0;
  options.distributed = {mpi.rank(), mpi.size(), mpi.local_rank(), mpi.local_size(), mpi.node_count()};
  const hpctrial::core::ExperimentConfig c = hpctrial::core::load_experiment_config({s.dir + "/inference.yaml", "", {}});
  comm.barrier();
  const auto started = Clock::now();
  const hpctrial::trainer::LoopResult result = hpctrial::trainer::run_training(c, kFactory, comm, options);
  comm.barrier();
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  if (comm.is_chief()) {
    const auto written = hpctrial::checkpoint::read_summary(result.predictions_path);
    if (written.attributes.at("records") != std::to_string(s.records)) return 1;
    std::printf("records/s %.1f\n", static_cast<double>(s.records) / seconds);
  }
  return 0;
}

double hpctrial_rate(const Settings& s, int world, int round, const char* self) {
  const std::string run_dir = s.dir + "/run-" + std::to_string(world) + "-" + std::to_string(round);
  hpctrial::core::RunOptions options;
  options.timeout = std::chrono::minutes(20);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}, {"OMP_NUM_THREADS", "1"}};
  const auto run = hpctrial::core::run_process(
      {HPCTRIAL_MPIRUN, "-np", std::to_string(world), "--oversubscribe", "--bind-to", "none", self, "--worker",
       "--dir", s.dir, "--run-dir", run_dir, "--records", std::to_string(s.records)},
      options);
  double rate = 0;
  if (!run.ok() || std::sscanf(run.out.c_str(), "records/s %lf", &rate) != 1 || !(rate > 0)) {
    std::fprintf(stderr, "hpctrial at %d rank(s) failed: %s\n%s%s\n", world, run.describe().c_str(), run.out.c_str(),
                 run.err.c_str());
    std::exit(1);
  }
  return rate;
}

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string value = i + 1 < argc ? argv[i + 1] : "";
    if (arg == "--quick") {
      s.records = 16384;
      s.rounds = 1;
      continue;
    }
    if (arg == "--worker") {
      s.worker = true;
      continue;
    }
    if (arg == "--records") s.records = std::stoll(value);
    else if (arg == "--features") s.features = std::stoll(value);
    else if (arg == "--hidden") s.hidden = std::stoll(value);
    else if (arg == "--batch") s.batch = std::stoll(value);
    else if (arg == "--world-sizes") s.world_sizes = hpctrial::bench::parse_int_list(value);
    else if (arg == "--rounds") s.rounds = std::stoi(value);
    else if (arg == "--dir") s.dir = value;
    else if (arg == "--run-dir") s.run_dir = value;
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--records N] [--features N] [--hidden N] [--batch N] "
                           "[--world-sizes 1,2] [--rounds N] [--dir DIR]\n", argv[0]);
      std::exit(2);
    }
    ++i;
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const Settings s = parse(argc, argv);
  torch::set_num_threads(1);
  hpctrial::bench::set_openblas_threads(1);
  if (s.worker) return worker(s);
  prepare(s);
  std::printf("batch inference: %lld records of %lld features, MLP %lld-%lld-%lld-10, batches of %lld, 1 thread a rank\n",
              static_cast<long long>(s.records), static_cast<long long>(s.features), static_cast<long long>(s.features),
              static_cast<long long>(s.hidden), static_cast<long long>(s.hidden), static_cast<long long>(s.batch));
  std::vector<double> plain_rates;
  std::vector<std::vector<double>> rates(s.world_sizes.size());
  for (int round = 0; round < s.rounds; ++round) {
    if (round % 2 == 0) plain_rates.push_back(plain(s, round));
    for (std::size_t w = 0; w < s.world_sizes.size(); ++w) rates[w].push_back(hpctrial_rate(s, s.world_sizes[w], round, argv[0]));
    if (round % 2 == 1) plain_rates.push_back(plain(s, round));
  }
  const double base = hpctrial::bench::median(plain_rates);
  std::printf("%-8s %14s %16s %12s\n", "ranks", "records/s", "ratio to plain", "efficiency");
  std::printf("%-8s %14.0f %16s %12s\n", "plain", base, "1.00", "-");
  double one = 0;
  double worst_efficiency = 1;
  for (std::size_t w = 0; w < s.world_sizes.size(); ++w) {
    const int world = s.world_sizes[w];
    const double rate = hpctrial::bench::median(rates[w]);
    if (world == 1) one = rate;
    const double efficiency = one > 0 ? rate / (world * one) : 0;
    if (one > 0 && world > 1) worst_efficiency = std::min(worst_efficiency, efficiency);
    std::printf("%-8d %14.0f %16.2f %12.2f\n", world, rate, rate / base, efficiency);
  }
  if (one > 0) std::printf("hpctrial at 1 rank / plain loop: %.2f (goal >= 0.95)\n", one / base);
  std::printf("worst scaling efficiency: %.2f (goal near 1 while each rank has a core)\n", worst_efficiency);
  return 0;
}
