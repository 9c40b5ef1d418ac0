// ZeRO's sharded optimizer step (stages 1, 2 and 3; internal to the trainer).
//
// The parameters of each parameter group are laid end to end in one flat float32 buffer, in
// buckets of whole parameters (about `bucket_elements` each; DeepSpeed's reduce_bucket_size);
// each bucket is padded to a multiple of the number of data-parallel ranks and split into equal
// parts, rank r owning part r of every bucket. The model's parameters become views into the
// buffer. The optimizer is given this rank's parts in place of the group's parameters, so that
// its state (Adam's moments, SGD's momentum) exists for this rank's shard only: 1/N of it per
// rank. A step averages the gradients over the ranks into each rank's parts (a reduce-scatter
// per bucket), steps the parts, and all-gathers them back into the buffer, where every rank's
// model reads them.
//
// Inside begin_backward()/end_backward() a hook on each parameter's gradient accumulator moves
// its gradient into its bucket as soon as backward produces it and frees it; a complete bucket's
// reduce-scatter starts at once on the communicator's thread while backward goes on with
// earlier layers, and its result accumulates into this rank's parts. Buckets start in the same
// order on every rank (the reverse of the layout's), so the collectives match. Stage 2 does
// this in every backward, so that no rank holds more than its shard of the gradients plus the
// buckets in flight, at the cost of a reduce-scatter per micro-batch. Stage 1 does it in the
// backward of the step's last micro-batch only: the ones before accumulate whole gradients in
// the parameters, as stage 0 does, and the step reduces them once.
//
// A persistent parameter (stage3_param_persistence_threshold: a small one) is partitioned like
// any other, its part what the optimizer steps and checkpoints hold, but its whole value stays
// gathered on every rank: gathered when the optimizer is made and again after each step (one
// all-gather for all of a group's, as DeepSpeed's _post_step), and never released.
//
// Stage 3 partitions the parameters too, as DeepSpeed's partition_parameters.py does: each
// parameter on its own, flattened and padded to a multiple of the ranks (ceil(numel / ranks)
// elements a rank; the layout's buckets are then one parameter each), rank r owning part r. A
// rank holds only its parts (in its swap file between uses, with offload_param on nvme: a gather
// reads the parts it sends, a step its sub-group's); the model's parameters are released
// (empty) until gather() brings their whole values from every rank's parts, and release() or
// the step empties them again. A reduce-scatter takes the gradients of several parameters at
// once, each split into its rank parts and laid rank by rank (DeepSpeed's
// reduce_scatter_coalesced), up to `bucket_elements` padded elements; the step updates the parts
// and leaves every parameter released.
//
// The optimizer's update must be element-wise (SGD, Adam, AdamW, Adagrad, RMSprop are): a
// part of a parameter is stepped as the whole parameter would be. LBFGS is refused.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/shared_write.h"
#include "hpctrial/comm/communicator.h"
#include "parallel/state_swap.h"

