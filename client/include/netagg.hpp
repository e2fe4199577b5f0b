// netagg's C++ API: RAII classes over the C API of netagg.h, reporting failures as
// netagg::Error exceptions that carry the netagg_result and its detailed message.
//
// Header-only, C++11 or later; link with `pkg-config --libs netagg`. The
// SwitchML-compatible API (<switchml/context.h>) is built on these classes.
//
//   netagg::Context context(netagg::Config::load());
//   context.start();
//   std::vector<float> gradients(1 << 20, 1.0f);
//   context.allreduce(gradients.data(), gradients.data(), gradients.size());
//   netagg::Job job = context.allreduce_async(in, out, n);   // in, out: int32_t* or float*
//   job.wait();
//   // 16-bit elements, which C++11 has no type for, name their type:
//   context.allreduce(halves, halves, n, NETAGG_BFLOAT16);
//
// Thread safety is that of the C API: a Context may be used from several threads at once
// (but destroyed by one, last); a Job may be waited on from any thread.

#ifndef NETAGG_HPP
#define NETAGG_HPP

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "netagg.h"

namespace netagg {

/// A failed call: what() is the library's detailed message, code() its netagg_result.
class Error : public std::runtime_error {
 public:
  Error(netagg_result code, const std::string& message) : std::runtime_error(message), code_(code) {}
  netagg_result code() const noexcept { return code_; }

 private:
  netagg_result code_;
};

namespace detail {

/// Reads text the C API writes into a caller's buffer (`write` is such a call, given
/// buffer, capacity and length): asks the length, then the text. Returns the call's result.
/// The text may grow between the calls (statistics while jobs run): asks again then.
template <typename Write>
inline netagg_result read_text(Write write, std::string& text) {
  std::size_t length = 0;
  netagg_result result = write(nullptr, 0, &length);
  while (result == NETAGG_BUFFER_TOO_SMALL) {
    text.assign(length + 1, '\0');
    result = write(&text[0], text.size(), &length);
  }
  text.resize(result == NETAGG_OK ? length : 0);
  return result;
}

/// std::exchange, which is C++14: these headers need only C++11, as SwitchML's API.
template <typename T>
inline T exchange(T& object, T value) {
  T old = object;
  object = value;
  return old;
}

inline std::string last_error_message() {
  std::string message;
  read_text(netagg_last_error_message, message);
  return message;
}

/// Throws the calling thread's last error if `result` is not NETAGG_OK.
inline void check(netagg_result result) {
  if (result != NETAGG_OK) {
    throw Error(result, last_error_message());
  }
}

template <typename T>
struct DataTypeOf;
template <>
struct DataTypeOf<float> {
  static constexpr netagg_data_type value = NETAGG_FLOAT32;
};
template <>
struct DataTypeOf<std::int32_t> {
  static constexpr netagg_data_type value = NETAGG_INT32;
};

}  // namespace detail

/// The library's version string.
inline std::string version() { return netagg_version(); }

/// A configuration: SwitchML's keys plus netagg's (configs/netagg.cfg documents them).
class Config {
 public:
  /// Every key at its default; no file, no environment.
  Config() { detail::check(netagg_config_new(&config_)); }

  /// The file at `path`, or (nullptr) the first one found, then the environment, as
  /// every netagg program reads its configuration.
  static Config load(const char* path = nullptr) {
    netagg_config* config = nullptr;
    detail::check(netagg_config_load(path, &config));
    return Config(config);
  }

  Config(Config&& other) noexcept : config_(detail::exchange<netagg_config*>(other.config_, nullptr)) {}
  Config& operator=(Config&& other) noexcept {
    std::swap(config_, other.config_);
    return *this;
  }
  Config(const Config&) = delete;
  Config& operator=(const Config&) = delete;
  ~Config() { netagg_config_free(config_); }

  /// Sets `section.key` (e.g. "general.num_workers") from its text.
  Config& set(const std::string& key, const std::string& value) {
    detail::check(netagg_config_set(config_, key.c_str(), value.c_str()));
    return *this;
  }

  /// The value of `section.key` as text.
  std::string get(const std::string& key) const {
    std::string value;
    detail::check(detail::read_text(
        [&](char* buffer, std::size_t capacity, std::size_t* length) {
          return netagg_config_get(config_, key.c_str(), buffer, capacity, length);
        },
        value));
    return value;
  }

  const netagg_config* raw() const noexcept { return config_; }

