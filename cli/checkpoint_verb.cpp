// hpctrial checkpoint list|inspect|verify|export: look at checkpoints without training code, and
// write a checkpoint's model as a file others read.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/core/text.h"
#include "launch_options.h"
#include "verb.h"

namespace hpctrial::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kUsage = R"(usage: hpctrial checkpoint list DIR
       hpctrial checkpoint inspect FILE
       hpctrial checkpoint verify FILE|DIR [FILE|DIR ...]
       hpctrial checkpoint export FILE|DIR OUT [--model I] [--part K]

  list     the checkpoints of a trial's checkpoint directory, newest first: batches, time,
           size, whether the manifest reads, the searcher metric, and which one `latest` names
  inspect  a checkpoint's attributes and datasets (name, dtype, shape, bytes)
  verify   read every dataset of each file (each ckpt-*.h5 of a directory) and check its
           CRC-32C; exit code 1 when any file is bad
  export   write wrapped model I (default 0) of the checkpoint (a directory: its latest good
           one) to OUT as a LibTorch archive, joined from a pipeline's stages: C++ reads it with
           torch::load(model, "OUT"), Python with torch.jit.load("OUT").state_dict(). A model
           the trial split over ranks itself is exported one part at a time (--part K).
           For a PyTorch state_dict: python3 scripts/hpctrial_checkpoint.py FILE --out model.pt
)";

std::string time_text(std::time_t t) {
  std::tm tm{};
  localtime_r(&t, &tm);
  std::ostringstream out;
  out << std::put_time(&tm, "%Y-%m-%d %H:%M:%S");
  return out.str();
}

void require_directory(const std::string& dir) {
  if (!fs::is_directory(dir)) throw IoError(dir + " is not a directory (give a trial's checkpoint directory)");
}

int list(const std::string& dir) {
  require_directory(dir);
  checkpoint::CheckpointStore store(dir, {});
  const auto all = store.list(/*verify=*/false);
  if (all.empty()) {
    std::cout << "no checkpoints in " << dir << "\n";
    return kExitOk;
  }
  std::cout << std::left << std::setw(22) << "file" << std::right << std::setw(12) << "batches" << "  "
            << std::setw(19) << "time" << std::setw(11) << "MiB" << "  " << std::left << std::setw(7) << "valid"
            << std::setw(14) << "metric" << "latest\n";
  for (const auto& info : all) {
    std::ostringstream metric;
    if (info.metric) metric << std::setprecision(6) << *info.metric;
    std::cout << std::left << std::setw(22) << info.file << std::right << std::setw(12) << info.batches << "  "
              << std::setw(19) << time_text(info.modified) << std::setw(11) << std::fixed << std::setprecision(1)
              << static_cast<double>(info.size) / (1024.0 * 1024.0) << "  " << std::left << std::setw(7)
              << (info.valid ? "yes" : "NO") << std::setw(14) << (info.metric ? metric.str() : "-")
              << (info.latest ? "*" : "") << "\n";
    if (!info.valid) std::cout << "    " << info.problem << "\n";
  }
  return kExitOk;
}

int inspect(const std::string& file) {
  const checkpoint::Summary summary = checkpoint::read_summary(file);
  const auto manifest = nlohmann::json::parse(summary.manifest_json);
  std::cout << file << "\n  format version: " << summary.format_version << "\n";
  for (const auto& [key, value] : summary.attributes) std::cout << "  " << key << ": " << value << "\n";
  std::uint64_t total = 0;
  std::cout << "  datasets:\n";
  for (const auto& d : manifest["datasets"]) {
    std::cout << "    " << std::left << std::setw(48) << d["name"].get<std::string>() << std::setw(10)
              << d["dtype"].get<std::string>() << std::setw(20) << d["shape"].dump() << std::right << std::setw(14)
              << d["nbytes"].get<std::uint64_t>() << " bytes\n";
    total += d["nbytes"].get<std::uint64_t>();
  }
  std::cout << "  " << manifest["datasets"].size() << " datasets, " << total << " bytes\n";
  return kExitOk;
}

int verify(const std::vector<std::string>& targets) {
  std::vector<std::string> files;
  for (const auto& target : targets) {
    if (fs::is_directory(target)) {
      for (const auto& entry : fs::directory_iterator(target)) {
        if (checkpoint::checkpoint_batches(entry.path().filename().string())) files.push_back(entry.path().string());
      }
    } else {
      files.push_back(target);
    }
  }
  std::sort(files.begin(), files.end());
  int bad = 0;
  for (const auto& file : files) {
    try {
      checkpoint::read_checkpoint(file);
      std::cout << "ok   " << file << "\n";
    } catch (const Error& e) {
      ++bad;
      std::cout << "BAD  " << e.what() << "\n";
    }
  }
  if (files.empty()) std::cout << "no checkpoint files in " << targets.front() << "\n";
  return bad == 0 ? kExitOk : kExitFailure;
}

// Through hpctrial-worker, the program of ours that links LibTorch (this one does not).
int export_model(const std::vector<std::string>& rest) {
  const std::string worker = find_worker();
  if (worker.empty()) {
    throw IoError("hpctrial checkpoint export writes LibTorch archives through hpctrial-worker, which was not "
                  "found beside hpctrial; reinstall hpctrial or set HPCTRIAL_WORKER");
  }
  std::vector<std::string> argv{worker, "export"};
  argv.insert(argv.end(), rest.begin(), rest.end());
  const core::RunResult result = core::run_process(argv);
  if (!result.ok()) {
    std::cerr << (result.err.empty() ? result.describe() + "\n" : result.err);
    return result.exit_code == kExitUsage ? kExitUsage : kExitFailure;
  }
  std::cout << "wrote " << rest[1] << ": " << core::trim(result.out) << " tensors\n";
  return kExitOk;
}

int run_checkpoint(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << kUsage;
    return args.empty() ? kExitUsage : kExitOk;
  }
  const std::string action = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (action == "list" && rest.size() == 1) return list(rest[0]);
  if (action == "inspect" && rest.size() == 1) return inspect(rest[0]);
  if (action == "verify" && !rest.empty()) return verify(rest);
  if (action == "export" && rest.size() >= 2) return export_model(rest);
  const bool known = action == "list" || action == "inspect" || action == "verify" || action == "export";
  std::cerr << "hpctrial checkpoint: " << (known ? "wrong number of arguments for " + action
                                                 : "unknown action '" + action + "'; use list, inspect, verify or export")
            << "\nrun 'hpctrial checkpoint --help' for usage\n";
  return kExitUsage;
}

}  // namespace

Verb checkpoint_verb() {
  return {"checkpoint", "list, inspect, verify or export checkpoints", run_checkpoint};
}

}  // namespace hpctrial::cli
