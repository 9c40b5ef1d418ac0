#include "state/sharded_checkpoint.h"

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

// A dataset's spec as one line: dtype, shape, name (which ends the line).
std::string spec_line(const checkpoint::DatasetSpec& spec) {
  std::string line = std::to_string(static_cast<int>(spec.dtype)) + " " + std::to_string(spec.shape.size());
  for (const auto extent : spec.shape) line += " " + std::to_string(extent);
  return line + " " + spec.name + "\n";
}

checkpoint::DatasetSpec parse_spec(const std::string& line) {
  checkpoint::DatasetSpec spec;
  std::size_t at = 0;
  const auto number = [&] {
    const std::size_t end = line.find(' ', at);
    const std::int64_t value = std::stoll(line.substr(at, end - at));
    at = end + 1;
    return value;
  };
  spec.dtype = static_cast<checkpoint::DType>(number());
  const auto rank = number();
  for (std::int64_t d = 0; d < rank; ++d) spec.shape.push_back(number());
  spec.name = line.substr(at);
  return spec;
}

}  // namespace

void add_whole_pieces(ShardedSave& mine, const checkpoint::Contents& part) {
  for (const auto& d : part.datasets) {
    const std::size_t index = mine.datasets.size();
    mine.datasets.push_back({d.name, d.dtype, d.shape});
    if (d.nbytes() == 0) continue;
    ShardPiece piece;
    piece.dataset = index;
    piece.buffer = d.data;
    piece.size = d.nbytes();
    piece.crc = checkpoint::crc32c(d.data->data(), d.nbytes());
    mine.pieces.push_back(std::move(piece));
  }
}

void unite_datasets(comm::Communicator& comm, ShardedSave& mine) {
  std::string lines;
  for (const auto& spec : mine.datasets) lines += spec_line(spec);
  std::vector<checkpoint::DatasetSpec> united;
  std::map<std::string, std::size_t> index;
  const auto all = comm.allgather(lines);
  for (std::size_t r = 0; r < all.size(); ++r) {
    std::size_t start = 0, end;
    while ((end = all[r].find('\n', start)) != std::string::npos) {
      checkpoint::DatasetSpec spec = parse_spec(all[r].substr(start, end - start));
      start = end + 1;
      const auto [it, added] = index.emplace(spec.name, united.size());
      if (added) {
        united.push_back(std::move(spec));
      } else if (united[it->second].dtype != spec.dtype || united[it->second].shape != spec.shape) {
        throw InternalError("rank " + std::to_string(r) + " writes " + spec.name + " with another type or shape "
                            "than a rank before it");
      }
    }
  }
  for (auto& piece : mine.pieces) piece.dataset = index.at(mine.datasets.at(piece.dataset).name);
  mine.datasets = std::move(united);
}

std::string agree(comm::Communicator& comm, const std::string& mine) {
  const auto all = comm.gather(mine, 0);
  std::string first;
  for (std::size_t r = 0; r < all.size() && first.empty(); ++r) {
    if (!all[r].empty()) first = "rank " + std::to_string(r) + ": " + all[r];
  }
  comm.broadcast(first, 0);
  return first;
}