namespace hpctrial::trainer::detail {

// Where each of a group's parameters lies in its flat buffer, and the buckets of the buffer.
struct FlatLayout {
  struct Bucket {
    std::size_t first = 0, end = 0;  // its parameters, [first, end)
    std::int64_t begin = 0;          // where it starts in the buffer
    std::int64_t part = 0;           // the elements a rank owns; the bucket spans part x ranks
  };
  std::vector<std::int64_t> offsets;  // of each parameter in the buffer, in elements
  std::vector<std::int64_t> numels;
  std::vector<std::size_t> bucket_of;  // of each parameter
  std::vector<Bucket> buckets;         // in buffer order
  std::int64_t total = 0;              // the parameters' elements
  std::int64_t size = 0;               // the buffer's, padding included
  std::int64_t shard() const;          // the elements a rank owns over all buckets
};

// Stage 3's: a bucket for each parameter, of ceil(numel / ranks) x ranks elements.
FlatLayout partition_layout(const std::vector<std::int64_t>& numels, int ranks);

// The elements [first, second) of a parameter of `numel` elements that rank `rank`'s part of
// `part` elements holds (DeepSpeed's _partition_param); the rest of the part is padding, and a
// part may be padding only.
std::pair<std::int64_t, std::int64_t> part_range(std::int64_t numel, std::int64_t part, std::int64_t rank);
// Copies rank `rank`'s range of `whole` (flattened) into the front of `part`.
void cut_part(const torch::Tensor& whole, const torch::Tensor& part, std::int64_t rank);

// Buckets are filled from the last parameter back (the order backward produces gradients),
// closing one before it would pass `bucket_elements`; a larger parameter has a bucket alone.
FlatLayout flat_layout(const std::vector<std::int64_t>& numels, int ranks, std::int64_t bucket_elements);

// A sharded save (checkpoint/shared_write.h): the state tensors every rank writes pieces of, as
// whole logical datasets, and this rank's pieces of them.
struct ShardPiece {
  std::size_t dataset = 0;   // index into ShardedSave::datasets
  std::uint64_t offset = 0;  // bytes into the dataset
  std::shared_ptr<const checkpoint::Buffer> buffer;
  std::size_t from = 0, size = 0;  // the piece is buffer's bytes [from, from + size)
  std::uint32_t crc = 0;
};
struct ShardedSave {
  checkpoint::Contents whole;  // the small datasets, the same on every rank: type, groups, scalars
  std::vector<checkpoint::DatasetSpec> datasets;
  std::vector<ShardPiece> pieces;
};

// ZeRO-3's partitioned construction (DeepSpeed's zero.Init): each parameter of a layer cut into
// this rank's part as soon as the layer is built, before any optimizer exists, and released, so
// that no rank holds the whole model; the sharded optimizer takes the parts over.
class PartitionStore {
 public:
  // With `spill` (offload_param on nvme), each part goes to a file there as soon as it is cut,
  // its bytes freed: no rank holds its parts in memory before the optimizer's swap takes them
  // over (ShardedOptimizer, a part at a time), as DeepSpeed's zero.Init with remote_device nvme.
  explicit PartitionStore(comm::Communicator& communicator, std::unique_ptr<PartSpill> spill = nullptr)
      : comm_(communicator), spill_(std::move(spill)) {}
  // Every parameter of `module` (its submodules' too): rank 0's value taken by every rank (as
  // zero.Init broadcasts each module's), this rank's part of it kept (zero-padded, as
  // partition_layout cuts it), the parameter emptied. Its gradient accumulator is made first and
  // kept, so that it has the parameter's whole shape. A collective, in the same order on every rank.
  void partition(torch::nn::Module& module);
  struct Entry {
    std::vector<std::int64_t> shape;
    torch::Tensor part;  // spilled: its bytes freed, and in `spill` at `offset`
    std::shared_ptr<torch::autograd::Node> accumulator;
    std::shared_ptr<const PartSpill> spill;
    std::int64_t offset = 0;
  };
  // The entry of a parameter partitioned here, taken out of the store; none for another.
  std::optional<Entry> take(const torch::Tensor& parameter);
  bool empty() const { return entries_.empty(); }
  // The elements of the parts held, and the bytes of them in memory.
  std::int64_t elements() const;
  std::int64_t bytes_in_memory() const;

