// The optimizer's state swapped to a file on a local disk between steps (DeepSpeed's
// offload_optimizer with device nvme; internal to the trainer).
//
// The optimizer's parameters (ZeRO's parts) are cut into sub-groups of at least
// `sub_group_elements` elements each, in order within each parameter group (DeepSpeed's
// sub_group_size). Between steps no state tensor holds memory: its bytes lie in one swap file a
// rank, read and written with direct I/O (O_DIRECT; through the page cache on a file system that
// refuses it, such as tmpfs). A step goes one sub-group at a time: its state read in (the next
// sub-group's read on another thread meanwhile, when the buffers allow), the optimizer stepped
// on its parameters only (the others' gradients are set aside, so the optimizer skips them),
// its state written out and released. The optimizer's update is element-wise and per parameter,
// so a step taken this way is bitwise the step taken at once.
//
// With `parameters` (ZeRO-3's offload_param on nvme) the optimizer's parameters, which are this
// rank's parts of the model's, live in the same file between uses and come in with their
// sub-group's state; bring_in() and let_go() read some of them in and out for a gather or a write.
//
// A state tensor stays the same object: only its storage's bytes come and go. Nothing but the
// optimizer's step of its sub-group may touch them; a checkpoint takes them with bytes_of().
// The gradients are freed as their sub-group steps.
#pragma once

#include <torch/torch.h>

