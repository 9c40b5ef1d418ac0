// data.stage: the trial's input files copied once per node to node-local storage before it
// trains, and the trial pointed at the copies.
//
// On each node the ranks' first (node-local rank 0, the stager) copies each staged key's file or
// folder into <root>/hpctrial-stage-<owner>-<node>/data/<key>/, checksumming what it reads
// (CRC-32C) and reading the copy back to compare, by way of partial/<key>; a manifest
// (manifests/<key>.json: the source, and each file's size, modification time and checksum) is
// written last. The folder is the user's own: made private (0700), and one that belongs to
// another user or that others may write is refused with its path. A later run of the same trial
// on the same node (a requeue, a resumed pause) reuses a copy whose source is unchanged (each
// file's size and time, as the source has them now) and whose files still have their checksums;
// anything else is copied afresh. The copies are read-only. Every rank waits for every node and
// fails alike: an error names the node, the key and the path. No LibTorch here.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/experiment_dir.h"

namespace hpctrial::trainer::detail {

// The keys of config.data staged, with their paths as written: data.stage.keys, or every key
// (but `stage`) whose value is an absolute path that exists here. ConfigError naming the key
// when a listed key's value is not a path.
std::vector<std::pair<std::string, std::string>> keys_to_stage(const core::ExperimentConfig& config);

// The node's root of staged data: data.stage.to, node_local being $TMPDIR where it names a
// directory (else /tmp) and shm /dev/shm.
std::string stage_root(const core::DataStage& stage);

// "<experiment id>-trial-<id>": the owner of a trial's staged data (api/rank_identity.h: also
// for a rank run alone, whose trial directory records its own identity).
std::string stage_owner(const core::ExperimentIdentity& identity, int trial_id);

// Collective on `world`. Stages config.data's keys on this node when `stager`, waits for every
// node, and rewrites those keys to the copies. `owner` names the experiment and trial,
// `node_name` and `node_index` (MPI's, the same on every rank of the node) this node; returns the
// node's staging folder ("" when data.stage is unset). ConfigError for a path that is not there,
// IoError for a failed or mismatched copy or a full disk.
std::string stage_data(core::ExperimentConfig& config, comm::Communicator& world, bool stager,
                       const std::string& owner, const std::string& node_name, int node_index);

// Collective: once every rank is done with them, the stager removes the node's copies (a
// trial that ended complete needs them no more).
void remove_staged_data(const std::string& folder, comm::Communicator& world, bool stager);

}  // namespace hpctrial::trainer::detail
