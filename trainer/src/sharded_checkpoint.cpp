#include "sharded_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace {

// Where a piece goes and its checksum, as the chief receives it.
struct PieceRecord {
  std::uint64_t dataset, offset, size;
  std::uint32_t crc;
};

std::string encode(const std::vector<ShardPiece>& pieces) {
  std::string out;
  for (const auto& p : pieces) {
    const PieceRecord r{p.dataset, p.offset, p.size, p.crc};
    out.append(reinterpret_cast<const char*>(&r), sizeof r);
  }
  return out;
}

std::vector<PieceRecord> decode(const std::string& bytes) {
  std::vector<PieceRecord> out(bytes.size() / sizeof(PieceRecord));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(PieceRecord));
  return out;
}

// A status every rank learns: empty when all went well, else what failed.
std::string agree(comm::Communicator& comm, const std::string& mine) {
  const auto all = comm.gather(mine, 0);
  std::string first;
  for (std::size_t r = 0; r < all.size() && first.empty(); ++r) {
    if (!all[r].empty()) first = "rank " + std::to_string(r) + ": " + all[r];
  }
  comm.broadcast(first, 0);
  return first;
}

// The checksum of each shared dataset from its pieces, which must tile it exactly.
std::vector<std::uint32_t> combine(const std::vector<checkpoint::DatasetSpec>& datasets,
                                   const std::vector<std::string>& gathered) {
  std::vector<std::vector<PieceRecord>> by_dataset(datasets.size());
  for (const auto& bytes : gathered) {
    for (const auto& r : decode(bytes)) {
      if (r.dataset >= datasets.size()) throw InternalError("a sharded piece names dataset " + std::to_string(r.dataset));
      by_dataset[r.dataset].push_back(r);
    }
  }
  std::vector<std::uint32_t> crcs;
  for (std::size_t d = 0; d < datasets.size(); ++d) {
    auto& pieces = by_dataset[d];
    std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
    std::uint64_t covered = 0;
    std::uint32_t crc = 0;
    for (const auto& p : pieces) {
      if (p.offset != covered) break;
      crc = covered == 0 ? p.crc : checkpoint::crc32c_combine(crc, p.crc, p.size);
      covered += p.size;
    }
    if (covered != datasets[d].nbytes()) {
      throw InternalError("the ranks' pieces of " + datasets[d].name + " cover " + std::to_string(covered) + " of its " +
                          std::to_string(datasets[d].nbytes()) + " bytes");
    }
    crcs.push_back(crc);
  }
  return crcs;
}

}  // namespace

std::string write_sharded_checkpoint(comm::Communicator& comm, checkpoint::CheckpointStore* store,
                                     const checkpoint::Contents& contents, const ShardedSave& mine,
                                     const checkpoint::WriteOptions& pieces) {
  const bool chief = comm.rank() == 0;
  const auto gathered = comm.gather(encode(mine.pieces), 0);

  // The layout, and where each shared dataset starts, from the chief.
  checkpoint::FilePlan plan;
  std::string error;
  if (chief) {
    try {
      std::vector<checkpoint::DatasetSpec> specs;
      for (const auto& d : contents.datasets) specs.push_back({d.name, d.dtype, d.shape});
      specs.insert(specs.end(), mine.datasets.begin(), mine.datasets.end());
      plan = store->plan(std::move(specs), contents.attributes);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  std::string where;
  if (chief && error.empty()) {
    where = plan.temp + '\n';
    where.append(reinterpret_cast<const char*>(plan.offsets.data() + contents.datasets.size()),
                 mine.datasets.size() * sizeof(std::uint64_t));
  }
  comm.broadcast(error, 0);
  if (!error.empty()) throw CheckpointError("rank 0: " + error);
  comm.broadcast(where, 0);
  const std::string temp = where.substr(0, where.find('\n'));
  std::vector<std::uint64_t> offsets(mine.datasets.size());
  std::memcpy(offsets.data(), where.data() + temp.size() + 1, offsets.size() * sizeof(std::uint64_t));

  // Every rank's pieces, durable before the chief finishes the file.
  std::string mine_error;
  try {
    checkpoint::PieceWriter out(temp, pieces);
    for (const auto& p : mine.pieces) {
      out.write(offsets[p.dataset] + p.offset, static_cast<const char*>(p.buffer->data()) + p.from, p.size);
    }
    out.sync();
  } catch (const Error& e) {
    mine_error = e.what();
  }
  error = agree(comm, mine_error);
  if (chief && !error.empty()) store->abandon(plan);
  if (!error.empty()) throw CheckpointError("a sharded checkpoint was not written: " + error);

  if (chief) {
    try {
      std::vector<std::uint32_t> crcs;
      checkpoint::PieceWriter out(plan.temp, store->write_options());
      for (std::size_t i = 0; i < contents.datasets.size(); ++i) {
        const auto& d = contents.datasets[i];
        if (d.nbytes() > 0) out.write(plan.offsets[i], d.data->data(), d.nbytes());
        crcs.push_back(d.crc32c_known ? d.crc32c : d.nbytes() > 0 ? checkpoint::crc32c(d.data->data(), d.nbytes()) : 0);
      }
      out.sync();
      const auto shared = combine(mine.datasets, gathered);
      crcs.insert(crcs.end(), shared.begin(), shared.end());
      store->publish_planned(plan, crcs);
    } catch (const Error& e) {
      store->abandon(plan);
      error = e.what();
    }
  }
  comm.broadcast(error, 0);
  if (!error.empty()) throw CheckpointError("a sharded checkpoint was not published: rank 0: " + error);
  std::string path = chief ? plan.path : std::string();
  comm.broadcast(path, 0);
  return path;
}

}  // namespace hpctrial::trainer::detail
