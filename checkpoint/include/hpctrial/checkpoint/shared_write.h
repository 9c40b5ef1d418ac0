// A checkpoint that several processes write together, in the format of format.h: each rank
// writes its own bytes (its shard of ZeRO's optimizer state) into the one file, which holds whole
// logical tensors and reads like any other checkpoint.
//
//   chief:        FilePlan plan = plan_checkpoint(path, datasets, attributes);  // layout only
//                 ... every writer learns plan.offsets ...
//   each writer:  PieceWriter out(plan.temp); out.write(plan.offsets[i] + at, bytes, n); out.sync();
//                 ... the chief learns that every writer's bytes are durable, and their CRCs ...
//   chief:        finish_checkpoint(plan, crcs);  // the manifest, fsync, rename into place
//
// Until finish_checkpoint the file has its temporary name; abandon_checkpoint removes it. The
// manifest's space is reserved by the plan (the longest manifest the CRCs can make) and padded
// with spaces, which JSON readers skip.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/format.h"

namespace hpctrial::checkpoint {

struct DatasetSpec {
  std::string name;
  DType dtype = DType::kUInt8;
  std::vector<std::int64_t> shape;  // empty: a scalar
  std::size_t nbytes() const;
};

struct FilePlan {
  std::string path;  // where the checkpoint is published
  std::string temp;  // where its bytes are written meanwhile
  std::vector<DatasetSpec> datasets;
  std::vector<std::uint64_t> offsets;  // of each dataset's bytes in `temp` (0 when it has none)
  std::map<std::string, std::string> attributes;
  std::uint64_t manifest_offset = 0;
  std::size_t manifest_capacity = 0;
};

// Creates the temporary file with every dataset's space allocated (contiguous, no fill) and
// nothing written. CheckpointError or IoError naming the path on failure, with the temporary
// removed.
FilePlan plan_checkpoint(const std::string& path, std::vector<DatasetSpec> datasets,
                         std::map<std::string, std::string> attributes, const WriteOptions& options = {});

// Writes bytes into a planned file: whole 4 KiB blocks with O_DIRECT where the offset allows
// and the filesystem takes it, the rest through the page cache.
class PieceWriter {
 public:
  explicit PieceWriter(const std::string& temp, const WriteOptions& options = {});
  ~PieceWriter();
  PieceWriter(const PieceWriter&) = delete;
  PieceWriter& operator=(const PieceWriter&) = delete;
  void write(std::uint64_t file_offset, const void* data, std::size_t size);
  // Makes what was written durable and closes the file.
  void sync();

 private:
  FileSystem& fs_;
  std::string temp_;
  int buffered_ = -1;
  int direct_ = -1;
};

// With every dataset's bytes durable: writes the manifest with `crcs` (one per dataset, in plan
// order), fsyncs, and renames the file into place.
void finish_checkpoint(const FilePlan& plan, const std::vector<std::uint32_t>& crcs, const WriteOptions& options = {});
// Removes the temporary of a checkpoint that will not be finished.
void abandon_checkpoint(const FilePlan& plan, const WriteOptions& options = {});

}  // namespace hpctrial::checkpoint
