#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <torch/torch.h>

#include <boost/program_options.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <vector>

#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/search.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/comm/nccl_communicator.h"
#include "hpctrial/trainer/load.h"
#include "hpctrial/trainer/main.h"
#include "hpctrial/trainer/trial_library.h"
#include "hpctrial/rank/bootstrap.h"
#include "hpctrial/rank/runtime.h"
#include "hpctrial/rank/stop_signals.h"
#include "api/search_rungs.h"
#include "api/rank_identity.h"
#include "data/staging.h"

namespace po = boost::program_options;

namespace hpctrial::trainer {
namespace {

using core::kExitConfig;
using core::kExitFailed;
using core::kExitFinished;
using core::kExitStopped;

struct Arguments {
  core::ConfigSources sources;
  std::string trial_dir;
  double progress_seconds = 10;
  bool allow_fresh_start = false;
  bool allow_config_change = false;
  bool help = false;
};

Arguments parse_arguments(int argc, char** argv, const core::RankContract& contract) {
  Arguments args;
  po::options_description options("options");
  options.add_options()
      ("help,h", "show this help")
      ("config,c", po::value(&args.sources.config_path)->value_name("EXP.yaml"),
       "the experiment config (default: $HPCTRIAL_CONFIG)")
      ("template,t", po::value(&args.sources.template_path)->value_name("T.yaml"),
       "a template merged under the config")
      ("set,s", po::value(&args.sources.overrides)->value_name("KEY.PATH=VALUE")->composing(),
       "override one config value (repeatable)")
      ("trial-dir", po::value(&args.trial_dir)->value_name("DIR"),
       "where metrics.jsonl and the effective config go (default: $HPCTRIAL_TRIAL_DIR, else "
       "runs/<name>)")
      ("progress-seconds", po::value(&args.progress_seconds)->value_name("S"),
       "seconds between progress lines on stderr; 0 for none (default 10)")
      ("allow-fresh-start", po::bool_switch(&args.allow_fresh_start),
       "when checkpoints exist but none is usable, train from the start instead of refusing")
      ("allow-config-change", po::bool_switch(&args.allow_config_change),
       "resume a checkpoint written with other hyperparameters");
  po::variables_map vm;
  po::store(po::command_line_parser(argc, argv).options(options).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << "usage: " << argv[0] << " --config EXP.yaml [options]\n\n"
              << "Trains this trial as the experiment config says. Run it alone, under "
                 "`mpirun -np N`, or through `hpctrial`.\n\n"
              << options;
    args.help = true;
    return args;
  }
  if (args.sources.config_path.empty()) args.sources.config_path = contract.config;
  if (args.sources.config_path.empty()) {
    throw ConfigError(std::string("no experiment config: give --config EXP.yaml (see ") + argv[0] + " --help)");
  }
  if (args.trial_dir.empty()) args.trial_dir = contract.trial_dir;
  return args;
}

// The experiment seed every rank uses: the config's, or one the chief picks and shares.
std::uint32_t agree_on_seed(const core::ExperimentConfig& config, comm::Communicator& communicator) {
  if (config.reproducibility.experiment_seed) return *config.reproducibility.experiment_seed;
  std::string bytes;
  if (communicator.is_chief()) {
    const auto now = std::chrono::system_clock::now().time_since_epoch().count();
    bytes = std::to_string(static_cast<std::uint32_t>(now ^ (now >> 32)));
  }
  communicator.broadcast(bytes, 0);
  const auto seed = static_cast<std::uint32_t>(std::stoul(bytes));
  if (communicator.is_chief()) {
    core::log_info("reproducibility.experiment_seed is not set; using {} (recorded in the effective "
                   "config: set it to repeat this run)", seed);
  }
  return seed;
}

// Each rank computes with the cores of its slot: resources.cpus_per_slot threads for LibTorch
// and for OpenBLAS (when that is the BLAS in use), unless the user chose with OMP_NUM_THREADS
// or OPENBLAS_NUM_THREADS. Otherwise every rank would start a thread per core of the node.
void use_slot_cores(int cpus_per_slot, const core::EnvSource& env) {
  if (env.get("OMP_NUM_THREADS") || env.get("OPENBLAS_NUM_THREADS")) return;
  torch::set_num_threads(cpus_per_slot);
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(cpus_per_slot);
  }
  core::log_debug("computing with {} thread(s) per rank (resources.cpus_per_slot)", cpus_per_slot);
}

// The communicator for gradients on GPUs: NCCL, bootstrapped over MPI, on this rank's device.
std::unique_ptr<comm::Communicator> make_device_communicator(const core::ExperimentConfig& config,
                                                                     const comm::MpiEnvironment& mpi,
                                                                     comm::Watchdog* watchdog) {
  if (config.resources.gpus_per_slot == 0 || mpi.size() == 1) return nullptr;
  if (!comm::nccl_available()) {
    throw ConfigError("resources.gpus_per_slot is " + std::to_string(config.resources.gpus_per_slot) +
                      " but this build of hpctrial has no NCCL; set resources.gpus_per_slot: 0 or "
                      "rebuild with CUDA and NCCL");
  }
  return comm::make_nccl_communicator(mpi.world(), mpi.local_rank(), watchdog);
}

// The training loop's options: from the arguments, the config, the launch contract and the
// ranks' layout. With other ranks, a failure in the loop ends them all.
LoopOptions make_loop_options(const Arguments& args, const core::ExperimentConfig& config,
                              rank::RankBootstrap& bootstrap, comm::Communicator* device_comm) {
  const core::RankContract& contract = bootstrap.contract();
  const comm::MpiEnvironment& mpi = bootstrap.mpi();
  LoopOptions options;
  options.trial_dir = args.trial_dir.empty() ? core::default_experiment_dir(config.name)
                                             : args.trial_dir;
  options.trial_id = contract.trial_id;
  options.experiment_dir = contract.experiment_dir;
  options.restart_count = contract.restart_count;
  options.experiment_seed = *config.reproducibility.experiment_seed;
  options.distributed = {mpi.rank(), mpi.size(), mpi.local_rank(), mpi.local_size(), mpi.node_count(), mpi.node_index()};
  options.progress_interval_s = args.progress_seconds;
  options.report_period_batches = config.scheduling_unit;
  options.external_stop = &rank::stop_signal_received();
  options.device_communicator = device_comm;
  options.allow_fresh_start = args.allow_fresh_start;
  options.allow_config_change = args.allow_config_change;
  options.stop_file = contract.stop_file;
  options.fault = contract.fault;
  options.code_digest = contract.code_digest;
  options.session = contract.session;
  if (!bootstrap.alone()) {
    options.on_failure = [&bootstrap](int code, const std::string& message) { bootstrap.fail(code, message); };
  }
  if (!contract.search_worker.empty()) {
    options.search_in_place = true;
    if (mpi.rank() == 0) {
      const detail::SearchRungs rungs = detail::search_rungs(contract.experiment_dir, contract.trial_id, contract.search_worker);
      options.search_target = rungs.target;
      options.search_rung_reached = rungs.reached;
    }
  }
  return options;
}

// The chief says how training ended; the exit code says it to the launcher.
int report_training_end(const LoopResult& result, bool chief) {
  if (result.stopped_early) {
    if (chief) {
      if (!result.predictions_path.empty()) {
        core::log_info("stopped after {} records predicted in this run; their progress, {}, is durable; the next "
                       "run goes on from it", result.records_predicted, result.checkpoint_path);
      } else {
        core::log_info("stopped after {} batches; checkpoint {} is durable; the next run resumes from it",
                       result.batches_trained, result.checkpoint_path);
      }
    }
    return kExitStopped;
  }
  if (chief && !result.predictions_path.empty()) {
    core::log_info("finished: {} records predicted in this run; the predictions are in {}", result.records_predicted,
                   result.predictions_path);
  } else if (chief) {
    core::log_info("finished{}: {} batches; metrics in {}",
                   result.ended_by_trial ? " early, as the trial asked (set_stop_requested)" : "",
                   result.batches_trained, result.metrics_path);
  }
  return kExitFinished;
}

// The factory, chosen once the config is known (HPCTRIAL_MAIN: fixed; the worker: from the
// config's entrypoint).
using FactoryResolver = std::function<TrialFactory(const core::ExperimentConfig&)>;

int run(int argc, char** argv, const FactoryResolver& resolve) {
  core::ProcessEnv env;
  core::init_logging(env);
  std::unique_ptr<rank::RankBootstrap> rank;
  try {
    rank = std::make_unique<rank::RankBootstrap>(env);
    rank->start_mpi(&argc, &argv);
  } catch (const ConfigError& e) {
    std::cerr << argv[0] << ": " << e.what() << "\n";
    return kExitConfig;
  } catch (const Error& e) {
    std::cerr << argv[0] << ": " << e.what() << "\n";
    return kExitFailed;
  }
  const core::RankContract& contract = rank->contract();
  const comm::MpiEnvironment& mpi = rank->mpi();
  const bool chief = mpi.is_chief();
  // Declared outside the try, like the bootstrap: a failure is handled while it exists.
  std::unique_ptr<comm::Communicator> device_comm;

  try {
    rank->start_record();
    const Arguments args = parse_arguments(argc, argv, contract);
    if (args.help) return kExitFinished;
    // As early as MPI allows, so that a stop request at start-up is not lost...
    rank::install_stop_handlers();
    // This trial's values of the searcher's ranges.
    core::ExperimentConfig config = core::rank_config(core::load_experiment_config(args.sources), contract);
    use_slot_cores(config.resources.cpus_per_slot, env);
    rank->start_communicator(std::chrono::seconds(config.optimizations.collective_timeout_seconds));
    comm::Communicator& communicator = rank->communicator();
    device_comm = make_device_communicator(config, mpi, rank->watchdog());
    // ...and again once MPI and NCCL are up, so that no handler of theirs replaces ours.
    rank::install_stop_handlers();
    config.reproducibility.experiment_seed = agree_on_seed(config, communicator);

    const LoopOptions options = make_loop_options(args, config, *rank, device_comm.get());
    if (chief) {
      core::create_directories(options.trial_dir, config.checkpoint_storage.group_readable ? 0750 : 0700);
      core::write_file_atomic(core::TrialLayout{options.trial_dir}.effective_config(), core::to_yaml(config));
    }

    const TrialFactory factory = resolve(config);
    const detail::RankIdentity identity =
        detail::rank_identity(contract.experiment_dir, options.trial_dir, config.name, communicator);
    LoopOptions loop_options = options;
    loop_options.identity_dir = identity.recorded_in;
    const bool stager = mpi.local_rank() == 0;
    const std::string staged =
        detail::stage_data(config, communicator, stager, detail::stage_owner(identity.identity, contract.trial_id),
                           core::host_name(), mpi.node_index());
    const LoopResult result = run_training(config, factory, communicator, loop_options);
    // A stopped trial's next run on this node reuses the copies; a complete one needs them no more.
    if (!result.stopped_early) detail::remove_staged_data(staged, communicator, stager);
    rank->finish();  // every rank got here: the goodbyes of a good end
    const int code = report_training_end(result, chief);
    // The stop's checkpoint is durable: the launcher may end this rank if finalizing hangs.
    if (code == kExitStopped) rank::record_exit(code);
    return code;
  } catch (const InvalidHP& e) {
    return rank->fail(core::kExitInvalidHP, std::string("the trial's hyperparameters are invalid: ") + e.what());
  } catch (const ConfigError& e) {
    return rank->fail(kExitConfig, e.what());
  } catch (const po::error& e) {
    return rank->fail(kExitConfig, std::string(argv[0]) + ": " + e.what() + " (see --help)");
  } catch (const std::exception& e) {
    return rank->fail(kExitFailed, e.what());
  }
}

// `hpctrial-worker export CKPT OUT [--model I] [--part K]`: export_model, for `hpctrial
// checkpoint export` (which names the errors first: this prints them as they are).
int run_export(int argc, char** argv) {
  std::vector<std::string> positional;
  int model = 0;
  std::optional<int> part;
  po::options_description options("options");
  options.add_options()("model", po::value(&model), "the wrapped model")("part", po::value<int>(), "the part")(
      "file", po::value(&positional)->composing(), "CKPT OUT");
  po::positional_options_description files;
  files.add("file", -1);
  try {
    po::variables_map vm;
    po::store(po::command_line_parser(argc, argv).options(options).positional(files).run(), vm);
    po::notify(vm);
    if (vm.count("part")) part = vm["part"].as<int>();
    if (positional.size() != 2) throw ConfigError("usage: hpctrial-worker export CKPT OUT [--model I] [--part K]");
    const std::size_t tensors = export_model(positional[0], positional[1], model, part);
    std::cout << tensors << "\n";
    return kExitFinished;
  } catch (const ConfigError& e) {
    std::cerr << "hpctrial-worker export: " << e.what() << "\n";
    return kExitConfig;
  } catch (const po::error& e) {
    std::cerr << "hpctrial-worker export: " << e.what() << "\n";
    return kExitConfig;
  } catch (const std::exception& e) {
    std::cerr << "hpctrial-worker export: " << e.what() << "\n";
    return kExitFailed;
  }
}

}  // namespace

int run_main(int argc, char** argv, const TrialFactory& factory) {
  return run(argc, argv, [&](const core::ExperimentConfig&) { return factory; });
}

int run_worker(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "export") return run_export(argc - 1, argv + 1);
  return run(argc, argv, [](const core::ExperimentConfig& config) -> TrialFactory {
    if (config.entrypoint.kind != core::Entrypoint::Kind::kLibrary) {
      throw ConfigError("entrypoint: '" + config.entrypoint.argv.front() +
                        "' is a program; run it directly. hpctrial-worker runs trials from "
                        "libraries: entrypoint: ./libmodel.so:MyTrial");
    }
    return load_trial_library(config.entrypoint.library, config.entrypoint.trial_class);
  });
}

}  // namespace hpctrial::trainer
