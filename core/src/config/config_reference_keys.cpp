// The keys of Determined's experiment config that mean something here, rewritten as hpctrial's
// own before the schema reads the tree, so that `config show` and every recorded config hold only
// hpctrial's keys and the rest of the code knows one spelling:
//
//   environment.environment_variables: [NAME=VALUE, ...]   environment: {NAME: VALUE}
//     (or {cpu: [...], cuda: [...]}: cuda's where resources.gpus_per_slot > 0, else cpu's)
//   bind_mounts: [{host_path, container_path, read_only}]   environment.bind: [HOST:CONTAINER[:ro]]
//   SCHEDULER.*batch_args (sbatch_args, pbsbatch_args)     scheduler.extra_directives
//   SCHEDULER.OPTION (slurm.gpu_type)                       scheduler.OPTION
//   SCHEDULER.slots_per_node                                resources.slots_per_node
// (SCHEDULER: a name of the registry's, slurm or pbs; its section counts where it is
// scheduler.type.)
//
// Each rewritten value keeps the place it was written, so that an error in it names that line. A
// key written both ways with different values is an error naming both places.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "config_schema.h"
#include "hpctrial/core/config_node.h"

namespace hpctrial::core::detail {
namespace {

std::string scheduler_type(const ConfigNode& root) {
  const ConfigNode* scheduler = root.find("scheduler");
  const ConfigNode* type = scheduler != nullptr ? scheduler->find("type") : nullptr;
  return type != nullptr && type->is_scalar() ? type->text() : "local";
}

// The map `key` of `parent`, made when it is absent; nullptr (with an error) when it is not a map.
ConfigNode* map_at(ConfigNode& parent, const std::string& key, const std::string& path, Diagnostics& d) {
  ConfigNode* node = parent.find(key);
  if (node == nullptr || node->is_null()) return &parent.set(key, ConfigNode::map(parent.where()));
  if (!node->is_map()) {
    d.error(node->where(), path, "must be a map, got " + node->kind_name());
    return nullptr;
  }
  return node;
}

// Sets `key` of `target` (at `target_path`) to `value` written as `alias`; an error when the
// config already sets it otherwise.
void put(ConfigNode& target, const std::string& target_path, const std::string& key, ConfigNode value,
         const std::string& alias, Diagnostics& d, const SourceLocation& key_where = {}) {
  if (const ConfigNode* there = target.find(key); there != nullptr && !there->is_null()) {
    if (there->is_scalar() && value.is_scalar() && there->text() == value.text()) return;
    d.error(value.where(), alias,
            "sets " + target_path + "." + key + ", which " + there->where().to_string() +
                " sets to something else; keep one of the two");
    return;
  }
  const SourceLocation where = key_where.file.empty() ? value.where() : key_where;
  target.set(key, std::move(value), where);
}

// Appends `items` to the list `key` of `target`.
void append(ConfigNode& target, const std::string& target_path, const std::string& key,
            const std::vector<ConfigNode>& items, Diagnostics& d) {
  ConfigNode* list = target.find(key);
  if (list == nullptr || list->is_null()) list = &target.set(key, ConfigNode::sequence(target.where()));
  if (!list->is_sequence()) {
    d.error(list->where(), target_path + "." + key, "must be a list, got " + list->kind_name());
    return;
  }
  list->items().insert(list->items().end(), items.begin(), items.end());
}

// The strings of a list of strings; an error for anything else.
std::vector<ConfigNode> string_items(const ConfigNode& list, const std::string& path, Diagnostics& d) {
  if (!list.is_sequence()) {
    d.error(list.where(), path, "must be a list of strings, got " + list.kind_name());
    return {};
  }
  std::vector<ConfigNode> out;
  for (std::size_t i = 0; i < list.items().size(); ++i) {
    const ConfigNode& item = list.items()[i];
    if (!item.is_scalar()) {
      d.error(item.where(), path + "[" + std::to_string(i) + "]", "must be a string, got " + item.kind_name());
      continue;
    }
    out.push_back(item);
  }
  return out;
}

bool gpus_wanted(const ConfigNode& root) {
  const ConfigNode* resources = root.find("resources");
  const ConfigNode* gpus = resources != nullptr ? resources->find("gpus_per_slot") : nullptr;
  if (gpus == nullptr || !gpus->is_scalar()) return false;
  char* end = nullptr;
  const long long n = std::strtoll(gpus->text().c_str(), &end, 10);  // "00" is none; a bad value the schema reports
  return end != gpus->text().c_str() && *end == '\0' && n > 0;
}

void environment_variables(ConfigNode& root, Diagnostics& d) {
  ConfigNode* environment = root.find("environment");
  if (environment == nullptr || !environment->is_map()) return;
  const ConfigNode* found = environment->find("environment_variables");
  if (found == nullptr) return;
  const ConfigNode variables = *found;
  std::string path = "environment.environment_variables";
  auto& entries = environment->entries();
  entries.erase(std::remove_if(entries.begin(), entries.end(),
                               [](const ConfigEntry& e) { return e.key == "environment_variables"; }),
                entries.end());
  const ConfigNode* list = &variables;
  if (variables.is_map()) {  // {cpu: [...], cuda: [...], rocm: [...]}: the ranks' kind of device
    for (const auto& entry : variables.entries()) {
      if (entry.key != "cpu" && entry.key != "cuda" && entry.key != "rocm") {
        d.error(entry.key_where, path + "." + entry.key, "is not a kind of device; use cpu or cuda");
      }
    }
    const char* kind = gpus_wanted(root) ? "cuda" : "cpu";
    list = variables.find(kind);
    path += std::string(".") + kind;
    if (list == nullptr || list->is_null()) return;
  } else if (variables.is_null()) {
    return;
  }
  for (const ConfigNode& item : string_items(*list, path, d)) {
    const auto equals = item.text().find('=');
    if (equals == std::string::npos || equals == 0) {
      d.error(item.where(), path, "holds \"" + item.text() + "\"; each entry is NAME=VALUE, e.g. NCCL_DEBUG=INFO");
      continue;
    }
    put(*environment, "environment", item.text().substr(0, equals),
        ConfigNode::scalar(item.text().substr(equals + 1), item.where(), /*quoted=*/true), path, d);
  }
}

void bind_mounts(ConfigNode& root, Diagnostics& d) {
  const ConfigNode* found = root.find("bind_mounts");
  if (found == nullptr) return;
  const ConfigNode mounts = *found;
  auto& entries = root.entries();
  entries.erase(std::remove_if(entries.begin(), entries.end(), [](const ConfigEntry& e) { return e.key == "bind_mounts"; }),
                entries.end());
  if (mounts.is_null()) return;
  if (!mounts.is_sequence()) {
    d.error(mounts.where(), "bind_mounts", "must be a list of {host_path, container_path, read_only}, got " +
                                               mounts.kind_name());
    return;
  }
  const ConfigNode* environment = root.find("environment");
  const ConfigNode* image = environment != nullptr ? environment->find("image") : nullptr;
  if (!mounts.items().empty() && (image == nullptr || image->is_null())) {
    d.error(mounts.where(), "bind_mounts",
            "mounts folders into the ranks' containers, but environment.image names none; without one the ranks "
            "see this machine's folders as they are: leave bind_mounts out");
    return;
  }
  std::vector<ConfigNode> binds;
  for (std::size_t i = 0; i < mounts.items().size(); ++i) {
    const ConfigNode& mount = mounts.items()[i];
    const std::string path = "bind_mounts[" + std::to_string(i) + "]";
    if (!mount.is_map()) {
      d.error(mount.where(), path, "must be {host_path: /scratch/data, container_path: /data, read_only: true}");
      continue;
    }
    std::string host, container, mode;
    for (const auto& entry : mount.entries()) {
      const bool text = entry.value.is_scalar();
      if (entry.key == "host_path" && text) {
        host = entry.value.text();
      } else if (entry.key == "container_path" && text) {
        container = entry.value.text();
      } else if (entry.key == "read_only" && text && (entry.value.text() == "true" || entry.value.text() == "false")) {
        mode = entry.value.text() == "true" ? ":ro" : "";
      } else if (entry.key == "propagation" && text && entry.value.text() == "rprivate") {
        // Determined's default, and every runtime's here.
      } else {
        d.error(entry.key_where, path + "." + entry.key,
                entry.key == "propagation" ? "takes only rprivate here (every runtime's default)"
                : (entry.key == "host_path" || entry.key == "container_path" || entry.key == "read_only")
                    ? "has a value of the wrong kind (paths are strings, read_only true or false)"
                    : "is not a key of a bind mount; use host_path, container_path and read_only");
      }
    }
    if (host.empty() || container.empty()) {
      d.error(mount.where(), path, "needs both host_path and container_path");
      continue;
    }
    binds.push_back(ConfigNode::scalar(host + ":" + container + mode, mount.where(), /*quoted=*/true));
  }
  ConfigNode* env = map_at(root, "environment", "environment", d);
  if (env != nullptr) append(*env, "environment", "bind", binds, d);
}

// A scheduler's section of Determined's config (slurm:, pbs:), named after the scheduler. Its
// batch arguments (sbatch_args, pbsbatch_args: a key ending in "batch_args") and its other keys
// (gpu_type), which become scheduler options the registry vets as it vets scheduler:'s own, count
// only where it is the config's scheduler (as Determined applies only its own cluster's section);
// slots_per_node always.
void scheduler_section(ConfigNode& root, const std::string& name, Diagnostics& d) {
  const ConfigNode* found = root.find(name);
  if (found == nullptr) return;
  const ConfigNode section = *found;
  auto& entries = root.entries();
  entries.erase(std::remove_if(entries.begin(), entries.end(), [&](const ConfigEntry& e) { return e.key == name; }),
                entries.end());
  if (section.is_null()) return;
  if (!section.is_map()) {
    d.error(section.where(), name, "must be a map, e.g. " + name + ": {slots_per_node: 4}");
    return;
  }
  const bool ours = scheduler_type(root) == name;
  const std::string suffix = "batch_args";
  for (const auto& entry : section.entries()) {
    const std::string path = name + "." + entry.key;
    if (entry.key == "slots_per_node") {
      if (ConfigNode* resources = map_at(root, "resources", "resources", d)) {
        put(*resources, "resources", "slots_per_node", entry.value, path, d);
      }
      continue;
    }
    const bool args = entry.key.size() > suffix.size() &&
                      entry.key.compare(entry.key.size() - suffix.size(), suffix.size(), suffix) == 0;
    const auto items = args ? string_items(entry.value, path, d) : std::vector<ConfigNode>{};
    ConfigNode* scheduler = ours ? map_at(root, "scheduler", "scheduler", d) : nullptr;
    if (scheduler == nullptr) continue;
    if (args) {
      append(*scheduler, "scheduler", "extra_directives", items, d);
    } else {
      put(*scheduler, "scheduler", entry.key, entry.value, path, d, entry.key_where);
    }
  }
}

}  // namespace

ConfigNode from_reference_keys(const ConfigNode& root, const std::vector<std::string>& scheduler_sections,
                               Diagnostics& d) {
  if (!root.is_map()) return root;
  ConfigNode out = root;
  environment_variables(out, d);
  bind_mounts(out, d);
  for (const std::string& name : scheduler_sections) scheduler_section(out, name, d);
  return out;
}

}  // namespace hpctrial::core::detail
