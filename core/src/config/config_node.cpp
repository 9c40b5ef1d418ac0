#include "hpctrial/core/config_node.h"

#include <sys/stat.h>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "config_emit.h"
#include "hpctrial/core/error.h"

namespace hpctrial::core {

ConfigNode ConfigNode::null(SourceLocation where) {
  ConfigNode node;
  node.where_ = std::move(where);
  return node;
}

ConfigNode ConfigNode::scalar(std::string text, SourceLocation where, bool quoted) {
  ConfigNode node;
  node.kind_ = Kind::kScalar;
  node.text_ = std::move(text);
  node.quoted_ = quoted;
  node.where_ = std::move(where);
  return node;
}

ConfigNode ConfigNode::sequence(SourceLocation where) {
  ConfigNode node;
  node.kind_ = Kind::kSequence;
  node.where_ = std::move(where);
  return node;
}

ConfigNode ConfigNode::map(SourceLocation where) {
  ConfigNode node;
  node.kind_ = Kind::kMap;
  node.where_ = std::move(where);
  return node;
}

std::string ConfigNode::kind_name() const {
  switch (kind_) {
    case Kind::kNull: return "null";
    case Kind::kScalar: return "a string";
    case Kind::kSequence: return "a list";
    case Kind::kMap: return "a map";
  }
  return "unknown";
}

const ConfigNode* ConfigNode::find(std::string_view key) const {
  for (const auto& entry : entries_) {
    if (entry.key == key) return &entry.value;
  }
  return nullptr;
}

ConfigNode* ConfigNode::find(std::string_view key) {
  for (auto& entry : entries_) {
    if (entry.key == key) return &entry.value;
  }
  return nullptr;
}

ConfigNode& ConfigNode::set(const std::string& key, ConfigNode value, SourceLocation key_where) {
  HPCTRIAL_ENFORCE(is_map(), "ConfigNode::set on " + kind_name());
  for (auto& entry : entries_) {
    if (entry.key == key) {
      entry.value = std::move(value);
      return entry.value;
    }
  }
  entries_.push_back({key, std::move(key_where), std::move(value)});
  return entries_.back().value;
}

namespace detail {

void emit_yaml(YAML::Emitter& out, const ConfigNode& node) {
  switch (node.kind()) {
    case ConfigNode::Kind::kNull:
      out << YAML::Null;
      break;
    case ConfigNode::Kind::kScalar:
      if (node.quoted()) out << YAML::DoubleQuoted;
      out << node.text();
      break;
    case ConfigNode::Kind::kSequence:
      if (node.items().empty()) out << YAML::Flow;
      out << YAML::BeginSeq;
      for (const auto& item : node.items()) emit_yaml(out, item);
      out << YAML::EndSeq;
      break;
    case ConfigNode::Kind::kMap:
      if (node.entries().empty()) out << YAML::Flow;
      out << YAML::BeginMap;
      for (const auto& entry : node.entries()) {
        out << YAML::Key << entry.key << YAML::Value;
        emit_yaml(out, entry.value);
      }
      out << YAML::EndMap;
      break;
  }
}

}  // namespace detail

namespace {

SourceLocation location(const std::string& source, const YAML::Mark& mark) {
  if (mark.is_null()) return {source, 0, 0};
  return {source, mark.line + 1, mark.column + 1};
}

// Converts yaml-cpp's tree, where an alias is a shared node, into our own; counting every node
// visited bounds the work an alias bomb can cause.
class Converter {
 public:
  Converter(const std::string& source, Diagnostics& diagnostics)
      : source_(source), diagnostics_(diagnostics) {}

