// A trial's checkpoint directory: ckpt-<batches>.h5 files, the `latest` pointer, retention and
// recovery.
//
// publish() writes ckpt-<batches>.h5 atomically (format.h), then replaces `latest` (a one-line
// file naming it) the same way, then deletes what retention no longer keeps: the
// `save_trial_latest` newest and the `save_trial_best` best by the searcher metric stay, and
// never the file `latest` names. A crash at any point leaves `latest` naming a complete,
// verified file (or no `latest` at all before the first checkpoint).
//
// load_latest() reads and verifies the file `latest` names; when it is missing or bad, it says
// why and tries the other checkpoints, newest first. Temporary files of a crashed save are
// never read; remove_temporaries() deletes them.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <ctime>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/shared_write.h"

namespace hpctrial::checkpoint {

struct StoreOptions {
  int keep_latest = 1;
  int keep_best = 1;
  bool smaller_is_better = true;
  mode_t file_mode = 0600;
  mode_t dir_mode = 0700;
  bool direct_io = true;
  FileSystem* fs = nullptr;  // null: posix_file_system()
};

// Attribute names the store reads from every checkpoint.
constexpr const char* kBatchesAttribute = "batches";
constexpr const char* kMetricAttribute = "searcher_metric";

struct CheckpointInfo {
  std::string file;  // ckpt-<batches>.h5
  std::int64_t batches = 0;
  std::uint64_t size = 0;
  std::time_t modified = 0;
  bool valid = false;
  std::string problem;  // why not valid
  std::optional<double> metric;
  bool latest = false;
};

class CheckpointStore {
 public:
  // Creates `dir` with dir_mode (whatever the umask) when it does not exist.
  CheckpointStore(std::string dir, StoreOptions options);

  const std::string& dir() const { return dir_; }
  std::string path_for(std::int64_t batches) const;
  // `contents` must carry the "batches" attribute (and "searcher_metric" when known).
  void publish(const Contents& contents);
  // The same for a checkpoint several processes write (shared_write.h): plan() lays out
  // ckpt-<batches>.h5 for `attributes`' batches under its temporary name; once every writer's
  // bytes are durable, publish_planned() finishes it and moves `latest` and retention on.
  FilePlan plan(std::vector<DatasetSpec> datasets, std::map<std::string, std::string> attributes) const;
  void publish_planned(const FilePlan& plan, const std::vector<std::uint32_t>& crcs);
  void abandon(const FilePlan& plan) const;
  WriteOptions write_options() const;

  struct Loaded {
    std::string path;
    std::int64_t batches = 0;
    Contents contents;
  };
  // Judges a checkpoint that reads intact: throws CheckpointError to skip it for the previous
  // one (its progress cannot be read, say), ConfigError to stop looking and propagate (a
  // checkpoint of another experiment: not a damaged file, a mistake to report).
  using Acceptor = std::function<void(const Loaded&)>;
  // The newest good checkpoint (one that reads intact and that `accept` takes), or nullopt.
  // Each checkpoint rejected on the way is described in `problems` ("<path>: <reason>"). Each
  // candidate is read with `options`.
  std::optional<Loaded> load_latest(std::vector<std::string>* problems, const Acceptor& accept = {},
                                    const ReadOptions& options = {}) const;
  // The file `latest` names, when it names one in the right form.
  std::optional<std::string> latest_file() const;
  void remove_temporaries() const;
  // Every ckpt-*.h5, newest first; `verify` reads each whole file (else the manifest only).
  std::vector<CheckpointInfo> list(bool verify) const;

 private:
  void apply_retention(const std::string& keep);
  // Points `latest` at the published `path`, then applies retention.
  void point_latest_at(const std::string& path);
  FileSystem& fs() const;

  std::string dir_;
  StoreOptions options_;
};

// A checkpoint a user names: a file, read whole, or a checkpoint directory's newest good one.
// CheckpointError naming `path` (and each rejected checkpoint of a directory) when there is none.
CheckpointStore::Loaded load_checkpoint_at(const std::string& path);

// Whether `name` has the form ckpt-<digits>.h5; its batch count if so.
std::optional<std::int64_t> checkpoint_batches(const std::string& name);

}  // namespace hpctrial::checkpoint
