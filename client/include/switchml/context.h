// SwitchML's client API (namespace switchml, as in p4app-switchML's client_lib), over
// netagg's library: SwitchML applications compile against it unchanged and link with
// `pkg-config --libs netagg`.
//
// Where SwitchML aborts the process on misuse, netagg reports the error as far as
// SwitchML's signatures allow:
// - Start returns false and prints why (a bad configuration, an unreachable switch, a
//   rejected registration) instead of aborting; a context that was stopped may be
//   started again (a new session), which SwitchML forbids.
// - AllReduceAsync/AllReduce before Start, after Stop, or with bad arguments return a job
//   that is FAILED at once (never nullptr); Job::GetErrorMessage() says why.
// - Stop and WaitForAllJobs when the context is not running do nothing, after printing
//   why for Stop.
// - A job that fails (a dead switch or worker, within general.job_timeout) ends FAILED;
//   WaitForAllJobs counts it as done, as SwitchML does, so check each job's status.
//
// Thread safety: every method may be called from any thread, also Stop while another
// thread waits (SwitchML's benchmarks stop the context from a signal-handling thread).

#ifndef NETAGG_SWITCHML_CONTEXT_H
#define NETAGG_SWITCHML_CONTEXT_H

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
// SwitchML's context.h brings these in through its scheduler and backend headers, and
// its applications rely on it (dnn_benchmark calls std::this_thread::sleep_for).
#include <thread>
#include <vector>

#include "common.h"
#include "config.h"
#include "job.h"
#include "stats.h"

namespace switchml {

class Context {
 public:
  enum ContextState { CREATED, STARTING, RUNNING, STOPPING, STOPPED };

  Context(Context const&) = delete;
  void operator=(Context const&) = delete;
  Context(Context&&) = delete;
  Context& operator=(Context&&) = delete;

  /// The process's one context, made on first use.
  static Context& GetInstance() {
    static Context instance;
    return instance;
  }

  /// Starts the context from `config`, or (NULL) from netagg.cfg and the environment:
  /// registers with the switch and waits until every rank has. Returns false, after
  /// printing why, if it cannot.
  bool Start(Config* config = NULL) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ == RUNNING || state_ == STARTING) {
      std::fprintf(stderr, "netagg: Start: the context is already running\n");
      return false;
    }
    state_ = STARTING;
    try {
      Config requested;
      if (config == NULL && !requested.LoadFromFile()) {
        state_ = CREATED;
        return false;
      }
      if (config != NULL) {
        requested = *config;
      }
      std::shared_ptr<netagg::Context> context = std::make_shared<netagg::Context>(requested.ToNetagg());
      context->start();
      config_.FromNetagg(context->config());
      config_.general_.instant_job_completion = requested.general_.instant_job_completion;
      {
        std::lock_guard<std::mutex> running(context_mutex_);
        context_ = context;
      }
      stats_.Attach(context);
      state_ = RUNNING;
      return true;
    } catch (const netagg::Error& error) {
      std::fprintf(stderr, "netagg: Start: %s\n", error.what());
    } catch (const std::exception& error) {
      std::fprintf(stderr, "netagg: Start: %s\n", error.what());
    }
    state_ = CREATED;
    return false;
  }

  /// Stops the context: jobs still running fail, the worker threads end and the context
  /// leaves its session.
  void Stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ != RUNNING) {
      std::fprintf(stderr, "netagg: Stop: the context is not running\n");
      return;
    }
    state_ = STOPPING;
    try {
      Current()->stop();
    } catch (const netagg::Error& error) {
      std::fprintf(stderr, "netagg: Stop: %s\n", error.what());
    }
    state_ = STOPPED;
  }

  /// Submits an allreduce of `numel` elements from in_ptr into out_ptr (which may be
  /// in_ptr) and returns at once; the buffers must stay untouched until the job ended.
  std::shared_ptr<Job> AllReduceAsync(void* in_ptr, void* out_ptr, std::uint64_t numel, DataType data_type,
                                      AllReduceOperation all_reduce_operation) {
    Tensor tensor = {in_ptr, out_ptr, numel, data_type};
    std::shared_ptr<netagg::Context> context = Running();
    if (context == nullptr) {
      return std::make_shared<Job>(tensor, all_reduce_operation, FAILED,
                                   "the context is not running: call Start first");
    }
    if (config_.general_.instant_job_completion) {
      return std::make_shared<Job>(tensor, all_reduce_operation, FINISHED, std::string());
    }
    try {
      netagg::Job job =
          context->allreduce_async(in_ptr, out_ptr, numel, static_cast<netagg_data_type>(data_type));
      JobId id = job.id();
      return std::make_shared<Job>(std::move(job), id, tensor, all_reduce_operation);
    } catch (const netagg::Error& error) {
      return std::make_shared<Job>(tensor, all_reduce_operation, FAILED, error.what());
    }
  }

  /// AllReduceAsync, then waits for the job.
  std::shared_ptr<Job> AllReduce(void* in_ptr, void* out_ptr, std::uint64_t numel, DataType data_type,
                                 AllReduceOperation all_reduce_operation) {
    std::shared_ptr<Job> job = AllReduceAsync(in_ptr, out_ptr, numel, data_type, all_reduce_operation);
    job->WaitToComplete();
    return job;
  }

  /// Waits until every submitted job has finished or failed.
  /// Also while another thread stops the context: returns once the stop has ended every
  /// job, so that the buffers may be freed.
  void WaitForAllJobs() {
    std::shared_ptr<netagg::Context> context = Current();
    if (context == nullptr) {
      return;
    }
    try {
      context->wait_all();
    } catch (const netagg::Error& error) {
      std::fprintf(stderr, "netagg: WaitForAllJobs: %s\n", error.what());
    }
  }

  ContextState GetContextState() { return state_.load(); }

  /// The configuration the context runs with (after Start), as SwitchML's members.
  const Config& GetConfig() { return config_; }

  Stats& GetStats() { return stats_; }

 private:
  Context() : state_(CREATED) {}
  ~Context() = default;

  /// The running netagg context, or nullptr. Callers hold a reference, so a Start that
  /// replaces it (after a Stop) cannot free it under them.
  std::shared_ptr<netagg::Context> Running() {
    if (state_.load() != RUNNING) {
      return nullptr;
    }
    return Current();
  }

  std::shared_ptr<netagg::Context> Current() {
    std::lock_guard<std::mutex> lock(context_mutex_);
    return context_;
  }

  /// Serialises Start and Stop.
  std::mutex mutex_;
  std::atomic<ContextState> state_;
  std::mutex context_mutex_;
  std::shared_ptr<netagg::Context> context_;
  Config config_;
  Stats stats_;
};

}  // namespace switchml

#endif  // NETAGG_SWITCHML_CONTEXT_H
