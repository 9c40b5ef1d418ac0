#include "verb.h"

namespace hpctrial::cli {

std::vector<Verb> builtin_verbs() {
  return {
      config_verb(),
  };
}

}  // namespace hpctrial::cli
