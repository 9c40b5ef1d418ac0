// Writes a ConfigNode into a yaml-cpp emitter, keeping quoted scalars quoted. Internal to core.
#pragma once

#include <yaml-cpp/yaml.h>

#include "hpctrial/core/config_node.h"

namespace hpctrial::core::detail {

void emit_yaml(YAML::Emitter& out, const ConfigNode& node);

}  // namespace hpctrial::core::detail
