// ZeRO's sharded optimizer step (stages 1 and 2 share it; internal to the trainer).
//
// The parameters of each parameter group are laid end to end in one flat float32 buffer, padded
// to a multiple of the number of data-parallel ranks and split into equal shards; the model's
// parameters become views into the buffer. The optimizer is given each group's shard of this
// rank in place of the group's parameters, so that its state (Adam's moments, SGD's momentum)
// exists for this rank's shard only: 1/N of it per rank. A step averages the gradients over the
// ranks into each rank's shard (reduce-scatter), steps the shard, and all-gathers the shards into
// the buffer, where every rank's model reads them.
//
// The optimizer's update must be element-wise (SGD, Adam, AdamW, Adagrad, RMSprop are): a
// shard of a parameter is stepped as the whole parameter would be. LBFGS is refused.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/comm/communicator.h"

namespace hpctrial::trainer::detail {

// Where each of a group's parameters lies in its flat buffer, and the shards of the buffer.
struct FlatLayout {
  std::vector<std::int64_t> offsets;  // of each parameter, in elements
  std::vector<std::int64_t> numels;
  std::int64_t total = 0;  // the parameters' elements
  std::int64_t shard = 0;  // elements a rank owns; the buffer holds shard x ranks (padding at its end)

  // A parameter's part in one rank's shard.
  struct Piece {
    std::size_t param;
    std::int64_t param_offset;  // where the part starts in the parameter (flattened)
    std::int64_t shard_offset;  // and in the shard
    std::int64_t length;
  };
  // The parts of parameters in `rank`'s shard, in order.
  std::vector<Piece> pieces(int rank) const;
};

FlatLayout flat_layout(const std::vector<std::int64_t>& numels, int ranks);

class ShardedOptimizer {
 public:
  // Takes over `optimizer` (its parameter groups become this rank's shards) and the model's
  // parameters in it (their data moves into the flat buffers; the tensors stay the same
  // objects). Every rank must start from the same parameter values. ConfigError for LBFGS or a
  // parameter that is not float32.
  ShardedOptimizer(torch::optim::Optimizer& optimizer, comm::Communicator& communicator);

  // The averaged gradient of this rank's shard, then the optimizer's step on it, then every
  // rank's parameters from the shards. A collective: every rank calls it.
  void step();
  // step() in two: the gradients averaged into this rank's shards (reduce-scatter), and then
  // the optimizer's step on the shards and every rank's parameters from them (all-gather).
  // Between them the shards' gradients can be read and scaled (clipping).
  void reduce_gradients();
  void update();
  // The sum of the squares of this rank's shard gradients (after reduce_gradients()); summed
  // over the ranks, the squared global norm of the averaged gradient.
  double shard_grad_norm_squared() const;
  void scale_shard_grads(double factor);
  // The elements of optimizer state this rank holds.
  std::int64_t state_elements() const;

  // The optimizer's state as whole parameters, under `prefix` in the datasets an unsharded
  // optimizer over the model's parameters writes (state_io.h): gathered from every rank's
  // shards, so that any number of ranks, sharded or not, can load it. A collective.
  void save_whole(checkpoint::Contents& contents, const std::string& prefix);
  // Loads state written whole (by save_whole, or by an unsharded optimizer over the same
  // parameters) into this rank's shards. Local: every rank reads the contents itself.
  void load_whole(const checkpoint::Contents& contents, const std::string& prefix, const std::string& file);
  // The model parameters' gradients to none.
  void zero_grad();

  // This rank's shard of group `group` (the optimizer's parameter there).
  const torch::Tensor& shard(std::size_t group) const { return groups_.at(group).shard; }
  const FlatLayout& layout(std::size_t group) const { return groups_.at(group).layout; }

 private:
  struct Group {
    std::vector<torch::Tensor> params;  // the model's, now views into `flat`
    FlatLayout layout;
    torch::Tensor flat;       // every rank's parameters, shard x ranks
    torch::Tensor flat_grad;  // this rank's gradients, the same layout
    torch::Tensor shard;      // this rank's part of `flat`
  };

  torch::optim::Optimizer& optimizer_;
  comm::Communicator& comm_;
  std::vector<Group> groups_;
};

}  // namespace hpctrial::trainer::detail
