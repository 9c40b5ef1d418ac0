// The context folder an experiment freezes (frozen_code.h): scanned through its .hpctrialignore,
// digested, and copied once into the experiment's code folder.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <fmt/core.h>

#include "hpctrial/core/digest.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/frozen_code.h"
#include "hpctrial/core/ignore_rules.h"

namespace hpctrial::core {
namespace fs = std::filesystem;

namespace {

constexpr const char* kIgnoreFile = ".hpctrialignore";

struct Walk {
  const fs::path& root;
  const IgnoreRules& rules;
  ContextFolder& out;
  std::vector<std::pair<std::uintmax_t, std::string>> sizes;
};

void walk(Walk& w, const fs::path& folder) {
  std::vector<fs::directory_entry> entries;
  std::error_code ec;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) entries.push_back(*it);
  if (ec) throw IoError("context: cannot read " + folder.string() + ": " + ec.message());
  for (const auto& entry : entries) {
    const std::string rel = fs::relative(entry.path(), w.root).generic_string();
    const fs::file_status status = entry.symlink_status(ec);
    if (fs::is_directory(status)) {
      if (w.rules.ignored(rel, true)) continue;
      w.out.folders.push_back(rel);
      walk(w, entry.path());
    } else if (fs::is_regular_file(status)) {
      if (w.rules.ignored(rel, false)) continue;
      const std::uintmax_t size = entry.file_size(ec);
      if (ec) throw IoError("context: cannot read " + entry.path().string() + ": " + ec.message());
      w.out.files.push_back(rel);
      w.out.bytes += size;
      w.sizes.emplace_back(size, rel);
    } else if (!w.rules.ignored(rel, false)) {
      throw ConfigError("context: " + entry.path().string() + " is " +
                        (fs::is_symlink(status) ? "a symbolic link" : "neither a file nor a folder") +
                        "; hpctrial freezes files and folders only: copy what it points to into the folder, or list "
                        "it in " + (w.root / kIgnoreFile).string());
    }
  }
}

double mib(std::uintmax_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// The files' own digest: their paths, whether they are executable, and their bytes.
std::string digest_of(const fs::path& root, const ContextFolder& context) {
  Sha256 sha;
  for (const auto& folder : context.folders) sha.update("d " + folder + "\n");
  for (const auto& file : context.files) {
    const fs::path path = root / file;
    const bool executable = ::access(path.c_str(), X_OK) == 0;
    sha.update("f " + file + (executable ? " x " : " - ") + file_sha256(path.string()) + "\n");
  }
  return sha.hex();
}

}  // namespace

ContextFolder scan_context(const std::string& root, std::uintmax_t limit) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    throw ConfigError("context: " + root + " is not a folder; name the folder of the trial's own files (configs, "
                      "vocabularies, scripts) that the experiment freezes with its code");
  }
  const fs::path base(root);
  IgnoreRules rules;
  const fs::path ignore = base / kIgnoreFile;
  if (fs::is_regular_file(ignore, ec)) {
    std::ifstream in(ignore);
    std::stringstream text;
    text << in.rdbuf();
    if (!in) throw IoError("context: cannot read " + ignore.string());
    rules = IgnoreRules(text.str(), ignore.string());
  }
  ContextFolder out;
  out.root = root;
  Walk w{base, rules, out, {}};
  walk(w, base);
  if (out.bytes > limit) {
    std::sort(w.sizes.rbegin(), w.sizes.rend());
    std::string largest;
    for (std::size_t i = 0; i < std::min<std::size_t>(3, w.sizes.size()); ++i) {
      largest += fmt::format("{}{} ({:.1f} MiB)", i ? ", " : "", w.sizes[i].second, mib(w.sizes[i].first));
    }
    throw ConfigError(fmt::format(
        "context: {} holds {:.1f} MiB in {} files after {}, more than the {:.0f} MiB an experiment freezes; the "
        "largest: {}. List what the trial does not need in {} (data belongs under data:, read where it lies)",
        root, mib(out.bytes), out.files.size(), kIgnoreFile, mib(limit), largest, ignore.string()));
  }
  std::sort(out.folders.begin(), out.folders.end());
  std::sort(out.files.begin(), out.files.end());
  out.digest = digest_of(base, out);
  return out;
}

std::string frozen_context_path(const ExperimentLayout& layout, const std::string& digest) {
  return (fs::path(layout.code_dir()) / digest / "context").string();
}

std::string freeze_context(const ExperimentLayout& layout, const ContextFolder& context) {
  const fs::path target = frozen_context_path(layout, context.digest);
  std::error_code ec;
  if (fs::is_directory(target, ec)) return target.string();
  create_directories(layout.code_dir(), 0700);
  create_directories(target.parent_path().string(), 0700);
  // A temporary of this process's own, renamed into place whole.
  const fs::path temp = target.parent_path() / (".context." + std::to_string(::getpid()) + "." +
                                                std::to_string(std::random_device{}()) + ".tmp");
  create_directories(temp.string(), 0700);
  try {
    for (const auto& folder : context.folders) create_directories((temp / folder).string(), 0700);
    for (const auto& file : context.files) {
      const fs::path from = fs::path(context.root) / file;
      fs::copy_file(from, temp / file, fs::copy_options::overwrite_existing, ec);
      if (ec) throw IoError("cannot copy " + from.string() + " to " + (temp / file).string() + ": " + ec.message());
      const mode_t mode = ::access(from.c_str(), X_OK) == 0 ? 0700 : 0600;
      if (::chmod((temp / file).c_str(), mode) != 0) throw_errno("cannot set the mode of " + (temp / file).string(), errno);
    }
    ContextFolder copy = context;
    if (digest_of(temp, copy) != context.digest) {
      throw IoError("context: files of " + context.root + " changed while they were copied into " +
                    target.parent_path().string() + "; run the command again");
    }
    try {
      publish_file(temp.string(), target.string());
    } catch (const IoError&) {
      if (!fs::is_directory(target, ec)) throw;
      fs::remove_all(temp, ec);  // another command froze the same files meanwhile
    }
  } catch (...) {
    fs::remove_all(temp, ec);
    throw;
  }
  return target.string();
}

}  // namespace hpctrial::core
