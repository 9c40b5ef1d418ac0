// What the trial directory says about a trial's runs and its next size.
#include "hpctrial/core/experiment_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../../support/temp_dir.h"

namespace hpctrial::core {
namespace {

using testing_support::TempDir;

TEST(TrialProgress, ListsEachRunOfTheTrialAndSkipsALineCutShort) {
  TempDir dir;
  const ExperimentLayout layout{dir.path().string()};
  dir.write("trial-0/runs.jsonl",
            "{\"started\":\"2026-11-25T10:00:00Z\",\"ranks\":2,\"batch\":16,\"local_batch\":8,\"accumulation\":1,"
            "\"batches\":0}\n"
            "{\"started\":\"2026-11-25T11:00:00Z\",\"ranks\":1,\"batch\":32,\"local_batch\":16,\"accumulation\":2,"
            "\"batches\":1200}\n"
            "{\"started\":\"2026-11-25T12:0");
  const TrialProgress p = trial_progress(layout, 0);
  ASSERT_EQ(p.runs.size(), 2u);
  EXPECT_EQ(p.runs[0].ranks, 2);
  EXPECT_EQ(p.runs[0].started, "2026-11-25T10:00:00Z");
  EXPECT_EQ(p.runs[1].ranks, 1);
  EXPECT_EQ(p.runs[1].batch, 32);
  EXPECT_EQ(p.runs[1].local_batch, 16);
  EXPECT_EQ(p.runs[1].accumulation, 2);
  EXPECT_EQ(p.runs[1].batches, 1200);
}

TEST(PreferredSlots, AreWholeNodesWithinTheElasticRange) {
  TempDir dir;
  Resources elastic;
  elastic.slots_per_trial = 8;
  elastic.slots_per_node = 2;
  elastic.min_slots_per_trial = 2;
  const std::string trial = dir.path().string();
  EXPECT_EQ(preferred_slots(trial, elastic), std::nullopt) << "no preference yet";
  dir.write("elastic.json", "{\"preferred_slots\": 5}\n");
  EXPECT_EQ(preferred_slots(trial, elastic), 4);
  dir.write("elastic.json", "{\"preferred_slots\": 64}\n");
  EXPECT_EQ(preferred_slots(trial, elastic), 8);
  dir.write("elastic.json", "{\"preferred_slots\": 1}\n");
  EXPECT_EQ(preferred_slots(trial, elastic), 2);
  dir.write("elastic.json", "{\"preferred_sl");
  EXPECT_EQ(preferred_slots(trial, elastic), std::nullopt) << "a file cut short is no preference";
  Resources fixed;
  fixed.slots_per_trial = 8;
  dir.write("elastic.json", "{\"preferred_slots\": 4}\n");
  EXPECT_EQ(preferred_slots(trial, fixed), std::nullopt) << "a trial that is not elastic keeps its size";
}

}  // namespace
}  // namespace hpctrial::core