  ConfigNode convert(const YAML::Node& node, int depth) {
    const SourceLocation where = location(source_, node.Mark());
    if (failed_) return ConfigNode::null(where);
    if (++nodes_ > kMaxConfigNodes) {
      diagnostics_.error(where, "",
                         "the document expands to more than " + std::to_string(kMaxConfigNodes) +
                             " values (aliases such as *name count each time they are used); "
                             "this looks like an alias bomb - write the values out, or use "
                             "fewer aliases");
      failed_ = true;
      return ConfigNode::null(where);
    }
    if (depth > kMaxConfigDepth) {
      diagnostics_.error(where, "",
                         "nesting deeper than " + std::to_string(kMaxConfigDepth) +
                             " levels; an experiment config is never this deep - flatten it");
      failed_ = true;
      return ConfigNode::null(where);
    }
    switch (node.Type()) {
      case YAML::NodeType::Undefined:
      case YAML::NodeType::Null:
        return ConfigNode::null(where);
      case YAML::NodeType::Scalar:
        // yaml-cpp tags plain scalars "?" and quoted or block scalars "!".
        return ConfigNode::scalar(node.Scalar(), where, node.Tag() == "!");
      case YAML::NodeType::Sequence: {
        ConfigNode out = ConfigNode::sequence(where);
        for (const auto& item : node) {
          out.items().push_back(convert(item, depth + 1));
          if (failed_) break;
        }
        return out;
      }
      case YAML::NodeType::Map: {
        ConfigNode out = ConfigNode::map(where);
        for (const auto& pair : node) {
          const SourceLocation key_where = location(source_, pair.first.Mark());
          if (!pair.first.IsScalar()) {
            diagnostics_.error(key_where, "",
                               "a key must be a plain name, got " +
                                   std::string(pair.first.IsMap() ? "a map" : "a list or null") +
                                   " as a key");
            continue;
          }
          const std::string key = pair.first.Scalar();
          bool duplicate = false;
          for (const auto& existing : out.entries()) {
            if (existing.key == key) {
              diagnostics_.error(key_where, key,
                                 "duplicate key (first defined at line " +
                                     std::to_string(existing.key_where.line) +
                                     "); remove one of them");
              duplicate = true;
              break;
            }
          }
          ConfigNode value = convert(pair.second, depth + 1);
          // yaml-cpp places an empty value where the next token starts: point at its key.
          if (value.is_null()) value = ConfigNode::null(key_where);
          if (!duplicate) out.entries().push_back({key, key_where, std::move(value)});
          if (failed_) break;
        }
        return out;
      }
    }
    return ConfigNode::null(where);
  }

 private:
  const std::string& source_;
  Diagnostics& diagnostics_;
  std::size_t nodes_ = 0;
  bool failed_ = false;
};

std::string translate_parser_message(const YAML::ParserException& e) {
  std::string message = e.msg;
  if (dynamic_cast<const YAML::DeepRecursion*>(&e) != nullptr) {
    return "nesting deeper than " + std::to_string(kMaxConfigDepth) +
           " levels; an experiment config is never this deep - flatten it";
  }
  if (!message.empty()) message[0] = static_cast<char>(std::tolower(message[0]));
  return "invalid YAML: " + message;
}

}  // namespace

void ConfigNode::relocate(const SourceLocation& where) {
  where_ = where;
  for (auto& item : items_) item.relocate(where);
  for (auto& entry : entries_) {
    entry.key_where = where;
    entry.value.relocate(where);
  }
}

std::string ConfigNode::to_yaml() const {
  YAML::Emitter out;
  out.SetIndent(2);
  detail::emit_yaml(out, *this);
  return std::string(out.c_str()) + "\n";
}

ConfigNode parse_config_text(std::string_view text, const std::string& source,
                             Diagnostics& diagnostics) {
  if (text.size() > kMaxConfigBytes) {
    diagnostics.error({source, 0, 0}, "",
                      "is " + std::to_string(text.size()) + " bytes; configs are limited to " +
                          std::to_string(kMaxConfigBytes) + " bytes");
    return ConfigNode::null({source, 0, 0});
  }
  if (text.find('\0') != std::string_view::npos) {
    diagnostics.error({source, 0, 0}, "", "contains a NUL byte; a config must be UTF-8 text");
    return ConfigNode::null({source, 0, 0});
  }
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(std::string(text));
  } catch (const YAML::ParserException& e) {
    diagnostics.error(location(source, e.mark), "", translate_parser_message(e));
    return ConfigNode::null({source, 0, 0});
  } catch (const YAML::Exception& e) {
    diagnostics.error(location(source, e.mark), "", std::string("invalid YAML: ") + e.msg);
    return ConfigNode::null({source, 0, 0});
  }
  if (documents.empty()) return ConfigNode::null({source, 1, 1});
  if (documents.size() > 1) {
    diagnostics.error(location(source, documents[1].Mark()), "",
                      "holds " + std::to_string(documents.size()) +
                          " YAML documents; an experiment config is one document (remove the "
                          "extra '---' separators)");
  }
  Converter converter(source, diagnostics);
  return converter.convert(documents.front(), 1);
}

