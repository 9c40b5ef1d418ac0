// allreduce: bus bandwidth of hpctrial's bucketed gradient all-reduce against a plain
// MPI_Allreduce of the same bytes in the same messages, measured in one run.
//
//   mpirun -np 2 allreduce [--quick] [--sizes 1,4,25,64] [--seconds S] [--rounds N]
//
// --quick: 1 MiB and the model, 0.1 s per side, one round - the test suite's smoke run.
// For each size S MiB, "ours" is the gradient synchroniser that training uses: a parameter of S
// MiB whose gradient is one bucket, all-reduced through the communicator's background thread
// and waited for - what step_optimizer does. "plain" is MPI_Allreduce(MPI_IN_PLACE, S MiB,
// MPI_FLOAT, MPI_SUM) on a communicator of its own. A last line does the same for a model of
// many 1 MiB parameters in default 25 MiB buckets (after a first small bucket), against plain
// MPI_Allreduce calls of the same bucket sizes.
//
// Bus bandwidth = 2 (n - 1) / n x bytes / time, as nccl-tests reports it. Rounds alternate the
// two sides; the median round is reported. Goal: ours / plain >= 0.9 at every size.
#include <mpi.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "parallel/gradient_sync.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"

namespace {

using Clock = std::chrono::steady_clock;
using hpctrial::comm::MpiCommunicator;
using hpctrial::trainer::detail::GradientSync;

struct Options {
  std::vector<double> sizes_mib = {1, 4, 25, 64};
  double seconds = 1.0;  // per side and round
  int rounds = 5;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--quick") {
      o.sizes_mib = {1};
      o.seconds = 0.1;
      o.rounds = 1;
    } else if (arg == "--sizes") {
      o.sizes_mib.clear();
      std::stringstream list(value());
      for (std::string item; std::getline(list, item, ',');) o.sizes_mib.push_back(std::stod(item));
    } else if (arg == "--seconds") {
      o.seconds = std::stod(value());
    } else if (arg == "--rounds") {
      o.rounds = std::stoi(value());
    } else {
      std::fprintf(stderr, "usage: mpirun -np N %s [--quick] [--sizes 1,4,25,64] [--seconds S] [--rounds N]\n", argv[0]);
      std::exit(2);
    }
  }
  return o;
}

// Seconds per iteration of `body`, over about `seconds` (the same iteration count on every
// rank: rank 0 decides from a timed probe).
template <typename Body>
double time_per_iteration(MPI_Comm comm, double seconds, const Body& body) {
  body();  // warm up
  MPI_Barrier(comm);
  auto start = Clock::now();
  body();
  double probe = std::chrono::duration<double>(Clock::now() - start).count();
  MPI_Bcast(&probe, 1, MPI_DOUBLE, 0, comm);
  const int iterations = std::max(3, static_cast<int>(seconds / std::max(probe, 1e-6)));
  MPI_Barrier(comm);
  start = Clock::now();
  for (int i = 0; i < iterations; ++i) body();
  double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  MPI_Allreduce(MPI_IN_PLACE, &elapsed, 1, MPI_DOUBLE, MPI_MAX, comm);  // the slowest rank
  return elapsed / iterations;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Result {
  double ours_s = 0;
  double plain_s = 0;
};

// `parameters` are synchronised by GradientSync (default bucket layout for `bucket_cap_mb`);
// `messages` are the plain side's MPI_Allreduce sizes, in floats.
Result compare(const std::vector<torch::Tensor>& parameters, double bucket_cap_mb, const Options& options,
               MpiCommunicator& comm, MPI_Comm plain_comm, std::vector<std::int64_t>* bucket_bytes) {
  GradientSync::Options sync_options;
  sync_options.bucket_cap_mb = bucket_cap_mb;
  GradientSync sync(parameters, comm, nullptr, sync_options);
  *bucket_bytes = sync.bucket_bytes();
  std::vector<std::vector<float>> plain;
  for (std::int64_t bytes : *bucket_bytes) plain.emplace_back(static_cast<std::size_t>(bytes) / sizeof(float), 1.0f);
  std::int64_t batch = 0;
  std::vector<double> ours, theirs;
  for (int round = 0; round < options.rounds; ++round) {
    auto run_ours = [&] {
      return time_per_iteration(plain_comm, options.seconds, [&] {
        sync.reduce(batch++);
        sync.zeroed(parameters);  // what optimizer.zero_grad() tells it after the step
      });
    };
    auto run_plain = [&] {
      return time_per_iteration(plain_comm, options.seconds, [&] {
        for (auto& buffer : plain) {
          MPI_Allreduce(MPI_IN_PLACE, buffer.data(), static_cast<int>(buffer.size()), MPI_FLOAT, MPI_SUM, plain_comm);
        }
      });
    };
    if (round % 2 == 0) {
      ours.push_back(run_ours());
      theirs.push_back(run_plain());
    } else {
      theirs.push_back(run_plain());
      ours.push_back(run_ours());
    }
  }
  return {median(ours), median(theirs)};
}

}  // namespace