 private:
  comm::Communicator& comm_;
  std::shared_ptr<PartSpill> spill_;
  std::map<const void*, Entry> entries_;
};

struct ZeroOptions {
  int stage = 1;                               // 1, 2 or 3
  std::int64_t bucket_elements = 500'000'000;  // DeepSpeed's reduce_bucket_size default
  PartitionStore* partitions = nullptr;  // stage 3: parameters built partitioned
  // Stage 3: parameters of at most `persistence_threshold` elements are persistent (DeepSpeed's
  // stage3_param_persistence_threshold; the engine passes the config's, 1e5 by default), up to
  // `model_persistence_threshold` elements in all, first come first kept in the groups' order.
  // 0: every parameter partitioned and released.
  std::int64_t persistence_threshold = 0;
  std::int64_t model_persistence_threshold = std::numeric_limits<std::int64_t>::max();
  // Stage 3's prefetch bounds (stage3_prefetch_bucket_size, stage3_max_live_parameters), which
  // the model engine applies to what it gathers ahead of use (0: nothing ahead).
  std::int64_t prefetch_elements = 0;
  std::int64_t max_live_elements = std::numeric_limits<std::int64_t>::max();
  // stage3_max_reuse_distance, which the model engine applies (0: nothing held for reuse).
  std::int64_t max_reuse_elements = 0;
  // offload_optimizer with device nvme: the optimizer state in a swap file between steps
  // (state_swap.h; its rank is this communicator's), and with `parameters` (offload_param on
  // nvme; stage 3) the parts of the parameters too.
  std::optional<SwapOptions> swap;
};

class ShardedOptimizer {
 public:
  // Takes over `optimizer` (its parameter groups become this rank's parts) and the model's
  // parameters in it (their data moves into the flat buffers; the tensors stay the same
  // objects). At stages 1 and 2 every rank must start from the same parameter values; stage 3
  // cuts every rank's parts from rank 0's (a collective), as DeepSpeed's partitioning broadcasts
  // them first. ConfigError for LBFGS or a parameter that is not float32.
  ShardedOptimizer(torch::optim::Optimizer& optimizer, comm::Communicator& communicator, ZeroOptions options = {});
  // The ConfigErrors of the constructor, without taking anything over (a world of one rank,
  // where there is nothing to shard, checks the same).
  static void check(torch::optim::Optimizer& optimizer);
  ~ShardedOptimizer();
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  int stage() const { return options_.stage; }

  // Around loss.backward(). Gradients are reduce-scattered bucket by bucket as backward produces
  // them; end_backward() reduces the buckets backward did not complete (parameters the loss
  // does not reach count as zero) and waits for all. Every rank calls both, as often, with the
  // same `reduce` (whether this backward ends the step's accumulation; stage 1 only reduces then).
  // With `measure`, the squared norm of this rank's gradients in the buckets the backward
  // reduces is summed before they leave (the adaptive batch's noise estimate; take_local_norm()).
  void begin_backward(bool reduce = true, bool measure = false);
  void end_backward();
  // After a backward that threw: the hooks stop taking gradients (what is in flight finishes
  // in the destructor).
  void disarm();

  // The averaged gradient of this rank's shard, then the optimizer's step on it, then every
  // rank's parameters from the shards. A collective: every rank calls it.
  void step();
  // step() in two: the gradients that no armed backward took averaged into this rank's parts,
  // and then the optimizer's step on the parts and every rank's parameters
  // from them (all-gather). Between them the parts' gradients can be read and scaled.
  void reduce_gradients();
  void update();
  // The sum of the squares of this rank's shard gradients (after reduce_gradients()); summed
  // over the ranks, the squared global norm of the averaged gradient.
  double shard_grad_norm_squared() const;
  // The squared norm of this rank's gradients measured in the last measured backward, and the
  // seconds spent measuring them; both start again from 0.
  double take_local_norm_squared();
  double take_measure_seconds();
  // Seconds spent waiting for reduce-scatters and all-gathers since the last call: the
  // communication the steps did not hide (the adaptive batch's step-time model).
  double take_wait_seconds();
  void scale_shard_grads(double factor);
  // The elements of optimizer state (in memory: not those swapped out to a file), and of
  // gradients, this rank holds.
  std::int64_t state_elements() const;
  // The optimizer state's swap (offload to NVMe), if any.
  const StateSwapper* swapper() const { return swapper_.get(); }
  std::int64_t gradient_elements() const;