ConfigNode load_config_file(const std::string& path, Diagnostics& diagnostics) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    const int err = errno;
    diagnostics.error({path, 0, 0}, "",
                      std::string("cannot read: ") + std::strerror(err) +
                          (err == ENOENT ? " (check the path)" : ""));
    return ConfigNode::null({path, 0, 0});
  }
  if (!S_ISREG(info.st_mode)) {
    diagnostics.error({path, 0, 0}, "", "is not a regular file");
    return ConfigNode::null({path, 0, 0});
  }
  if (static_cast<std::size_t>(info.st_size) > kMaxConfigBytes) {
    diagnostics.error({path, 0, 0}, "",
                      "is " + std::to_string(info.st_size) + " bytes; configs are limited to " +
                          std::to_string(kMaxConfigBytes) + " bytes - is this the right file?");
    return ConfigNode::null({path, 0, 0});
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    diagnostics.error({path, 0, 0}, "", std::string("cannot read: ") + std::strerror(errno));
    return ConfigNode::null({path, 0, 0});
  }
  std::string text;
  text.resize(kMaxConfigBytes + 1);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(in.gcount()));
  return parse_config_text(text, path, diagnostics);
}

ConfigNode merge_template(const ConfigNode& template_root, const ConfigNode& config_root) {
  if (template_root.is_map() && config_root.is_map()) {
    ConfigNode merged = template_root;
    for (const auto& entry : config_root.entries()) {
      if (ConfigNode* existing = merged.find(entry.key)) {
        *existing = merge_template(*existing, entry.value);
      } else {
        merged.entries().push_back(entry);
      }
    }
    return merged;
  }
  if (template_root.is_sequence() && config_root.is_sequence()) {
    ConfigNode merged = config_root;
    merged.items().clear();
    for (const auto& item : template_root.items()) merged.items().push_back(item);
    for (const auto& item : config_root.items()) merged.items().push_back(item);
    return merged;
  }
  return config_root;
}

void apply_override(ConfigNode& root, std::string_view assignment, Diagnostics& diagnostics) {
  const std::string source = "--set " + std::string(assignment);
  const SourceLocation where{source, 0, 0};
  const std::size_t equals = assignment.find('=');
  if (equals == std::string_view::npos) {
    diagnostics.error(where, "", "expected KEY.PATH=VALUE, e.g. --set resources.slots_per_trial=4");
    return;
  }
  const std::string path(assignment.substr(0, equals));
  const std::string value_text(assignment.substr(equals + 1));

  std::vector<std::string> keys;
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = path.find('.', start);
    keys.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  for (const auto& key : keys) {
    if (key.empty()) {
      diagnostics.error(where, path,
                        "empty key in the path; write keys separated by single dots, e.g. "
                        "scheduler.time_limit=2h");
      return;
    }
  }

  Diagnostics value_diagnostics;
  ConfigNode value = parse_config_text(value_text, source, value_diagnostics);
  for (const auto& item : value_diagnostics.items()) {
    diagnostics.error(item.where, path, "the value is not valid YAML: " + item.message);
  }
  if (!value_diagnostics.empty()) return;
  value.relocate(where);  // line 1, column 1 of a command-line value says nothing

  if (!root.is_map()) root = ConfigNode::map(root.where());
  ConfigNode* node = &root;
  std::string walked;
  for (std::size_t i = 0; i + 1 < keys.size(); ++i) {
    walked += (walked.empty() ? "" : ".") + keys[i];
    ConfigNode* child = node->find(keys[i]);
    if (child == nullptr || child->is_null()) {
      child = &node->set(keys[i], ConfigNode::map(where), where);
    } else if (!child->is_map()) {
      diagnostics.error(where, path,
                        "cannot set a key inside " + walked + ", which is " + child->kind_name() +
                            " (" + child->where().to_string() + "); to replace a list, give it "
                            "whole: --set " + walked + "=[a,b]");
      return;
    }
    node = child;
  }
  node->set(keys.back(), std::move(value), where);
}

}  // namespace hpctrial::core
