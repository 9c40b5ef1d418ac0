// hpctrial checkpoint list|inspect|verify|export: look at checkpoints without training code, and
// write a checkpoint's model as a file others read.
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/core/text.h"
#include "launch_options.h"
#include "verb.h"
#include "verb_args.h"

namespace hpctrial::cli {
namespace {

namespace fs = std::filesystem;
namespace po = boost::program_options;

constexpr const char* kUsage = R"(usage: hpctrial checkpoint list DIR [--json]
       hpctrial checkpoint inspect FILE [--json]
       hpctrial checkpoint verify FILE|DIR [FILE|DIR ...] [--json]
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
           For a PyTorch state_dict: python3 -m hpctrial_checkpoint FILE --out model.pt (the
           reader the hpctrial module puts on PYTHONPATH; scripts/ in the source tree)

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

int list(const std::string& dir, bool json) {
  require_directory(dir);
  checkpoint::CheckpointStore store(dir, {});
  const auto all = store.list(/*verify=*/false);
  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& info : all) {
      out.push_back({{"file", info.file},
                     {"path", (fs::path(dir) / info.file).string()},
                     {"batches", info.batches},
                     {"time", core::utc_iso(info.modified)},
                     {"bytes", info.size},
                     {"valid", info.valid},
                     {"problem", info.valid ? nlohmann::json() : nlohmann::json(info.problem)},
                     {"metric", info.metric ? core::json_number(*info.metric) : nlohmann::json()},
                     {"latest", info.latest}});
    }
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
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

int inspect(const std::string& file, bool json) {
  const checkpoint::Summary summary = checkpoint::read_summary(file);
  const auto manifest = nlohmann::json::parse(summary.manifest_json);
  std::uint64_t total = 0;
  for (const auto& d : manifest["datasets"]) total += d["nbytes"].get<std::uint64_t>();
  if (json) {
    nlohmann::json datasets = nlohmann::json::array();
    for (const auto& d : manifest["datasets"]) {
      datasets.push_back({{"name", d["name"]}, {"dtype", d["dtype"]}, {"shape", d["shape"]}, {"bytes", d["nbytes"]}});
    }
    const nlohmann::json out{{"file", file},
                             {"format_version", summary.format_version},
                             {"attributes", summary.attributes},
                             {"datasets", datasets},
                             {"bytes", total}};
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << file << "\n  format version: " << summary.format_version << "\n";
  for (const auto& [key, value] : summary.attributes) std::cout << "  " << key << ": " << value << "\n";
  std::cout << "  datasets:\n";
  for (const auto& d : manifest["datasets"]) {
    std::cout << "    " << std::left << std::setw(48) << d["name"].get<std::string>() << std::setw(10)
              << d["dtype"].get<std::string>() << std::setw(20) << d["shape"].dump() << std::right << std::setw(14)
              << d["nbytes"].get<std::uint64_t>() << " bytes\n";
  }
  std::cout << "  " << manifest["datasets"].size() << " datasets, " << total << " bytes\n";
  return kExitOk;
}

// The checkpoint files `targets` name: each file as given, each ckpt-*.h5 of a directory.
std::vector<std::string> checkpoint_files(const std::vector<std::string>& targets) {
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
  return files;
}

// On stderr, when it is a terminal and the files are large enough to take a while: how far the
// reading is, by bytes, at most once a second.
class VerifyProgress {
 public:
  static std::uintmax_t size_of(const std::string& file) {
    std::error_code ec;
    const auto size = fs::file_size(file, ec);
    return ec ? 0 : size;
  }
  explicit VerifyProgress(const std::vector<std::string>& files) : show_(isatty(STDERR_FILENO) == 1) {
    for (const auto& f : files) total_ += size_of(f);
  }
  void done(const std::string& file) {
    read_ += size_of(file);
    const auto now = std::chrono::steady_clock::now();
    if (!show_ || now - last_ < std::chrono::seconds(1) || now - start_ < std::chrono::seconds(2)) return;
    last_ = now;
    std::cerr << "\rverified " << read_ / (1024 * 1024) << " of " << total_ / (1024 * 1024) << " MiB" << std::flush;
    shown_ = true;
  }
  ~VerifyProgress() {
    if (shown_) std::cerr << "\n";
  }

 private:
  bool show_;
  bool shown_ = false;
  std::uintmax_t total_ = 0, read_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_{};
};

int verify(const std::vector<std::string>& targets, bool json) {
  const std::vector<std::string> files = checkpoint_files(targets);
  int bad = 0;
  nlohmann::json results = nlohmann::json::array();
  {
    VerifyProgress progress(files);
    for (const auto& file : files) {
      std::string problem;
      try {
        checkpoint::read_checkpoint(file);
      } catch (const Error& e) {
        ++bad;
        problem = e.what();
      }
      progress.done(file);
      if (json) {
        results.push_back({{"file", file}, {"ok", problem.empty()}, {"problem", problem.empty() ? nlohmann::json() : nlohmann::json(problem)}});
      } else {
        std::cout << (problem.empty() ? "ok   " + file : "BAD  " + problem) << "\n";
      }
    }
  }
  if (json) {
    std::cout << nlohmann::json{{"files", results}, {"bad", bad}}.dump(2) << "\n";
  } else if (files.empty()) {
    std::cout << "no checkpoint files in " << targets.front() << "\n";
  }
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

int usage_error(const std::string& message) {
  std::cerr << "hpctrial checkpoint: " << message << "\nrun 'hpctrial checkpoint --help' for usage\n";
  return kExitUsage;
}

int run_checkpoint(const std::vector<std::string>& args) {
  std::vector<std::string> positional;
  std::string model, part;
  bool json = false;
  VerbArgs command_line(kUsage);
  command_line.add_options()
      ("json", po::bool_switch(&json), "list, inspect, verify: print JSON (one document) instead of text")
      ("model", po::value(&model)->value_name("I"), "export: the wrapped model to write (default 0)")
      ("part", po::value(&part)->value_name("K"), "export: the part of a model its trial split over ranks");
  command_line.positional("positional", &positional);
  if (!command_line.parse(args)) return kExitOk;
  if (positional.empty()) {
    std::cout << kUsage;
    return kExitUsage;
  }
  const std::string action = positional[0];
  const std::vector<std::string> rest(positional.begin() + 1, positional.end());
  const bool known = action == "list" || action == "inspect" || action == "verify" || action == "export";
  if (!known) return usage_error("unknown action '" + action + "'; use list, inspect, verify or export");
  if (action != "export" && (!model.empty() || !part.empty())) {
    return usage_error("--model and --part belong to 'checkpoint export'");
  }
  if (action == "export" && json) return usage_error("--json belongs to list, inspect and verify");
  if (action == "list" && rest.size() == 1) return list(rest[0], json);
  if (action == "inspect" && rest.size() == 1) return inspect(rest[0], json);
  if (action == "verify" && !rest.empty()) return verify(rest, json);
  if (action == "export" && rest.size() == 2) {
    std::vector<std::string> forwarded = rest;
    if (!model.empty()) forwarded.insert(forwarded.end(), {"--model", model});
    if (!part.empty()) forwarded.insert(forwarded.end(), {"--part", part});
    return export_model(forwarded);
  }
  return usage_error("wrong number of arguments for " + action + " (got " + std::to_string(rest.size()) + ")");
}

}  // namespace

Verb checkpoint_verb() {
  return {"checkpoint", "list, inspect, verify or export checkpoints", run_checkpoint};
}

}  // namespace hpctrial::cli