  // The optimizer's state as whole parameters, under `prefix` in the datasets an unsharded
  // optimizer over the model's parameters writes (state_io.h): gathered from every rank's
  // shards, so that any number of ranks, sharded or not, can load it. A collective.
  void save_whole(checkpoint::Contents& contents, const std::string& prefix);
  // Loads state written whole (by save_whole, or by an unsharded optimizer over the same
  // parameters) into this rank's shards. Local: every rank reads the contents itself. Stage 3
  // reads only the ranges of the datasets its parts cover, a parameter at a time (each written
  // out to the swap file before the next, with offload), so the contents may leave them in the
  // file (checkpoint::ReadOptions::leave_unread).
  void load_whole(const checkpoint::Contents& contents, const std::string& prefix, const std::string& file);
  // Stage 3: this rank's part of parameter `param` of group `group` read from `whole`, the
  // parameter's dataset (which may be left in its file: only the part's range is read). Local.
  // ConfigError naming the file and the dataset for another shape or dtype.
  void load_part(std::size_t group, std::size_t param, const checkpoint::Dataset& whole, const std::string& file);
  // Stage 3: this rank's part (part()) of parameter `param` of group `group`, as a rank's own
  // copy holds it (checkpoint_levels.memory), written back into the part; the copy is of this
  // rank and rank count (CheckpointError naming the file and the dataset for another size). A
  // persistent parameter's whole value comes back with gather_persistent() once every part is
  // loaded: every persistent parameter that is released gathered, a group at a time (a
  // collective).
  void load_own_part(std::size_t group, std::size_t param, const checkpoint::Dataset& saved, const std::string& file);
  void gather_persistent();
  // The same datasets as save_whole, without gathering: the state tensors as specs with this
  // rank's pieces of them (the parts it owns), checksummed; appended to `out`. Local.
  void save_shards(ShardedSave& out, const std::string& prefix);
  // Stage 3: the model's parameters as whole datasets named `names` ([group][parameter]) with
  // this rank's pieces of them (its parts, copied now), appended to `out`; nothing at stages 1
  // and 2, whose parameters are whole on every rank. Local.
  void save_parameter_shards(ShardedSave& out, const std::vector<std::vector<std::string>>& names) const;
  // Whether the parameters are partitioned (stage 3): no rank holds them whole between steps.
  bool partitions_parameters() const { return options_.stage == 3; }

  // The gradients of the model's parameters and of this rank's parts to none.
  void zero_grad();

  // Stage 3. gather(): the whole values of the parameters of `group` listed (indices into its
  // parameters) that are released, from every rank's parts, in one all-gather; a collective,
  // with the same list on every rank. release(): empties them again (their parts stay), except
  // the persistent ones. Whole values changed while gathered are not kept (DeepSpeed's
  // GatheredParameters without a modifier rank); set_whole() writes a whole value into this
  // rank's part (a load, an initialisation), on every rank alike.
  void gather(std::size_t group, const std::vector<std::size_t>& params);
  void gather_all();
  // Stage 3, for a backward that needs gathered parameters again (a layer whose forward saved
  // views of them, such as linear's transposed weight): keep() releases them as release() does,
  // but keeps their storages (which those views share) with their bytes freed; refill() gathers
  // their whole values back into the same storages (a collective, every rank alike) and makes
  // the parameters those values again; empty() frees the bytes and releases the parameters.
  struct Gathering;
  struct Kept {
    std::size_t group = 0;
    std::vector<std::size_t> params;
    std::vector<c10::Storage> storages;
    std::shared_ptr<Gathering> pending;  // start_refill()'s
  };
  Kept keep(std::size_t group, const std::vector<std::size_t>& params);
  void refill(Kept& kept);
  void empty(Kept& kept);
  // Stage 3's prefetch: an all-gather started ahead of use on the communicator's own thread
  // (every rank starting the same ones in the same order), which the gather() or refill() that
  // needs it waits for. prefetch() starts one for those of `params` that are released and not
  // on their way already, taken in order while fewer than `room` elements are started (the one
  // that crosses it still taken, as DeepSpeed's coordinator does), and returns the elements
  // started; start_refill() starts the one refill(kept) runs, and returns its elements. Values
  // on their way when a step, set_whole() or load_part() changes the parts are dropped.
  std::int64_t prefetch(std::size_t group, const std::vector<std::size_t>& params, std::int64_t room);
  std::int64_t start_refill(Kept& kept);
  // The elements gathered (persistent ones too) and on their way: what stage3_max_live_parameters
  // bounds.
  std::int64_t live_elements() const;
  const ZeroOptions& options() const { return options_; }
  void release(std::size_t group, const std::vector<std::size_t>& params);
  void release_all();
  // Where a model's parameter is among the groups' (group, index), if the optimizer steps it.
  std::optional<std::pair<std::size_t, std::size_t>> locate(const torch::Tensor& parameter) const;
  bool is_gathered(std::size_t group, std::size_t param) const { return groups_.at(group).gathered.at(param); }
  bool is_persistent(std::size_t group, std::size_t param) const { return groups_.at(group).persistent.at(param); }
  void set_whole(std::size_t group, std::size_t param, const torch::Tensor& whole);
  // The (group, parameter) pairs released now (stage 3; none at stages 1 and 2).
  std::vector<std::pair<std::size_t, std::size_t>> released() const;
  // Every gathered parameter's whole value from rank `root`, which every rank then keeps (its
  // parts taken from it at stage 3; in the flat buffer at stages 1 and 2). A collective.
  void broadcast_whole(int root);
  // After every rank wrote the same whole values into the gathered parameters (a restore, the
  // chief's initial weights broadcast): this rank's parts taken from them.
  void keep_gathered();
  // The shape of each parameter (stage 3's released parameters are empty tensors).
  const std::vector<std::int64_t>& shape(std::size_t group, std::size_t param) const {
    return groups_.at(group).shapes.at(param);
  }
  // The elements of parameters this rank holds: its parts and whatever is gathered or on its way
  // (stage 3), or every parameter (stages 1 and 2).
  std::int64_t parameter_elements() const;

