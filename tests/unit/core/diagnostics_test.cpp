#include "hpctrial/core/diagnostics.h"

#include <gtest/gtest.h>

#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

TEST(ClosestMatch, FindsTyposAndTranspositions) {
  const std::vector<std::string> keys = {"slots_per_trial", "slots_per_node", "cpus_per_slot"};
  EXPECT_EQ(closest_match("slot_per_trial", keys), "slots_per_trial");
  EXPECT_EQ(closest_match("slots_per_ndoe", keys), "slots_per_node");
  EXPECT_EQ(closest_match("cpu_per_slot", keys), "cpus_per_slot");
}

TEST(ClosestMatch, RefusesFarFetchedSuggestions) {
  EXPECT_EQ(closest_match("zzz", {"slots_per_trial", "name"}), "");
  EXPECT_EQ(closest_match("x", {}), "");
}

TEST(Diagnostics, FormatsAndThrowsEverything) {
  Diagnostics d;
  d.error({"exp.yaml", 14, 5}, "resources.slots_per_trial", "must be a positive integer, got \"-2\"");
  d.error({"exp.yaml", 0, 0}, "", "holds 2 YAML documents");
  EXPECT_EQ(d.to_string(),
            "exp.yaml:14:5: resources.slots_per_trial: must be a positive integer, got \"-2\"\n"
            "exp.yaml: holds 2 YAML documents");
  EXPECT_THROW(d.throw_if_any(), ConfigError);
  EXPECT_NO_THROW(Diagnostics().throw_if_any());
}

}  // namespace
}  // namespace hpctrial::core
