// hpctrial job update|update-batch: a waiting job's priority, partition or queue, and its place
// among its user's jobs, changed with the scheduler's own commands, as Determined's `det job
// update` and `update-batch` change a job in its queue.
#include <boost/program_options.hpp>

#include <iostream>
#include <string>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/core/scheduler.h"
#include "job_verbs.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;

namespace hpctrial::cli {
namespace {

constexpr const char* kUsage = R"(usage: hpctrial job update JOB|EXPDIR [--priority N] [--partition P | --queue Q]
                           [--top | --ahead-of JOB | --behind-of JOB]
       hpctrial job update-batch JOB.KEY=VALUE [JOB.KEY=VALUE ...]

Changes a waiting job in its scheduler's queue, as far as the scheduler lets its user (EXPDIR:
the experiment's latest job; a job array's id: its waiting tasks). What a scheduler refuses is
an error with its own words, and nothing after it is changed.

  --priority N   higher starts first. PBS: the job's Priority (qalter -p, -1024 to 1023).
                 Slurm: Nice=-N (scontrol update), which a user may only lower: N <= 0.
  --partition P, --queue Q
                 the Slurm partition of a pending job (scontrol update Partition=), the PBS
                 queue (qmove)
  --top          first among your waiting jobs of its partition or queue (Slurm: scontrol
                 top, where the site allows users it; PBS: qorder with your first one)
  --ahead-of J, --behind-of J
                 PBS: one swap of places with your job J, where J is behind (ahead); Slurm
                 has no command for it (use --top or --priority)

update-batch takes KEY priority, partition, queue, top (true), ahead-of or behind-of, each
JOB.KEY=VALUE an update of its own, in order, e.g.
  hpctrial job update-batch 1234.priority=-10 1235.partition=long 1236.top=true

)";

core::JobUpdate::Order order_of(const std::string& key) {
  if (key == "top") return core::JobUpdate::Order::kTop;
  if (key == "ahead-of") return core::JobUpdate::Order::kAheadOf;
  if (key == "behind-of") return core::JobUpdate::Order::kBehindOf;
  return core::JobUpdate::Order::kNone;
}

int parse_priority(const std::string& text) {
  std::size_t used = 0;
  int value = 0;
  try {
    value = std::stoi(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw ConfigError("--priority takes a whole number, got \"" + text + "\"");
  return value;
}

// Resolves JOB|EXPDIR (and the other job of --ahead-of / --behind-of) and applies the update.
void update_one(const std::string& what, core::JobUpdate update) {
  const Target t = resolve_target(what);
  update.job = t.job;
  if (!update.other.empty()) update.other = resolve_target(update.other).job;
  const std::vector<std::string> done = t.scheduler->update_job(update);
  for (const std::string& line : done) std::cout << line << "\n";
  if (done.empty()) std::cout << t.scheduler->name() << " job " << update.job << ": nothing to change\n";
}

int usage_error(const std::string& message) {
  std::cerr << "hpctrial job: " << message << "\nrun 'hpctrial job --help' for usage\n";
  return kExitUsage;
}

// update-batch: each JOB.KEY=VALUE an update of its own, in order.
int update_batch(const std::vector<std::string>& items) {
  for (const std::string& item : items) {
    const auto equals = item.find('=');
    const auto dot = equals == std::string::npos ? std::string::npos : item.rfind('.', equals);
    if (dot == std::string::npos || dot == 0) return usage_error("\"" + item + "\" is not JOB.KEY=VALUE");
    const std::string key = item.substr(dot + 1, equals - dot - 1), value = item.substr(equals + 1);
    core::JobUpdate update;
    if (key == "priority") {
      update.priority = parse_priority(value);
    } else if (key == "partition" || key == "queue") {
      update.queue = value;
    } else if (key == "top" && value == "true") {
      update.order = core::JobUpdate::Order::kTop;
    } else if (key == "ahead-of" || key == "behind-of") {
      update.order = order_of(key);
      update.other = value;
    } else {
      return usage_error("\"" + item + "\": KEY is priority, partition, queue, top (=true), ahead-of or behind-of");
    }
    update_one(item.substr(0, dot), update);
  }
  return kExitOk;
}

int run_update(const std::vector<std::string>& args) {
  std::vector<std::string> positional;
  std::string priority, partition, queue, ahead, behind;
  bool top = false;
  VerbArgs command_line(kUsage);
  command_line.add_options()
      ("priority", po::value(&priority)->value_name("N"), "higher starts first (Slurm: N <= 0 only)")
      ("partition", po::value(&partition)->value_name("P"), "the Slurm partition of a pending job")
      ("queue", po::value(&queue)->value_name("Q"), "the PBS queue")
      ("top", po::bool_switch(&top), "first among your waiting jobs of its partition or queue")
      ("ahead-of", po::value(&ahead)->value_name("JOB"), "PBS: ahead of your job JOB")
      ("behind-of", po::value(&behind)->value_name("JOB"), "PBS: behind your job JOB");
  command_line.positional("positional", &positional);
  if (!command_line.parse(args)) return kExitOk;
  if (positional.empty() || (positional[0] != "update" && positional[0] != "update-batch")) {
    return usage_error(positional.empty() ? "say what to do: update or update-batch"
                                          : "unknown action '" + positional[0] + "'; use update or update-batch");
  }
  if (positional[0] == "update-batch") {
    if (!priority.empty() || !partition.empty() || !queue.empty() || top || !ahead.empty() || !behind.empty() ||
        positional.size() < 2) {
      return usage_error("update-batch takes JOB.KEY=VALUE arguments only, one or more");
    }
    return update_batch({positional.begin() + 1, positional.end()});
  }
  if (positional.size() != 2) return usage_error("update takes one JOB or EXPDIR");
  if (!partition.empty() && !queue.empty()) return usage_error("give --partition or --queue, not both");
  if (top + !ahead.empty() + !behind.empty() > 1) return usage_error("give one of --top, --ahead-of and --behind-of");
  core::JobUpdate update;
  if (!priority.empty()) update.priority = parse_priority(priority);
  update.queue = partition.empty() ? queue : partition;
  update.order = top ? core::JobUpdate::Order::kTop
                     : !ahead.empty() ? core::JobUpdate::Order::kAheadOf
                     : !behind.empty() ? core::JobUpdate::Order::kBehindOf : core::JobUpdate::Order::kNone;
  update.other = ahead.empty() ? behind : ahead;
  if (!update.priority && update.queue.empty() && update.order == core::JobUpdate::Order::kNone) {
    return usage_error("say what to change: --priority, --partition, --queue, --top, --ahead-of or --behind-of");
  }
  update_one(positional[1], update);
  return kExitOk;
}

}  // namespace

Verb job_verb() { return {"job", "change a waiting job's priority, partition or queue, or its place", run_update}; }

}  // namespace hpctrial::cli