  const FlatLayout& layout(std::size_t group) const { return groups_.at(group).layout; }
  // The model's parameters of each group, in the order save_whole numbers their state.
  std::vector<std::vector<torch::Tensor>> parameter_groups() const;
  // This rank's part of bucket `bucket` of group `group` (an optimizer parameter).
  const torch::Tensor& part(std::size_t group, std::size_t bucket) const { return groups_.at(group).parts.at(bucket); }

 private:
  struct Group {
    std::vector<torch::Tensor> params;  // the model's: views into `flat`, or stage 3's gathered or empty
    std::vector<std::vector<std::int64_t>> shapes;
    std::vector<bool> gathered;  // stage 3
    std::vector<bool> persistent;  // stage 3: never released
    FlatLayout layout;
    torch::Tensor flat;  // every rank's parameters (stages 1 and 2); empty at stage 3, for its options
    // This rank's part of each bucket: leaves over `flat` at stages 1 and 2, tensors of their own
    // at stage 3 (swapped out between uses with offload_param on nvme).
    std::vector<torch::Tensor> parts;
    std::vector<std::int64_t> column;  // where each bucket's part lies in its reduction's
    std::size_t first_part = 0;       // the index of parts[0] among the optimizer's parameters
  };
  // The reduce-scatter of buckets [first, end) of a group, in the order every rank starts them:
  // every rank's parts of them laid rank by rank, this rank's parts received.
  struct Reduction {
    std::size_t group = 0, first = 0, end = 0;
    std::int64_t columns = 0;  // the parts' elements
    std::size_t waiting = 0;   // parameters backward has not produced yet
    bool launched = false;
    torch::Tensor send;  // columns x ranks
    torch::Tensor recv;  // columns
    comm::WorkHandle work;
  };
  class ReadyHook;

  // Stage 3: empties a gathered parameter, persistent or not.
  void drop(Group& group, std::size_t param);
  // Stage 3's load_whole after the options: each part's state from its ranges of the datasets.
  void load_state_parts(const checkpoint::Contents& contents, const std::string& prefix, const std::string& file);
  // Every rank's parts of `wanted` (indices into the group's parameters), as Gathering lays them
  // out: blocking, or `ahead` on the communicator's thread.
  std::shared_ptr<Gathering> launch_gather(std::size_t g, const std::vector<std::size_t>& wanted, bool ahead);
  // Waits for the all-gather of the gathering's parameter `k` (an index into its `params`), then
  // returns its whole value: the all-gather's own buffer, or a copy out of a coalesced one.
  torch::Tensor land(Gathering& gathering, std::size_t k);
  // Lands every prefetched parameter of group `g` among `params`: gathered, as gather() leaves them.
  void land_prefetched(std::size_t g, const std::vector<std::size_t>& params);
  // The parts change: what is on its way holds the values from before.
  void parts_changed();
  // The group's flat buffer and parts, and the parameters' place in them; `built` holds the
  // parts of parameters built partitioned.
  void lay_out(Group& group, int rank, const std::vector<std::optional<PartitionStore::Entry>>& built);
  void lay_out_parts(Group& group, int rank, const std::vector<std::optional<PartitionStore::Entry>>& built,
                     const torch::TensorOptions& tensor_options);
  // The parts built partitioned and spilled to disk (PartitionStore), taken over by the swap once
  // it exists, a part at a time.
  struct Spilled {
    torch::Tensor part;
    std::shared_ptr<const PartSpill> spill;
    std::int64_t offset = 0;
  };
  std::vector<Spilled> spilled_;
  void take_over_spilled();
  // The reductions of a group's buckets, from its last bucket back.
  void plan_reductions(std::size_t g);
  void on_gradient_ready(std::size_t group, std::size_t param);
  // Moves the parameter's gradient, if any, into the reduction's bucket and frees it.
  void take_gradient(Reduction& reduction, std::size_t param);
  void launch(Reduction& reduction);
  void complete(Reduction& reduction);
  // Every reduction not started yet, with whatever gradients the parameters hold, then waits for all.
  void reduce_rest();

