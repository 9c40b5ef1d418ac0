// A site's defaults for every experiment (partition, account, modules, checkpoint path), merged
// under each config that `hpctrial run`, `submit` and `config` read: site < template < config
// < --set.
#pragma once

#include <string>

namespace hpctrial::cli {

// $HPCTRIAL_SITE_CONFIG when it is set (set and empty: none), else etc/hpctrial/site.yaml of the
// installation this command belongs to (PREFIX/bin/hpctrial -> PREFIX/etc/hpctrial/site.yaml)
// when it exists, else none (""). ConfigError when HPCTRIAL_SITE_CONFIG names no file.
std::string site_defaults_path();

}  // namespace hpctrial::cli
