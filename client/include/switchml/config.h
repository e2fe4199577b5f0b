// SwitchML-compatible client API, part of netagg: configuration. See context.h.
//
// The members are SwitchML's; their values map onto netagg's keys of the same names.
// netagg reads netagg.cfg (the same format, sections and keys; configs/netagg.cfg) rather
// than switchml.cfg, and its own keys (job_timeout, session, depth, ...) come from that
// file or from NETAGG_<SECTION>__<KEY> variables.

#ifndef NETAGG_SWITCHML_CONFIG_H
#define NETAGG_SWITCHML_CONFIG_H

#include <cstdint>
#include <cstdio>
#include <iomanip>
#include <sstream>
#include <string>

#include "common.h"

namespace switchml {

struct GeneralConfig {
  std::uint16_t rank;
  std::uint16_t num_workers;
  std::uint16_t num_worker_threads;
  std::uint32_t max_outstanding_packets;
  std::uint64_t packet_numel;
  /// "udp", "dpdk" or "rdma" (through a netagg-switch, from a kernel socket, a DPDK port
  /// or RDMA queue pairs) or "dummy".
  std::string backend;
  /// Only "fifo", as in SwitchML; netagg does not make threads wait for each other.
  std::string scheduler;
  /// "native" or "cpu_exponent_quantizer". SwitchML's "bypass" (which moves no data) is
  /// refused.
  std::string prepostprocessor;
  /// Every job completes at once without communicating (for debugging).
  bool instant_job_completion;
  std::string controller_ip_str;
  std::uint16_t controller_port;
  /// First retransmission timeout, milliseconds.
  double timeout;
  /// Kept for source compatibility and ignored: netagg's retransmission timeout follows
  /// the measured round-trip time and doubles on each timeout of a slot.
  std::uint64_t timeout_threshold;
  std::uint64_t timeout_threshold_increment;
};

struct DummyBackendConfig {
  /// Emulated bandwidth, Mbit/s; 0 runs as fast as the CPU allows.
  float bandwidth;
  bool process_packets;
};

struct BackendConfig {
  DummyBackendConfig dummy;
};

class Config {
 public:
  /// netagg's defaults (SwitchML leaves the members uninitialised).
  Config() { FromNetagg(netagg::Config()); }

  /// Reads the file at `path`, or ("") the first of $NETAGG_CONFIG, ./netagg.cfg,
  /// ./netagg-<hostname>.cfg and /etc/netagg.cfg, then the environment. On error, prints
  /// it (naming the file, the key and the values allowed) and returns false.
  bool LoadFromFile(std::string path = "") {
    try {
      FromNetagg(netagg::Config::load(path.empty() ? nullptr : path.c_str()));
      path_ = path;
      return true;
    } catch (const netagg::Error& error) {
      std::fprintf(stderr, "netagg: %s\n", error.what());
      return false;
    }
  }

  /// Prints what is invalid, if anything (SwitchML aborts instead); Context::Start
  /// refuses an invalid configuration.
  void Validate() {
    std::string error;
    if (!IsValid(&error)) {
      std::fprintf(stderr, "netagg: invalid configuration: %s\n", error.c_str());
    }
  }

  /// netagg's addition: whether Context::Start would accept this configuration, and if
  /// not, why.
  bool IsValid(std::string* error = nullptr) const {
    try {
      netagg::Context check(ToNetagg());
      return true;
    } catch (const netagg::Error& e) {
      if (error != nullptr) {
        *error = e.what();
      }
      return false;
    }
  }

  void PrintConfig() {
    std::printf(
        "[general]\nrank = %u\nnum_workers = %u\nnum_worker_threads = %u\nmax_outstanding_packets = %u\n"
        "packet_numel = %llu\nbackend = %s\nscheduler = %s\nprepostprocessor = %s\n"
        "instant_job_completion = %s\ncontroller_ip = %s\ncontroller_port = %u\ntimeout = %g\n"
        "\n[backend.dummy]\nbandwidth = %g\nprocess_packets = %s\n",
        general_.rank, general_.num_workers, general_.num_worker_threads, general_.max_outstanding_packets,
        static_cast<unsigned long long>(general_.packet_numel), general_.backend.c_str(),
        general_.scheduler.c_str(), general_.prepostprocessor.c_str(),
        general_.instant_job_completion ? "true" : "false", general_.controller_ip_str.c_str(),
        general_.controller_port, general_.timeout, static_cast<double>(backend_.dummy.bandwidth),
        backend_.dummy.process_packets ? "true" : "false");
  }

  GeneralConfig general_;
  BackendConfig backend_;

  /// netagg's addition: the netagg configuration these members describe, on top of the
  /// file they were loaded from (for netagg's own keys). Throws netagg::Error naming the
  /// key and the values allowed.
  netagg::Config ToNetagg() const {
    netagg::Config config = netagg::Config::load(path_.empty() ? nullptr : path_.c_str());
    if (general_.scheduler != "fifo") {
      throw netagg::Error(NETAGG_CONFIG_VALUE,
                          "general.scheduler = '" + general_.scheduler + "': expected 'fifo'");
    }
    config.set("general.rank", std::to_string(general_.rank))
        .set("general.num_workers", std::to_string(general_.num_workers))
        .set("general.num_worker_threads", std::to_string(general_.num_worker_threads))
        .set("general.max_outstanding_packets", std::to_string(general_.max_outstanding_packets))
        .set("general.packet_numel", std::to_string(general_.packet_numel))
        .set("general.backend", general_.backend)
        .set("general.prepostprocessor", general_.prepostprocessor)
        .set("general.controller_ip", general_.controller_ip_str)
        .set("general.controller_port", std::to_string(general_.controller_port))
        .set("general.timeout", Exact(general_.timeout))
        .set("backend.dummy.bandwidth", Exact(backend_.dummy.bandwidth))
        .set("backend.dummy.process_packets", backend_.dummy.process_packets ? "true" : "false");
    return config;
  }

  /// netagg's addition: sets the members from a netagg configuration.
  void FromNetagg(const netagg::Config& config) {
    general_.rank = static_cast<std::uint16_t>(std::stoul(config.get("general.rank")));
    general_.num_workers = static_cast<std::uint16_t>(std::stoul(config.get("general.num_workers")));
    general_.num_worker_threads = static_cast<std::uint16_t>(std::stoul(config.get("general.num_worker_threads")));
    general_.max_outstanding_packets =
        static_cast<std::uint32_t>(std::stoul(config.get("general.max_outstanding_packets")));
    general_.packet_numel = std::stoull(config.get("general.packet_numel"));
    general_.backend = config.get("general.backend");
    general_.scheduler = "fifo";
    general_.prepostprocessor = config.get("general.prepostprocessor");
    general_.instant_job_completion = false;
    general_.controller_ip_str = config.get("general.controller_ip");
    general_.controller_port = static_cast<std::uint16_t>(std::stoul(config.get("general.controller_port")));
    general_.timeout = std::stod(config.get("general.timeout"));
    general_.timeout_threshold = 0;
    general_.timeout_threshold_increment = 0;
    backend_.dummy.bandwidth = std::stof(config.get("backend.dummy.bandwidth"));
    backend_.dummy.process_packets = config.get("backend.dummy.process_packets") == "true";
  }

 private:
  static std::string Exact(double value) {
    std::ostringstream text;
    text << std::setprecision(17) << value;
    return text.str();
  }

  /// The file LoadFromFile read ("" for the default search).
  std::string path_;
};

}  // namespace switchml

#endif  // NETAGG_SWITCHML_CONFIG_H