 private:
  friend class Context;
  explicit Config(netagg_config* config) : config_(config) {}
  netagg_config* config_ = nullptr;
};

/// A submitted allreduce; releases its handle when destroyed (the job itself goes on).
class Job {
 public:
  Job() = default;
  Job(Job&& other) noexcept : handle_(detail::exchange<netagg_job>(other.handle_, 0)) {}
  Job& operator=(Job&& other) noexcept {
    std::swap(handle_, other.handle_);
    return *this;
  }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  ~Job() { netagg_job_free(handle_); }

  /// Waits until the job has finished; throws if it failed.
  void wait() const { detail::check(netagg_job_wait(handle_)); }

  /// Waits at most `timeout`: true if the job finished, false if it still runs; throws
  /// if it failed.
  bool wait_for(std::chrono::milliseconds timeout) const {
    netagg_result result = netagg_job_wait_timeout(handle_, static_cast<std::uint64_t>(timeout.count()));
    if (result == NETAGG_WAIT_TIMEOUT) {
      return false;
    }
    detail::check(result);
    return true;
  }

  netagg_job_state state() const {
    netagg_job_state state = NETAGG_JOB_STATE_QUEUED;
    detail::check(netagg_job_status(handle_, &state));
    return state;
  }

  /// The job's number: from 1 in submission order, the same on every rank.
  std::uint64_t id() const {
    std::uint64_t id = 0;
    detail::check(netagg_job_id(handle_, &id));
    return id;
  }

  netagg_job handle() const noexcept { return handle_; }

 private:
  friend class Context;
  explicit Job(netagg_job handle) : handle_(handle) {}
  netagg_job handle_ = 0;
};

/// One rank of a session.
class Context {
 public:
  /// A context for `config` (copied), not started yet.
  explicit Context(const Config& config) { detail::check(netagg_context_new(config.raw(), &context_)); }
  Context(Context&& other) noexcept : context_(detail::exchange<netagg_context*>(other.context_, nullptr)) {}
  Context& operator=(Context&& other) noexcept {
    std::swap(context_, other.context_);
    return *this;
  }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  /// Stops the context if it runs.
  ~Context() { netagg_context_free(context_); }

  /// Registers with the switch and waits for every rank (or sets up the dummy backend).
  void start() { detail::check(netagg_context_start(context_)); }
  /// Fails the jobs still running and leaves the session.
  void stop() { detail::check(netagg_context_stop(context_)); }

  netagg_context_state state() const {
    netagg_context_state state = NETAGG_CONTEXT_CREATED;
    detail::check(netagg_context_get_state(context_, &state));
    return state;
  }

  /// The context's configuration (a copy).
  Config config() const {
    netagg_config* config = nullptr;
    detail::check(netagg_context_config(context_, &config));
    return Config(config);
  }

  /// Sums `numel` elements of `data_type` over every rank, from `input` into `output`
  /// (which may be `input`), and returns when the sums are there.
  void allreduce(const void* input, void* output, std::uint64_t numel, netagg_data_type data_type) {
    detail::check(netagg_allreduce(context_, input, output, numel, data_type));
  }

  template <typename T>
  void allreduce(const T* input, T* output, std::uint64_t numel) {
    allreduce(input, output, numel, detail::DataTypeOf<T>::value);
  }

  /// Submits the allreduce and returns at once; the buffers must stay untouched until
  /// the job has ended.
  Job allreduce_async(const void* input, void* output, std::uint64_t numel, netagg_data_type data_type) {
    netagg_job job = 0;
    detail::check(netagg_allreduce_async(context_, input, output, numel, data_type, &job));
    return Job(job);
  }

  template <typename T>
  Job allreduce_async(const T* input, T* output, std::uint64_t numel) {
    return allreduce_async(input, output, numel, detail::DataTypeOf<T>::value);
  }

  /// Waits until every submitted job has finished or failed.
  void wait_all() { detail::check(netagg_wait_all(context_)); }

  netagg_stats stats() const {
    netagg_stats stats = netagg_stats();
    detail::check(netagg_context_stats(context_, &stats, sizeof stats));
    return stats;
  }

  /// The counters as text: one line for the jobs, one per worker thread.
  std::string stats_text() const {
    std::string text;
    detail::check(detail::read_text(
        [&](char* buffer, std::size_t capacity, std::size_t* length) {
          return netagg_context_stats_text(context_, buffer, capacity, length);
        },
        text));
    return text;
  }

  void reset_stats() { detail::check(netagg_context_reset_stats(context_)); }

  netagg_context* raw() const noexcept { return context_; }

 private:
  netagg_context* context_ = nullptr;
};

}  // namespace netagg

#endif  // NETAGG_HPP