  torch::optim::Optimizer& optimizer_;
  comm::Communicator& comm_;
  ZeroOptions options_;
  std::vector<Group> groups_;
  std::vector<Reduction> reductions_;
  std::vector<std::vector<std::size_t>> reduction_of_;  // [group][bucket]

  std::mutex mutex_;  // hooks may run on autograd's device threads
  bool armed_ = false;
  bool measuring_ = false;
  double local_sqr_ = 0;
  double measure_seconds_ = 0;
  double wait_seconds_ = 0;
  std::size_t next_launch_ = 0;
  static constexpr std::size_t kMaxInFlight = 2;
  std::deque<std::size_t> in_flight_;  // reductions launched and not yet completed, oldest first
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
  std::unique_ptr<StateSwapper> swapper_;
  std::unique_ptr<comm::Communicator> prefetch_comm_;  // stage 3 with prefetch: a duplicate of comm_
  // Stage 3's gatherings started ahead and not landed: prefetch()'s (the Kept's are theirs).
  std::vector<std::shared_ptr<Gathering>> prefetched_;
  std::int64_t on_the_way_ = 0;     // their elements
  std::uint64_t parts_version_ = 0;  // bumped when the parts change
};

// An all-gather of whole parameters of one group, maybe still on its way. A parameter whose part
// has kOwnGatherElements or more, or the only one wanted, travels in an all-gather of its own
// into the buffer that becomes its whole value (DeepSpeed's single-parameter all-gather); the
// others travel together in one (DeepSpeed's coalesced all-gather) and are copied out as they
// land. Each all-gather is in place: this rank's parts are copied into its block first, which is
// also what keeps a step or a swap that changes the parts meanwhile from changing what it sends.
struct ShardedOptimizer::Gathering {
  static constexpr std::int64_t kOwnGatherElements = std::int64_t{1} << 16;
  struct Piece {
    std::size_t members = 0;
    std::int64_t width = 0;  // a rank's block
    torch::Tensor all;       // every rank's block, rank by rank
    comm::WorkHandle work;   // none once done
    std::exception_ptr failed;  // its all-gather's error
  };
  std::size_t group = 0;
  std::vector<std::size_t> params;
  std::vector<std::int64_t> numels;
  std::vector<std::size_t> piece_of;  // each parameter's piece
  std::vector<std::int64_t> columns;  // where each parameter's part lies in its piece's blocks
  std::vector<bool> landed;
  std::vector<Piece> pieces;
  std::int64_t elements = 0;
  std::int64_t* on_the_way = nullptr;  // started ahead: counts each parameter until it lands
  std::uint64_t version = 0;          // the parts' it was taken from
  Gathering() = default;
  Gathering(const Gathering&) = delete;
  Gathering& operator=(const Gathering&) = delete;
  // Waits for the all-gathers, whose buffers these are (an error then is the next collective's).
  ~Gathering();
  // Waits for piece `p`'s all-gather, adding the seconds waited to `waited`; throws its error.
  void finish(std::size_t p, double& waited);
};

}  // namespace hpctrial::trainer::detail