#include "hpctrial/checkpoint/format.h"

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace hpctrial::trainer::detail {

struct SwapOptions {
  std::filesystem::path nvme_path;  // an existing directory on a local disk
  std::string key;                  // the config key that named it, for messages
  std::int64_t sub_group_elements = 1'000'000'000;
  // The state tensors of sub-groups in memory at once (DeepSpeed's buffer_count): at least a
  // sub-group's (Adam's two moments); twice that reads the next sub-group ahead.
  int buffer_count = 4;
  int rank = 0;
  // The optimizer's parameters (each with a storage of its own) swapped too.
  bool parameters = false;
};

// Parts of parameters cut before any optimizer exists (ZeRO-3's partitioned construction with
// offload_param on nvme), each written to a file on the local disk as soon as it is cut and its
// bytes freed (the tensor keeps its shape), until a StateSwapper takes it over. The file is
// unlinked as soon as it is made: it goes with the process, whatever ends it.
class PartSpill {
 public:
  // ConfigError naming `key` and the directory when no file can be made there.
  PartSpill(const std::filesystem::path& dir, std::string key);
  ~PartSpill();
  PartSpill(const PartSpill&) = delete;
  PartSpill& operator=(const PartSpill&) = delete;
  // Writes the part's bytes (a contiguous CPU tensor) and frees them; returns where they lie.
  std::int64_t write(const torch::Tensor& part);
  // The `nbytes` at `offset` into `into`.
  void read(std::int64_t offset, std::int64_t nbytes, void* into) const;

 private:
  std::string what() const { return "the parameters' parts in " + key_ + " " + dir_.string(); }
  std::filesystem::path dir_;
  std::string key_;
  int fd_ = -1;
  std::int64_t end_ = 0;
};

class StateSwapper {
 public:
  // A private directory under nvme_path for this rank's swap file; ConfigError naming the key
  // and the path when it cannot be made, or when the optimizer is not one of LibTorch's six.
  StateSwapper(torch::optim::Optimizer& optimizer, SwapOptions options);
  // The ConfigError of a nvme_path that is not a directory, before anything is taken over.
  static void check(const SwapOptions& options);
  // Removes the swap file and its directory.
  ~StateSwapper();
  StateSwapper(const StateSwapper&) = delete;
  StateSwapper& operator=(const StateSwapper&) = delete;

  // The optimizer's step, a sub-group at a time, every state tensor written out after it.
  void step();
  // Every state tensor in memory written out and released (after a load made them).
  void write_out_all();
  // The same for one parameter's state tensors (and itself, with `parameters`).
  void write_out_parameter(const torch::Tensor& parameter);
  // With `parameters`: those of `parameters` swapped out read into memory, and released again,
  // written out first when `changed`.
  void bring_in(const std::vector<torch::Tensor>& parameters);
  void let_go(const std::vector<torch::Tensor>& parameters, bool changed);
  // With `parameters`: a parameter whose bytes lie in `spill` at `offset` (PartSpill::write)
  // read in and written out to this swap's file, so that it is in memory only meanwhile.
  void take_over(const torch::Tensor& parameter, const PartSpill& spill, std::int64_t offset);
  // The bytes of a state tensor for a checkpoint, without reading them into memory: mapped
  // read-only from the file when it is swapped out (the next steps write that tensor elsewhere
  // in the file until the buffer is gone), copied when it is in memory.
  std::shared_ptr<const checkpoint::Buffer> bytes_of(const torch::Tensor& state);
  // The elements of state tensors in the swap file and not in memory (parameters not counted).
  std::int64_t swapped_elements() const;
  // Whether a state tensor's or parameter's bytes are in the file only.
  static bool swapped_out(const torch::Tensor& t) { return t.numel() > 0 && t.storage().nbytes() == 0; }
  const std::filesystem::path& file() const { return file_; }
  // Whether the file system took direct I/O.
  bool direct() const { return direct_.load(); }
  std::size_t sub_groups() const { return sub_groups_.size(); }

 private:
  // Where a state tensor's bytes lie in the file, and a checkpoint's mapping of them: `unmapped`
  // turns true once that mapping is gone (null: never mapped).
  struct Slot {
    std::int64_t offset = 0, nbytes = 0;
    std::weak_ptr<const void> mapping;
    void* mapped = nullptr;
    std::shared_ptr<std::atomic<bool>> unmapped;
  };
  // A region of the file a checkpoint may still map, and its length.
  struct Retired {
    std::int64_t offset = 0, length = 0;
    std::shared_ptr<std::atomic<bool>> unmapped;
  };
  static bool mapped(const std::shared_ptr<std::atomic<bool>>& unmapped) { return unmapped && !unmapped->load(); }
  struct Loaded;
  // The parameters of each sub-group (the optimizer's, in its order).
  void plan();
  std::vector<torch::Tensor> state_of(const torch::Tensor& parameter) const;
  // What is swapped of a parameter: its state tensors by field, and itself (kParameter) with `parameters`.
  static constexpr std::size_t kParameter = ~std::size_t{0};
  std::vector<std::pair<std::size_t, torch::Tensor>> swapped_of(const torch::Tensor& parameter) const;
  void add_entries(Loaded& loaded, const torch::Tensor& parameter,
                   const std::vector<std::pair<std::size_t, torch::Tensor>>& tensors);
  // Writes a tensor out (if in memory) and releases its storage.
  void write_tensor(const torch::Tensor& parameter, std::size_t field, const torch::Tensor& tensor);
  std::size_t fields(std::size_t sub_group);
  // A sub-group's state tensors out of memory (the optimizer's thread), their bytes read into
  // fresh buffers (any thread), and the buffers made their storage (the optimizer's thread).
  Loaded read(std::size_t sub_group);
  void fill(Loaded& loaded);
  void install(Loaded& loaded);
  // pread or pwrite the whole length (any thread); an EINVAL of direct I/O turns it off.
  void transfer(bool writing, char* data, std::int64_t length, std::int64_t offset);
  // Direct I/O off, with a warning (once).
  void buffered();
  void write_out(std::size_t sub_group);
  Slot& slot(const torch::Tensor& parameter, std::size_t field, std::int64_t nbytes);
  // Room for `length` bytes (aligned): a retired region no checkpoint maps any more, or the end.
  std::int64_t allocate(std::int64_t length);

  torch::optim::Optimizer& optimizer_;
  SwapOptions options_;
  std::filesystem::path dir_, file_;
  int fd_ = -1;
  std::atomic<bool> direct_{true};
  std::int64_t end_ = 0;  // the file's used length
  std::vector<std::vector<torch::Tensor>> sub_groups_;
  std::map<std::pair<const void*, std::size_t>, Slot> slots_;  // (parameter, field)
  // The slot of each state tensor written out, by its storage (which stays the same object).
  std::map<const void*, std::pair<const void*, std::size_t>> slot_of_storage_;
  std::vector<Retired> retired_;
};

}  // namespace hpctrial::trainer::detail