std::vector<std::uint32_t> combine_piece_crcs(const std::vector<checkpoint::DatasetSpec>& datasets,
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

PieceLayout lay_out_pieces(comm::Communicator& comm, checkpoint::CheckpointStore* store,
                           std::vector<checkpoint::DatasetSpec> chief_datasets,
                           std::map<std::string, std::string> attributes, const ShardedSave& mine) {
  const bool chief = comm.rank() == 0;
  PieceLayout layout;
  layout.gathered = comm.gather(encode(mine.pieces), 0);
  std::string error;
  std::string where;
  if (chief) {
    try {
      const std::size_t own = chief_datasets.size();
      chief_datasets.insert(chief_datasets.end(), mine.datasets.begin(), mine.datasets.end());
      layout.plan = store->plan(std::move(chief_datasets), std::move(attributes));
      where = layout.plan.temp + '\n';
      where.append(reinterpret_cast<const char*>(layout.plan.offsets.data() + own),
                   mine.datasets.size() * sizeof(std::uint64_t));
    } catch (const Error& e) {
      error = e.what();
    }
  }
  comm.broadcast(error, 0);
  if (!error.empty()) throw CheckpointError("rank 0: " + error);
  comm.broadcast(where, 0);
  layout.temp = where.substr(0, where.find('\n'));
  layout.offsets.resize(mine.datasets.size());
  std::memcpy(layout.offsets.data(), where.data() + layout.temp.size() + 1, layout.offsets.size() * sizeof(std::uint64_t));
  return layout;
}

std::string write_pieces(const PieceLayout& layout, const ShardedSave& mine, const checkpoint::WriteOptions& options,
                         const std::function<void()>& midway) {
  try {
    checkpoint::PieceWriter out(layout.temp, options);
    for (std::size_t k = 0; k < mine.pieces.size(); ++k) {
      if (midway && k == mine.pieces.size() / 2) midway();
      const auto& p = mine.pieces[k];
      out.write(layout.offsets[p.dataset] + p.offset, static_cast<const char*>(p.buffer->data()) + p.from, p.size);
    }
    if (midway && mine.pieces.empty()) midway();
    out.sync();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

// Writes the chief's datasets into the planned file and makes them durable; their checksums.
std::vector<std::uint32_t> write_planned_datasets(const checkpoint::Contents& contents, const checkpoint::FilePlan& plan,
                                                  const checkpoint::WriteOptions& options) {
  std::vector<std::uint32_t> crcs;
  checkpoint::PieceWriter out(plan.temp, options);
  for (std::size_t i = 0; i < contents.datasets.size(); ++i) {
    const auto& d = contents.datasets[i];
    if (d.nbytes() > 0) out.write(plan.offsets[i], d.data->data(), d.nbytes());
    crcs.push_back(d.crc32c_known ? d.crc32c : d.nbytes() > 0 ? checkpoint::crc32c(d.data->data(), d.nbytes()) : 0);
  }
  out.sync();
  return crcs;
}

std::string write_sharded_checkpoint(comm::Communicator& comm, checkpoint::CheckpointStore* store,
                                     const checkpoint::Contents& contents, const ShardedSave& mine,
                                     const checkpoint::WriteOptions& pieces, const std::function<void()>& midway) {
  const bool chief = comm.rank() == 0;
  std::vector<checkpoint::DatasetSpec> own;
  for (const auto& d : contents.datasets) own.push_back({d.name, d.dtype, d.shape});
  const PieceLayout layout = lay_out_pieces(comm, store, std::move(own), contents.attributes, mine);

  // Every rank's pieces, durable before the chief finishes the file.
  std::string error = agree(comm, write_pieces(layout, mine, pieces, midway));
  if (chief && !error.empty()) store->abandon(layout.plan);
  if (!error.empty()) throw CheckpointError("a sharded checkpoint was not written: " + error);

  if (chief) {
    try {
      auto crcs = write_planned_datasets(contents, layout.plan, store->write_options());
      const auto shared = combine_piece_crcs(mine.datasets, layout.gathered);
      crcs.insert(crcs.end(), shared.begin(), shared.end());
      store->publish_planned(layout.plan, crcs);
    } catch (const Error& e) {
      store->abandon(layout.plan);
      error = e.what();
    }
  }
  comm.broadcast(error, 0);
  if (!error.empty()) throw CheckpointError("a sharded checkpoint was not published: rank 0: " + error);
  std::string path = chief ? layout.plan.path : std::string();
  comm.broadcast(path, 0);
  return path;
}

ShardedWriteInFlight::ShardedWriteInFlight(PieceLayout layout, ShardedSave mine, const checkpoint::WriteOptions& options,
                                           std::function<void()> midway, bool chief)
    : layout_(std::move(layout)), mine_(std::move(mine)) {
  shared_->outstanding = chief ? 2 : 1;  // the pieces; the chief's datasets
  thread_ = std::thread([this, options, midway = std::move(midway)] {
    part_done(*shared_, write_pieces(layout_, mine_, options, midway));
  });
}

ShardedWriteInFlight::~ShardedWriteInFlight() {
  thread_.join();
  abandon("the loop ended before every rank's pieces were durable");
}

void ShardedWriteInFlight::part_done(Shared& shared, const std::string& error) {
  std::lock_guard<std::mutex> lock(shared.mutex);
  if (shared.error.empty()) shared.error = error;
  --shared.outstanding;
  shared.changed.notify_all();
}

bool ShardedWriteInFlight::done() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->outstanding == 0;
}

std::string ShardedWriteInFlight::wait() {
  std::unique_lock<std::mutex> lock(shared_->mutex);
  shared_->changed.wait(lock, [&] { return shared_->outstanding == 0; });
  return shared_->error;
}

PlannedWrite ShardedWriteInFlight::planned() {
  PlannedWrite p;
  p.plan = layout_.plan;
  // The writer may outlive this object (it is told to abandon then): it holds the shared state.
  const std::shared_ptr<Shared> shared = shared_;
  p.written = [shared](const std::string& error) { part_done(*shared, error); };
  auto future = std::make_shared<std::shared_future<std::vector<std::uint32_t>>>(shared->crcs.get_future().share());
  p.pieces = [future] { return future->get(); };
  return p;
}

void ShardedWriteInFlight::publish(std::vector<std::uint32_t> crcs) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  if (shared_->settled) return;
  shared_->settled = true;
  shared_->crcs.set_value(std::move(crcs));
}

void ShardedWriteInFlight::abandon(const std::string& why) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  if (shared_->settled) return;
  shared_->settled = true;
  shared_->crcs.set_exception(std::make_exception_ptr(CheckpointError("a sharded checkpoint was abandoned: " + why)));
}

}  // namespace hpctrial::trainer::detail
