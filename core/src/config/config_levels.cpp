// checkpoint_levels: the memory level's period, its node-local directory and its share of the
// node's memory; the partner level.
#include <filesystem>

#include "config_schema.h"

namespace hpctrial::core::detail {

void read_checkpoint_levels(MapReader& r, CheckpointLevels& c) {
  Diagnostics& d = r.diagnostics();
  if (const ConfigNode* node = r.get("memory")) {
    MapReader m(node, r.path("memory"), d);
    c.memory_on = true;
    c.memory_auto = true;  // without a period: as often as the copies' cost allows
    if (const ConfigNode* n = m.get("period")) {
      if (n->is_scalar() && n->text() == "auto") {
        // the default
      } else if (!n->is_map()) {
        report(*n, m.path("period"), d, "must be auto, {batches: N} or {seconds: N}");
      } else if (const auto length = read_length(*n, m.path("period"), d, {LengthUnit::kBatches, LengthUnit::kSeconds})) {
        c.memory_period = *length;
        c.memory_auto = false;
      }
    }
    if (const ConfigNode* n = m.get("dir")) {
      if (const auto dir = read_string(*n, m.path("dir"), d)) {
        if (!std::filesystem::path(*dir).is_absolute()) {
          report(*n, m.path("dir"), d, "must be an absolute directory on each node, e.g. /dev/shm");
        } else {
          c.memory_dir = *dir;
        }
      }
    }
    if (const ConfigNode* n = m.get("max_share")) {
      if (auto v = read_double(*n, m.path("max_share"), d, 0.0, 0.9, true)) c.memory_max_share = *v;
    }
    m.finish();
  }
  if (const ConfigNode* n = r.get("partner")) {
    if (const auto on = read_bool(*n, r.path("partner"), d)) {
      if (*on && !c.memory_on) {
        report(*n, r.path("partner"), d, "sends each rank's copies in node memory to another node: it needs "
                                         "checkpoint_levels.memory too");
      } else {
        c.partner = *on;
      }
    }
  }
  r.finish();
}

}  // namespace hpctrial::core::detail