int main(int argc, char** argv) {
  hpctrial::comm::MpiEnvironment environment(&argc, &argv);
  const Options options = parse(argc, argv);
  const int n = environment.size();
  if (n < 2) {
    std::fprintf(stderr, "allreduce measures communication: run it with mpirun -np 2 (or more)\n");
    return 2;
  }
  torch::set_num_threads(1);
  MpiCommunicator comm(environment.world());
  const hpctrial::comm::MpiComm plain = hpctrial::comm::MpiComm::dup(environment.world());
  const MPI_Comm plain_comm = plain.get();
  const bool chief = environment.is_chief();
  const double bus = 2.0 * (n - 1) / n;
  auto report = [&](const std::string& label, double bytes, const Result& r) {
    const double ours = bus * bytes / r.ours_s / 1e9, plain = bus * bytes / r.plain_s / 1e9;
    if (chief) {
      std::printf("%-28s %10.2f GB/s %10.2f GB/s %8.3f\n", label.c_str(), ours, plain, ours / plain);
      std::fflush(stdout);
    }
    return ours / plain;
  };
  if (chief) {
    std::printf("all-reduce of float32 gradients, %d ranks (%s), median of %d rounds\n", n,
                environment.hostname().c_str(), options.rounds);
    std::printf("%-28s %15s %15s %8s\n", "size", "ours (bus bw)", "plain MPI", "ratio");
  }
  double worst = 1e9;
  for (double mib : options.sizes_mib) {
    const auto count = static_cast<std::int64_t>(mib * 1024 * 1024 / sizeof(float));
    std::vector<torch::Tensor> parameters = {torch::zeros({count}, torch::requires_grad())};
    std::vector<std::int64_t> buckets;
    const Result r = compare(parameters, std::max(mib, 1.0), options, comm, plain_comm, &buckets);
    char label[64];
    std::snprintf(label, sizeof label, "%g MiB, 1 message", mib);
    worst = std::min(worst, report(label, static_cast<double>(count) * sizeof(float), r));
  }
  {
    // A model: 64 parameters of 1 MiB in default buckets.
    std::vector<torch::Tensor> parameters;
    for (int i = 0; i < 64; ++i) parameters.push_back(torch::zeros({256 * 1024}, torch::requires_grad()));
    std::vector<std::int64_t> buckets;
    const Result r = compare(parameters, 25, options, comm, plain_comm, &buckets);
    std::string label = "64 MiB model, " + std::to_string(buckets.size()) + " buckets";
    worst = std::min(worst, report(label, 64.0 * 1024 * 1024, r));
  }
  if (chief) std::printf("worst ratio ours / plain: %.3f (goal >= 0.9)\n", worst);
  if (!std::isfinite(worst) || worst <= 0) {
    if (chief) std::fprintf(stderr, "allreduce: a side measured no bandwidth\n");
    return 1;
  }
  return 0;
}
