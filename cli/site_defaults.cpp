#include "site_defaults.h"

#include <filesystem>

#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/subprocess.h"

namespace fs = std::filesystem;

namespace hpctrial::cli {

std::string site_defaults_path() {
  if (const auto set = core::ProcessEnv().get("HPCTRIAL_SITE_CONFIG")) {
    if (set->empty()) return "";
    if (!fs::is_regular_file(*set)) {
      throw ConfigError("HPCTRIAL_SITE_CONFIG names " + *set + ", which is not a file; fix it, or unset it");
    }
    return *set;
  }
  const fs::path self = core::self_program("");
  if (self.empty()) return "";
  const fs::path site = self.parent_path().parent_path() / "etc" / "hpctrial" / "site.yaml";
  std::error_code ec;
  return fs::is_regular_file(site, ec) ? site.string() : "";
}

}  // namespace hpctrial::cli
