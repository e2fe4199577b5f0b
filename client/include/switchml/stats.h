// SwitchML-compatible client API, part of netagg: statistics. See context.h.

#ifndef NETAGG_SWITCHML_STATS_H
#define NETAGG_SWITCHML_STATS_H

#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

#include "common.h"

namespace switchml {

/// The context's counters. Unlike SwitchML's, they are read from the library when
/// logged, so they are consistent while jobs run, and LogStats prints whatever the
/// logging level.
class Stats {
 public:
  /// Prints the counters to stderr, in SwitchML's layout for the job counts, then one
  /// line per worker thread.
  void LogStats() {
    std::shared_ptr<netagg::Context> context = Current();
    if (context == nullptr) {
      std::fprintf(stderr, "Stats: the context has not been started\n");
      return;
    }
    try {
      netagg_stats stats = context->stats();
      std::fprintf(stderr,
                   "Stats: \n    Submitted jobs: #%llu#\n    Submitted elements: #%llu#\n"
                   "    Finished jobs: #%llu#\n    Failed jobs: #%llu#\n"
                   "    Total packets sent: #%llu#\n    Correct packets received: #%llu#\n"
                   "    Wrong packets received: #%llu#\n    Number of timeouts: #%llu#\n%s",
                   Count(stats.jobs_submitted), Count(stats.elements_submitted), Count(stats.jobs_finished),
                   Count(stats.jobs_failed), Count(stats.packets_sent), Count(stats.results_received),
                   Count(stats.duplicates + stats.stale + stats.rejected), Count(stats.timeouts),
                   context->stats_text().c_str());
    } catch (const netagg::Error& error) {
      std::fprintf(stderr, "Stats: %s\n", error.what());
    }
  }

  void ResetStats() {
    std::shared_ptr<netagg::Context> context = Current();
    if (context == nullptr) {
      return;
    }
    try {
      context->reset_stats();
    } catch (const netagg::Error& error) {
      std::fprintf(stderr, "Stats: %s\n", error.what());
    }
  }

  /// netagg's addition: the counters themselves (zero before the context started).
  netagg_stats GetCounters() {
    netagg_stats stats = netagg_stats();
    std::shared_ptr<netagg::Context> context = Current();
    if (context != nullptr) {
      try {
        stats = context->stats();
      } catch (const netagg::Error&) {
      }
    }
    return stats;
  }

 private:
  friend class Context;
  static unsigned long long Count(std::uint64_t count) { return static_cast<unsigned long long>(count); }

  /// Counts for `context` from now on (Context::Start).
  void Attach(std::shared_ptr<netagg::Context> context) {
    std::lock_guard<std::mutex> lock(mutex_);
    context_ = std::move(context);
  }

  std::shared_ptr<netagg::Context> Current() {
    std::lock_guard<std::mutex> lock(mutex_);
    return context_;
  }

  std::mutex mutex_;
  std::shared_ptr<netagg::Context> context_;
};

}  // namespace switchml

#endif  // NETAGG_SWITCHML_STATS_H
