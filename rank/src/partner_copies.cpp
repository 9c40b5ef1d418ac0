// A rank's copies sent to and kept by its partner on another node (partner_copies.h).
#include "hpctrial/rank/partner_copies.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <system_error>

#include "hpctrial/core/error.h"

namespace hpctrial::rank {
namespace {

constexpr std::size_t kPiece = std::size_t{1} << 30;  // an MPI count is an int
constexpr char kPartnerPrefix[] = "partner-";

}  // namespace

Partners partners_of(const std::vector<int>& node_of_rank, int rank) {
  std::map<int, std::vector<int>> ranks_of_node;  // in rank order
  for (int r = 0; r < static_cast<int>(node_of_rank.size()); ++r) ranks_of_node[node_of_rank[static_cast<std::size_t>(r)]].push_back(r);
  Partners p;
  if (ranks_of_node.size() < 2) return p;
  std::vector<int> nodes;
  for (const auto& [node, ranks] : ranks_of_node) nodes.push_back(node);
  // Rank r's partner: at r's place among the next node's ranks, modulo their number.
  const auto partner = [&](int r) {
    const int node = node_of_rank.at(static_cast<std::size_t>(r));
    const std::vector<int>& here = ranks_of_node[node];
    const auto place = static_cast<std::size_t>(std::find(here.begin(), here.end(), r) - here.begin());
    const auto next = std::upper_bound(nodes.begin(), nodes.end(), node);
    const std::vector<int>& there = ranks_of_node[next == nodes.end() ? nodes.front() : *next];
    return there[place % there.size()];
  };
  p.send_to = partner(rank);
  for (int r = 0; r < static_cast<int>(node_of_rank.size()); ++r) {
    if (r != rank && partner(r) == rank) p.receive_from.push_back(r);
  }
  return p;
}

std::vector<comm::WorkHandle> send_copy(comm::Communicator& comm, const std::optional<checkpoint::MemorySlots::Image>& image,
                                        int peer, std::vector<char>& no_header) {
  std::vector<comm::WorkHandle> sends;
  constexpr std::size_t header = checkpoint::MemorySlots::kHeaderBytes;
  if (!image || image->size < header) {
    no_header.assign(header, '\0');
    sends.push_back(comm.send_async(no_header.data(), header, core::DType::kUInt8, peer));
    return sends;
  }
  sends.push_back(comm.send_async(image->data, header, core::DType::kUInt8, peer));
  for (std::size_t at = header; at < image->size; at += kPiece) {
    sends.push_back(comm.send_async(image->data + at, std::min(kPiece, image->size - at), core::DType::kUInt8, peer));
  }
  return sends;
}

std::optional<std::int64_t> receive_copy(comm::Communicator& comm, checkpoint::MemorySlots& slots, int peer) {
  std::vector<char> header(checkpoint::MemorySlots::kHeaderBytes);
  comm.recv_async(header.data(), header.size(), core::DType::kUInt8, peer)->wait();
  std::optional<checkpoint::MemorySlots::Incoming> incoming = slots.accept(header.data());
  if (!incoming) return std::nullopt;
  std::vector<comm::WorkHandle> pieces;
  for (std::size_t at = 0; at < incoming->rest_size(); at += kPiece) {
    pieces.push_back(comm.recv_async(incoming->rest() + at, std::min(kPiece, incoming->rest_size() - at),
                                     core::DType::kUInt8, peer));
  }
  for (auto& piece : pieces) piece->wait();
  incoming->commit();
  return incoming->batches();
}

std::string partner_dir(const std::string& rank_dir, int source) {
  return rank_dir + "/" + kPartnerPrefix + std::to_string(source);
}

std::vector<int> partner_sources(const std::string& rank_dir) {
  std::vector<int> sources;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(rank_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kPartnerPrefix, 0) != 0 || !it->is_directory(ec)) continue;
    const std::string digits = name.substr(sizeof kPartnerPrefix - 1);
    if (digits.empty() || digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c) != 0; })) continue;
    sources.push_back(std::stoi(digits));
  }
  std::sort(sources.begin(), sources.end());
  return sources;
}

}  // namespace hpctrial::rank
