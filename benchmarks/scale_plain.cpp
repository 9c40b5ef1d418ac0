// The peer of benchmarks/scale: the loop a LibTorch user writes with MPI alone, on the same
// tiny MLP and data - each step the batch sliced, forward, backward, the gradients averaged
// with one MPI_Allreduce, an SGD step, and a stop flag agreed on with a second MPI_Allreduce
// (SIGUSR2 sets it) - so that what `hpctrial run` costs at each world size is set against what
// the same work costs without it, on the same oversubscribed cores.
//
//   mpirun -np N scale_plain
//
// Rank 0 prints "first step ended at <wall ns>" and "cpu before MPI_Init <s> s" (the process's
// CPU time from its start to MPI_Init: loading, static initialisers) after step 0, "control
// plane median <ns> ns" at
// step 200 (the median time from a step's optimizer step to the next forward: the batch and the
// flag's agreement), and "stopped after step <n>" when every rank has agreed to stop.
#include <mpi.h>
#include <signal.h>
#include <sys/resource.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace {

volatile sig_atomic_t g_stop = 0;
extern "C" void on_usr2(int) { g_stop = 1; }

long long wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGUSR2, on_usr2);
  rusage before_mpi{};
  ::getrusage(RUSAGE_SELF, &before_mpi);
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  torch::set_num_threads(1);
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({4096, 8}), y = torch::randint(0, 4, {4096});
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  const torch::Tensor order = torch::randperm(4096);
  std::vector<double> gaps;
  long long last_end = 0;
  for (long long step = 0;; ++step) {
    const std::int64_t offset = (step * 4 * size + rank * 4) % 4096;
    const auto index = order.slice(0, offset, offset + 4);
    const auto data = x.index_select(0, index), target = y.index_select(0, index);
    if (last_end > 0) gaps.push_back(static_cast<double>(wall_ns() - last_end));
    auto loss = torch::nn::functional::cross_entropy(model->forward(data), target);
    optimizer.zero_grad();
    loss.backward();
    {
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> grads;
      for (const auto& p : model->parameters()) grads.push_back(p.grad().reshape(-1));
      torch::Tensor flat = torch::cat(grads);
      MPI_Allreduce(MPI_IN_PLACE, flat.data_ptr<float>(), static_cast<int>(flat.numel()), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
      flat.div_(size);
      std::int64_t at = 0;
      for (auto& p : model->parameters()) {
        p.mutable_grad().copy_(flat.slice(0, at, at + p.numel()).view_as(p));
        at += p.numel();
      }
    }
    optimizer.step();
    if (rank == 0 && step == 0) {
      const auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6; };
      std::printf("first step ended at %lld\ncpu before MPI_Init %.4f s\n", wall_ns(),
                  seconds(before_mpi.ru_utime) + seconds(before_mpi.ru_stime));
    }
    if (rank == 0 && step == 200) {
      std::nth_element(gaps.begin(), gaps.begin() + static_cast<std::ptrdiff_t>(gaps.size() / 2), gaps.end());
      std::printf("control plane median %.0f ns\n", gaps[gaps.size() / 2]);
    }
    std::fflush(stdout);
    last_end = wall_ns();
    long long stop = g_stop;
    MPI_Allreduce(MPI_IN_PLACE, &stop, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
    if (stop != 0) {
      if (rank == 0) std::printf("stopped after step %lld\n", step + 1);
      break;
    }
  }
  MPI_Finalize();
  return 0;
}
