//! netagg's configuration: SwitchML's file format, sections and key names, plus netagg's
//! own keys, read by the client library (`[general]`, `[backend.*]`) and by the switch
//! (`[switch]`).
//!
//! Values come, later ones winning, from: the defaults; one config file; the launcher's
//! rank and world size (`OMPI_COMM_WORLD_RANK`/`_SIZE`, `PMI_RANK`/`PMI_SIZE`,
//! `SLURM_PROCID`/`SLURM_NTASKS`, `RANK`/`WORLD_SIZE`); and `NETAGG_<SECTION>__<KEY>`
//! variables (`NETAGG_GENERAL__NUM_WORKERS`, `NETAGG_BACKEND_UDP__BIND_IP`). The file is
//! the one named explicitly, else `$NETAGG_CONFIG`, else the first of `./netagg.cfg`,
//! `./netagg-<hostname>.cfg`, `/etc/netagg.cfg` that exists; none at all is fine.
//! `configs/netagg.cfg` documents every key.
//!
//! Fault injection has the same keys in two sections: `[faults]` for a worker's
//! transport and `[switch.faults]` for the switch's data path (also `netagg-switch
//! --faults KEY=VALUE,...`).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use netagg_aggregator::faults::{FaultRates, MAX_FAULT_DELAY};

/// Largest `general.packet_numel`: the most elements a packet carries inside a 64 KiB
/// datagram, the protocol's `netagg_wire::packet::MAX_ELEMENTS` (a test checks they agree).
pub const MAX_PACKET_NUMEL: u16 = 16364;
/// Longest `general.session`, in bytes: the protocol's
/// `netagg_wire::control::MAX_SESSION_NAME_LEN` (a test checks they agree).
pub const MAX_SESSION_NAME_LEN: usize = 64;

/// Which transport carries the packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// No network: an in-process switch sums as if every worker sent the same data.
    Dummy,
    /// UDP to a `netagg-switch`.
    Udp,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Dummy => "dummy",
            BackendKind::Udp => "udp",
        })
    }
}

/// Whether a job's blocks that are zero may stay off the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SparseMode {
    /// Jobs travel as sparse block streams (OmniReduce's) wherever the codec keeps zeros
    /// zero: each worker sends only its non-zero blocks. Every rank must agree.
    Auto,
    /// Every block is sent, in SwitchML's dense rounds: the default, since streaming a
    /// tensor without zero blocks costs more as sparse streams than as dense rounds.
    Off,
}

/// `[general]`: what every backend shares.
#[derive(Debug, Clone, PartialEq)]
pub struct General {
    pub rank: u16,
    pub num_workers: u16,
    pub num_worker_threads: u16,
    /// Packets in flight per worker, shared by its threads (the slots it uses).
    pub max_outstanding_packets: u16,
    pub packet_numel: u16,
    pub backend: BackendKind,
    /// How float32 travels: `native` (summed as floats by the switch) or
    /// `cpu_exponent_quantizer` (block floating point: int32 with a per-packet exponent).
    pub prepostprocessor: String,
    /// First retransmission timeout; doubles on each timeout of a slot.
    pub timeout: Duration,
    /// A job that makes no progress for this long fails.
    pub job_timeout: Duration,
    /// How long registration waits for every rank to join.
    pub connect_timeout: Duration,
    /// Where the switch's control plane listens (SwitchML's controller).
    pub controller_ip: String,
    pub controller_port: u16,
    /// Session name: the ranks of one job share it; other jobs use other names.
    pub session: String,
    /// Rounds each slot retains at the switch (2: SwitchML's shadow copy).
    pub depth: u8,
    /// Whether zero blocks stay off the wire.
    pub sparse: SparseMode,
}

/// `[backend.dummy]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Dummy {
    /// Emulated link bandwidth in Mbit/s; 0 sends as fast as the CPU allows.
    pub bandwidth: f64,
    /// Sum as the switch would; false returns each packet unchanged.
    pub process_packets: bool,
}

/// `[backend.udp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Udp {
    /// Local address the worker threads' sockets bind to.
    pub bind_ip: IpAddr,
    /// Socket send and receive buffer size, bytes (0: the system default).
    pub socket_buffer: usize,
}

/// `[faults]` and `[switch.faults]`: faults injected into one process's datagrams, for
/// testing recovery; all zero (the default) injects nothing.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Faults {
    /// What happens to the datagrams this process sends (a worker's to the switch, the
    /// switch's results to the workers).
    pub send: FaultRates,
    /// What happens to the datagrams it receives, before it reads them.
    pub receive: FaultRates,
    /// Seed of the random choices; a worker thread or direction mixes in its own index.
    pub seed: u64,
}

impl Faults {
    /// Whether any fault is configured in either direction.
    pub fn is_active(&self) -> bool {
        self.send.is_active() || self.receive.is_active()
    }

    /// Applies `KEY=VALUE,KEY=VALUE` (the keys of a `[faults]` section), as given to the
    /// flag `flag`; errors name the flag, the key and what is allowed.
    pub fn apply_assignments(&mut self, flag: &str, text: &str) -> Result<(), ConfigError> {
        let origin = Origin::Flag(flag.to_string());
        for assignment in text.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let Some((key, value)) = assignment.split_once('=') else {
                return Err(ConfigError::Value {
                    origin,
                    key: assignment.to_string(),
                    value: String::new(),
                    expected: "KEY=VALUE".into(),
                });
            };
            set_fault_key(self, &origin, key.trim(), key.trim(), value)?;
        }
        Ok(())
    }
}

/// `[switch]`: the `netagg-switch` process; its flags override these.
#[derive(Debug, Clone, PartialEq)]
pub struct Switch {
    /// TCP address workers register at.
    pub control: SocketAddr,
    /// UDP address of the data path.
    pub data: SocketAddr,
    /// Control connections at once (each holds a descriptor and a thread).
    pub max_connections: usize,
    /// Sessions open or assembling at once.
    pub max_sessions: u16,
    pub max_workers: u16,
    pub max_slots: u16,
    /// Bytes of aggregation state all sessions together may hold.
    pub max_memory: usize,
    /// Bytes of aggregation state one session may hold.
    pub max_session_memory: usize,
    /// A session that receives no packet for this long is closed even though its workers
    /// are connected; zero never closes it so (a worker whose connection closes ends its
    /// session at once either way).
    pub idle_timeout: Duration,
    /// How long a control connection may take to register, and its session to
    /// assemble after that.
    pub register_timeout: Duration,
    /// Print counters this often; zero prints them only on exit.
    pub stats_interval: Duration,
    /// error, warn, info, debug or trace.
    pub log_level: String,
    /// Faults injected into the data path (`[switch.faults]`).
    pub faults: Faults,
}

/// A whole configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub general: General,
    pub dummy: Dummy,
    pub udp: Udp,
    /// Faults injected into this worker's transport (`[faults]`).
    pub faults: Faults,
    pub switch: Switch,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            general: General {
                rank: 0,
                num_workers: 1,
                num_worker_threads: 2,
                max_outstanding_packets: 256,
                packet_numel: 256,
                backend: BackendKind::Udp,
                prepostprocessor: "native".into(),
                timeout: Duration::from_millis(10),
                job_timeout: Duration::from_secs(10),
                connect_timeout: Duration::from_secs(30),
                controller_ip: "127.0.0.1".into(),
                controller_port: 50099,
                session: "default".into(),
                depth: 8,
                sparse: SparseMode::Off,
            },
            dummy: Dummy { bandwidth: 100_000.0, process_packets: true },
            udp: Udp { bind_ip: IpAddr::from([0, 0, 0, 0]), socket_buffer: 4 << 20 },
            faults: Faults::default(),
            switch: Switch {
                control: SocketAddr::from(([0, 0, 0, 0], 50099)),
                data: SocketAddr::from(([0, 0, 0, 0], 48864)),
                max_connections: 1024,
                max_sessions: 64,
                max_workers: 1024,
                max_slots: 8192,
                max_memory: 1 << 30,
                max_session_memory: 256 << 20,
                idle_timeout: Duration::ZERO,
                register_timeout: Duration::from_secs(60),
                stats_interval: Duration::ZERO,
                log_level: "info".into(),
                faults: Faults::default(),
            },
        }
    }
}

/// Where a value came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    File(PathBuf),
    Environment(String),
    /// [`Config::set`], called by a program (or the C API's `netagg_config_set`).
    Program,
    /// A command-line flag.
    Flag(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File(path) => write!(f, "{}", path.display()),
            Origin::Environment(variable) => write!(f, "environment variable {variable}"),
            Origin::Program => write!(f, "configuration"),
            Origin::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

/// Why a configuration could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("{origin}: unknown key '{key}'; known keys: {known}")]
    UnknownKey { origin: Origin, key: String, known: String },
    #[error("{origin}: key '{key}' = '{value}': expected {expected}")]
    Value { origin: Origin, key: String, value: String, expected: String },
    #[error("{origin}: {message}")]
    Combination { origin: String, message: String },
}

type Getter = fn(&Config) -> String;
type Setter = fn(&mut Config, &str) -> Result<(), String>;

/// Every key: its name, what it accepts, how it is read and how it is set.
const KEYS: &[(&str, &str, Getter, Setter)] = &[
    (
        "general.rank",
        "an integer from 0 to 65534",
        |c| c.general.rank.to_string(),
        |c, v| set_int(&mut c.general.rank, v, 0, 65534),
    ),
    (
        "general.num_workers",
        "an integer from 1 to 65535",
        |c| c.general.num_workers.to_string(),
        |c, v| set_int(&mut c.general.num_workers, v, 1, 65535),
    ),
    (
        "general.num_worker_threads",
        "an integer from 1 to 1024",
        |c| c.general.num_worker_threads.to_string(),
        |c, v| set_int(&mut c.general.num_worker_threads, v, 1, 1024),
    ),
    (
        "general.max_outstanding_packets",
        "an integer from 1 to 65535",
        |c| c.general.max_outstanding_packets.to_string(),
        |c, v| set_int(&mut c.general.max_outstanding_packets, v, 1, 65535),
    ),
    (
        "general.packet_numel",
        "an integer from 1 to 16364",
        |c| c.general.packet_numel.to_string(),
        |c, v| set_int(&mut c.general.packet_numel, v, 1, MAX_PACKET_NUMEL.into()),
    ),
    (
        "general.backend",
        "'udp' or 'dummy'",
        |c| c.general.backend.to_string(),
        |c, v| {
            c.general.backend = match v {
                "udp" => BackendKind::Udp,
                "dummy" => BackendKind::Dummy,
                _ => return Err(String::new()),
            };
            Ok(())
        },
    ),
    (
        "general.prepostprocessor",
        "'native' or 'cpu_exponent_quantizer'",
        |c| c.general.prepostprocessor.clone(),
        |c, v| {
            if v != "native" && v != "cpu_exponent_quantizer" {
                return Err(String::new());
            }
            c.general.prepostprocessor = v.into();
            Ok(())
        },
    ),
    (
        "general.timeout",
        "milliseconds, above 0 and at most 30 days",
        |c| format_duration(c.general.timeout, 1e-3),
        |c, v| set_duration(&mut c.general.timeout, v, 1e-3),
    ),
    (
        "general.job_timeout",
        "seconds, above 0 and at most 30 days",
        |c| format_duration(c.general.job_timeout, 1.0),
        |c, v| set_duration(&mut c.general.job_timeout, v, 1.0),
    ),
    (
        "general.connect_timeout",
        "seconds, above 0 and at most 30 days",
        |c| format_duration(c.general.connect_timeout, 1.0),
        |c, v| set_duration(&mut c.general.connect_timeout, v, 1.0),
    ),
    (
        "general.controller_ip",
        "a host name or IP address",
        |c| c.general.controller_ip.clone(),
        |c, v| {
            if v.is_empty() {
                return Err(String::new());
            }
            c.general.controller_ip = v.into();
            Ok(())
        },
    ),
    (
        "general.controller_port",
        "a port from 1 to 65535",
        |c| c.general.controller_port.to_string(),
        |c, v| set_int(&mut c.general.controller_port, v, 1, 65535),
    ),
    (
        "general.session",
        "a name of 1 to 64 bytes",
        |c| c.general.session.clone(),
        |c, v| {
            if v.is_empty() || v.len() > MAX_SESSION_NAME_LEN {
                return Err(String::new());
            }
            c.general.session = v.into();
            Ok(())
        },
    ),
    (
        "general.depth",
        "a power of two from 2 to 64",
        |c| c.general.depth.to_string(),
        |c, v| {
            let depth: u8 = v.parse().map_err(|_| String::new())?;
            if !(2..=64).contains(&depth) || !depth.is_power_of_two() {
                return Err(String::new());
            }
            c.general.depth = depth;
            Ok(())
        },
    ),
    (
        "general.sparse",
        "'auto' or 'off'",
        |c| if c.general.sparse == SparseMode::Auto { "auto" } else { "off" }.into(),
        |c, v| {
            c.general.sparse = match v {
                "auto" => SparseMode::Auto,
                "off" => SparseMode::Off,
                _ => return Err(String::new()),
            };
            Ok(())
        },
    ),
    (
        "backend.dummy.bandwidth",
        "Mbit/s: 0, or from 0.001 to 1e9",
        |c| c.dummy.bandwidth.to_string(),
        |c, v| {
            let bandwidth: f64 = v.parse().map_err(|_| String::new())?;
            if !(bandwidth == 0.0 || (1e-3..=1e9).contains(&bandwidth)) {
                return Err(String::new());
            }
            c.dummy.bandwidth = bandwidth;
            Ok(())
        },
    ),
    (
        "backend.dummy.process_packets",
        "true or false",
        |c| c.dummy.process_packets.to_string(),
        |c, v| set_bool(&mut c.dummy.process_packets, v),
    ),
    (
        "backend.udp.bind_ip",
        "an IP address",
        |c| c.udp.bind_ip.to_string(),
        |c, v| {
            c.udp.bind_ip = v.parse().map_err(|_| String::new())?;
            Ok(())
        },
    ),
    (
        "backend.udp.socket_buffer",
        "bytes, an integer from 0 to 1073741824",
        |c| c.udp.socket_buffer.to_string(),
        |c, v| set_int(&mut c.udp.socket_buffer, v, 0, 1 << 30),
    ),
    (
        "switch.control",
        "an address IP:PORT",
        |c| c.switch.control.to_string(),
        |c, v| {
            c.switch.control = v.parse().map_err(|_| String::new())?;
            Ok(())
        },
    ),
    (
        "switch.data",
        "an address IP:PORT",
        |c| c.switch.data.to_string(),
        |c, v| {
            c.switch.data = v.parse().map_err(|_| String::new())?;
            Ok(())
        },
    ),
    (
        "switch.max_connections",
        "an integer from 1 to 1048576",
        |c| c.switch.max_connections.to_string(),
        |c, v| set_int(&mut c.switch.max_connections, v, 1, 1 << 20),
    ),
    (
        "switch.max_sessions",
        "an integer from 1 to 65535",
        |c| c.switch.max_sessions.to_string(),
        |c, v| set_int(&mut c.switch.max_sessions, v, 1, 65535),
    ),
    (
        "switch.max_workers",
        "an integer from 1 to 65535",
        |c| c.switch.max_workers.to_string(),
        |c, v| set_int(&mut c.switch.max_workers, v, 1, 65535),
    ),
    (
        "switch.max_slots",
        "an integer from 1 to 65535",
        |c| c.switch.max_slots.to_string(),
        |c, v| set_int(&mut c.switch.max_slots, v, 1, 65535),
    ),
    (
        "switch.max_memory",
        "bytes, an integer of at least 1",
        |c| c.switch.max_memory.to_string(),
        |c, v| set_int(&mut c.switch.max_memory, v, 1, u64::MAX),
    ),
    (
        "switch.max_session_memory",
        "bytes, an integer of at least 1",
        |c| c.switch.max_session_memory.to_string(),
        |c, v| set_int(&mut c.switch.max_session_memory, v, 1, u64::MAX),
    ),
    (
        "switch.idle_timeout",
        "seconds, at most 30 days; 0 never closes a session whose workers are connected",
        |c| format_duration(c.switch.idle_timeout, 1.0),
        |c, v| {
            if v.trim() == "0" {
                c.switch.idle_timeout = Duration::ZERO;
                return Ok(());
            }
            set_duration(&mut c.switch.idle_timeout, v, 1.0)
        },
    ),
    (
        "switch.register_timeout",
        "seconds, above 0 and at most 30 days",
        |c| format_duration(c.switch.register_timeout, 1.0),
        |c, v| set_duration(&mut c.switch.register_timeout, v, 1.0),
    ),
    (
        "switch.stats_interval",
        "seconds, at most 30 days; 0 prints only on exit",
        |c| format_duration(c.switch.stats_interval, 1.0),
        |c, v| {
            if v.trim() == "0" {
                c.switch.stats_interval = Duration::ZERO;
                return Ok(());
            }
            set_duration(&mut c.switch.stats_interval, v, 1.0)
        },
    ),
    (
        "switch.log_level",
        "error, warn, info, debug or trace",
        |c| c.switch.log_level.clone(),
        |c, v| {
            if !["error", "warn", "info", "debug", "trace"].contains(&v) {
                return Err(String::new());
            }
            c.switch.log_level = v.into();
            Ok(())
        },
    ),
];

type FaultGetter = fn(&Faults) -> String;
type FaultSetter = fn(&mut Faults, &str) -> Result<(), String>;

const PROBABILITY: &str = "a probability from 0 to 1";
const DELAY: &str = "milliseconds, from 0 to 10000";

/// The keys of a faults section (`[faults]`, `[switch.faults]`).
const FAULT_KEYS: &[(&str, &str, FaultGetter, FaultSetter)] = &[
    ("send_drop", PROBABILITY, |f| f.send.drop.to_string(), |f, v| set_probability(&mut f.send.drop, v)),
    (
        "send_duplicate",
        PROBABILITY,
        |f| f.send.duplicate.to_string(),
        |f, v| set_probability(&mut f.send.duplicate, v),
    ),
    (
        "send_reorder",
        PROBABILITY,
        |f| f.send.reorder.to_string(),
        |f, v| set_probability(&mut f.send.reorder, v),
    ),
    (
        "send_corrupt",
        PROBABILITY,
        |f| f.send.corrupt.to_string(),
        |f, v| set_probability(&mut f.send.corrupt, v),
    ),
    ("send_delay", DELAY, |f| format_duration(f.send.delay, 1e-3), |f, v| set_delay(&mut f.send.delay, v)),
    (
        "receive_drop",
        PROBABILITY,
        |f| f.receive.drop.to_string(),
        |f, v| set_probability(&mut f.receive.drop, v),
    ),
    (
        "receive_duplicate",
        PROBABILITY,
        |f| f.receive.duplicate.to_string(),
        |f, v| set_probability(&mut f.receive.duplicate, v),
    ),
    (
        "receive_reorder",
        PROBABILITY,
        |f| f.receive.reorder.to_string(),
        |f, v| set_probability(&mut f.receive.reorder, v),
    ),
    (
        "receive_corrupt",
        PROBABILITY,
        |f| f.receive.corrupt.to_string(),
        |f, v| set_probability(&mut f.receive.corrupt, v),
    ),
    (
        "receive_delay",
        DELAY,
        |f| format_duration(f.receive.delay, 1e-3),
        |f, v| set_delay(&mut f.receive.delay, v),
    ),
    (
        "seed",
        "an integer from 0 to 18446744073709551615",
        |f| f.seed.to_string(),
        |f, v| set_int(&mut f.seed, v, 0, u64::MAX),
    ),
];

/// The sections that hold fault keys, and the faults each reads and sets.
type FaultSection = (&'static str, fn(&Config) -> &Faults, fn(&mut Config) -> &mut Faults);

const FAULT_SECTIONS: &[FaultSection] = &[
    ("faults", |c| &c.faults, |c| &mut c.faults),
    ("switch.faults", |c| &c.switch.faults, |c| &mut c.switch.faults),
];

/// The faults section `key` belongs to, and the key within it.
fn fault_section(key: &str) -> Option<(&'static FaultSection, &str)> {
    FAULT_SECTIONS.iter().find_map(|section| Some((section, key.strip_prefix(section.0)?.strip_prefix('.')?)))
}

/// Sets `key` (without its section) of a faults section; `name` is the key as written.
fn set_fault_key(
    faults: &mut Faults,
    origin: &Origin,
    name: &str,
    key: &str,
    value: &str,
) -> Result<(), ConfigError> {
    let Some((_, expected, _, setter)) = FAULT_KEYS.iter().find(|(k, ..)| *k == key) else {
        return Err(ConfigError::UnknownKey {
            origin: origin.clone(),
            key: name.to_string(),
            known: FAULT_KEYS.iter().map(|(k, ..)| *k).collect::<Vec<_>>().join(", "),
        });
    };
    setter(faults, value.trim()).map_err(|_| ConfigError::Value {
        origin: origin.clone(),
        key: name.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    })
}

fn set_probability(field: &mut f64, value: &str) -> Result<(), String> {
    let parsed: f64 = value.parse().map_err(|_| String::new())?;
    if !(0.0..=1.0).contains(&parsed) {
        return Err(String::new());
    }
    *field = parsed;
    Ok(())
}

fn set_delay(field: &mut Duration, value: &str) -> Result<(), String> {
    let millis: f64 = value.parse().map_err(|_| String::new())?;
    if !(0.0..=MAX_FAULT_DELAY.as_secs_f64() * 1e3).contains(&millis) {
        return Err(String::new());
    }
    *field = Duration::from_secs_f64(millis / 1e3);
    Ok(())
}

fn set_int<T: TryFrom<u64>>(field: &mut T, value: &str, min: u64, max: u64) -> Result<(), String> {
    let parsed: u64 = value.parse().map_err(|_| String::new())?;
    if parsed < min || parsed > max {
        return Err(String::new());
    }
    *field = T::try_from(parsed).map_err(|_| String::new())?;
    Ok(())
}

/// The longest duration any key accepts: 30 days.
const MAX_SECONDS: f64 = 30.0 * 24.0 * 3600.0;

fn set_duration(field: &mut Duration, value: &str, unit_seconds: f64) -> Result<(), String> {
    let parsed: f64 = value.parse().map_err(|_| String::new())?;
    if parsed.is_nan() || parsed <= 0.0 || parsed * unit_seconds > MAX_SECONDS {
        return Err(String::new());
    }
    *field = Duration::try_from_secs_f64(parsed * unit_seconds).map_err(|_| String::new())?;
    Ok(())
}

/// A duration in `unit_seconds`, as the matching setter reads it back.
fn format_duration(duration: Duration, unit_seconds: f64) -> String {
    (duration.as_nanos() as f64 / (unit_seconds * 1e9)).to_string()
}

fn set_bool(field: &mut bool, value: &str) -> Result<(), String> {
    *field = match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => true,
        "false" | "0" | "no" | "off" => false,
        _ => return Err(String::new()),
    };
    Ok(())
}

/// Launcher variables for rank and world size, in the order they are tried.
const LAUNCHER_VARIABLES: &[(&str, &str)] = &[
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("RANK", "WORLD_SIZE"),
];

impl Config {
    /// Loads the configuration from the file named, or the first one found, then the
    /// environment of this process.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let vars: Vec<(String, String)> = std::env::vars().collect();
        Config::load_with_environment(path, &vars)
    }

    /// [`Config::load`] with an explicit environment, for callers and tests that must not
    /// read the process's own.
    pub fn load_with_environment(
        path: Option<&Path>,
        vars: &[(String, String)],
    ) -> Result<Config, ConfigError> {
        let lookup = |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let mut config = Config::default();
        let file = match path {
            Some(path) => Some(path.to_path_buf()),
            None => lookup("NETAGG_CONFIG").map(PathBuf::from).or_else(find_config_file),
        };
        if let Some(file) = &file {
            config.apply_file(file)?;
        }
        for (rank_variable, size_variable) in LAUNCHER_VARIABLES {
            if let (Some(rank), Some(size)) = (lookup(rank_variable), lookup(size_variable)) {
                config.set_from(&Origin::Environment(rank_variable.to_string()), "general.rank", &rank)?;
                config.set_from(
                    &Origin::Environment(size_variable.to_string()),
                    "general.num_workers",
                    &size,
                )?;
                break;
            }
        }
        for (name, value) in vars {
            let Some(rest) = name.strip_prefix("NETAGG_") else { continue };
            if name == "NETAGG_CONFIG" {
                continue;
            }
            let Some((section, key)) = rest.split_once("__") else {
                return Err(ConfigError::UnknownKey {
                    origin: Origin::Environment(name.clone()),
                    key: rest.to_ascii_lowercase(),
                    known: "NETAGG_<SECTION>__<KEY>, e.g. NETAGG_GENERAL__RANK, NETAGG_BACKEND_UDP__BIND_IP"
                        .into(),
                });
            };
            let key =
                format!("{}.{}", section.to_ascii_lowercase().replace('_', "."), key.to_ascii_lowercase());
            config.set_from(&Origin::Environment(name.clone()), &key, value)?;
        }
        let origin = file.map(|f| f.display().to_string()).unwrap_or_else(|| "configuration".into());
        config.validate().map_err(|message| ConfigError::Combination { origin, message })?;
        Ok(config)
    }

    /// Parses config-file text in SwitchML's INI format, without looking at the
    /// environment; `origin` names it in errors.
    pub fn from_ini(text: &str, origin: &Path) -> Result<Config, ConfigError> {
        let mut config = Config::default();
        config.apply_ini(text, origin)?;
        config
            .validate()
            .map_err(|message| ConfigError::Combination { origin: origin.display().to_string(), message })?;
        Ok(config)
    }

    fn apply_file(&mut self, path: &Path) -> Result<(), ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::File { path: path.to_path_buf(), reason: e.to_string() })?;
        self.apply_ini(&text, path)
    }

    fn apply_ini(&mut self, text: &str, path: &Path) -> Result<(), ConfigError> {
        let parsed = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Ini))
            .build()
            .and_then(|c| c.try_deserialize::<BTreeMap<String, config::Value>>())
            .map_err(|e| ConfigError::File { path: path.to_path_buf(), reason: e.to_string() })?;
        let mut values = Vec::new();
        flatten("", parsed, &mut values);
        let origin = Origin::File(path.to_path_buf());
        for (key, value) in values {
            self.set_from(&origin, &key, &value)?;
        }
        Ok(())
    }

    /// Sets one key (`general.num_workers`, `backend.dummy.bandwidth`) from its text, as a
    /// config file would; the error names the key and what it accepts. Combinations are
    /// checked by [`Config::validate`].
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        self.set_from(&Origin::Program, key, value)
    }

    /// One key's value as text that [`Config::set`] accepts back; None for unknown keys.
    pub fn get(&self, key: &str) -> Option<String> {
        if let Some(((_, faults, _), name)) = fault_section(key) {
            let (_, _, get, _) = FAULT_KEYS.iter().find(|(k, ..)| *k == name)?;
            return Some(get(faults(self)));
        }
        let (_, _, get, _) = KEYS.iter().find(|(name, ..)| *name == key)?;
        Some(get(self))
    }

    fn set_from(&mut self, origin: &Origin, key: &str, value: &str) -> Result<(), ConfigError> {
        if let Some(((_, _, faults), name)) = fault_section(key) {
            return set_fault_key(faults(self), origin, key, name, value);
        }
        let Some((_, expected, _, setter)) = KEYS.iter().find(|(name, ..)| *name == key) else {
            return Err(ConfigError::UnknownKey {
                origin: origin.clone(),
                key: key.to_string(),
                known: Config::keys().map(|(name, _)| name).collect::<Vec<_>>().join(", "),
            });
        };
        setter(self, value.trim()).map_err(|_| ConfigError::Value {
            origin: origin.clone(),
            key: key.to_string(),
            value: value.to_string(),
            expected: expected.to_string(),
        })
    }

    /// Checks what no single key can: combinations.
    pub fn validate(&self) -> Result<(), String> {
        let g = &self.general;
        if g.rank >= g.num_workers {
            return Err(format!(
                "general.rank {} must be below general.num_workers {}",
                g.rank, g.num_workers
            ));
        }
        if g.max_outstanding_packets < g.num_worker_threads {
            return Err(format!(
                "general.max_outstanding_packets {} must be at least general.num_worker_threads {}: every thread needs a slot",
                g.max_outstanding_packets, g.num_worker_threads
            ));
        }
        Ok(())
    }

    /// Slots of each worker thread: the window divided evenly (the remainder is unused).
    pub fn slots_per_thread(&self) -> u16 {
        self.general.max_outstanding_packets / self.general.num_worker_threads
    }

    /// Every key with its accepted values, as documented in `configs/netagg.cfg`.
    pub fn keys() -> impl Iterator<Item = (String, &'static str)> {
        let plain = KEYS.iter().map(|(name, expected, ..)| (name.to_string(), *expected));
        let faults = FAULT_SECTIONS.iter().flat_map(|(section, ..)| {
            FAULT_KEYS.iter().map(move |(name, expected, ..)| (format!("{section}.{name}"), *expected))
        });
        plain.chain(faults)
    }
}

fn flatten(prefix: &str, table: BTreeMap<String, config::Value>, out: &mut Vec<(String, String)>) {
    for (name, value) in table {
        let key = if prefix.is_empty() { name } else { format!("{prefix}.{name}") };
        match value.clone().into_table() {
            Ok(inner) => flatten(&key, inner.into_iter().collect(), out),
            Err(_) => out.push((key, value.to_string())),
        }
    }
}

fn find_config_file() -> Option<PathBuf> {
    let mut candidates = vec![PathBuf::from("netagg.cfg")];
    if let Ok(host) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        candidates.push(PathBuf::from(format!("netagg-{}.cfg", host.trim())));
    }
    candidates.push(PathBuf::from("/etc/netagg.cfg"));
    candidates.into_iter().find(|path| path.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ini(text: &str) -> Result<Config, ConfigError> {
        Config::from_ini(text, Path::new("test.cfg"))
    }

    #[test]
    fn switchml_sections_and_keys_are_read() {
        let config = ini(
            "[general]\nrank = 1\nnum_workers = 4\nnum_worker_threads = 4\nmax_outstanding_packets = 128\n\
             packet_numel = 64\nbackend = dummy\ntimeout = 2.5\nsparse = auto\n[backend.dummy]\nbandwidth = 1000\nprocess_packets = false\n",
        )
        .unwrap();
        assert_eq!(
            (config.general.rank, config.general.num_workers, config.general.num_worker_threads),
            (1, 4, 4)
        );
        assert_eq!((config.general.packet_numel, config.slots_per_thread()), (64, 32));
        assert_eq!(config.general.backend, BackendKind::Dummy);
        assert_eq!(config.general.sparse, SparseMode::Auto);
        assert_eq!(config.general.timeout, Duration::from_micros(2500));
        assert_eq!((config.dummy.bandwidth, config.dummy.process_packets), (1000.0, false));
    }

    #[test]
    fn the_example_file_documents_every_key_with_its_default() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/netagg.cfg");
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(Config::from_ini(&text, &path).unwrap(), Config::default());
        for (key, _) in Config::keys() {
            let name = key.rsplit('.').next().unwrap();
            assert!(text.contains(&format!("\n{name} = ")), "configs/netagg.cfg lacks {key}");
        }
    }

    #[test]
    fn the_large_packets_file_loads_and_changes_only_the_packets() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/large-packets.cfg");
        let config = Config::from_ini(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
        let mut expected = Config::default();
        (expected.general.packet_numel, expected.general.max_outstanding_packets) = (4096, 16);
        assert_eq!(config, expected);
    }

    #[test]
    fn every_key_reads_back_what_set_accepts() {
        let mut config = ini(
            "[general]\nnum_workers = 3\ntimeout = 2.5\njob_timeout = 0.25\n[switch]\nidle_timeout = 90\n",
        )
        .unwrap();
        config.set("backend.dummy.bandwidth", "1234.5").unwrap();
        config.set("faults.send_delay", "1.5").unwrap();
        config.set("switch.faults.receive_drop", "0.01").unwrap();
        for (key, _) in Config::keys() {
            let key = key.as_str();
            let value = config.get(key).unwrap_or_else(|| panic!("no getter for {key}"));
            let mut copy = config.clone();
            copy.set(key, &value).unwrap_or_else(|e| panic!("{key} = {value}: {e}"));
            assert_eq!(copy, config, "{key} = {value}");
        }
        assert_eq!(config.get("general.timeout").as_deref(), Some("2.5"));
        assert_eq!(config.get("general.nothing"), None);
        let error = config.set("general.num_workers", "many").unwrap_err();
        assert_eq!(
            error.to_string(),
            "configuration: key 'general.num_workers' = 'many': expected an integer from 1 to 65535"
        );
    }

    #[test]
    fn packet_and_session_limits_are_the_protocols() {
        assert_eq!(usize::from(MAX_PACKET_NUMEL), netagg_wire::packet::MAX_ELEMENTS);
        assert_eq!(MAX_SESSION_NAME_LEN, netagg_wire::control::MAX_SESSION_NAME_LEN);
        let mut config = Config::default();
        config.set("general.packet_numel", &MAX_PACKET_NUMEL.to_string()).unwrap();
        let error = config.set("general.packet_numel", &(MAX_PACKET_NUMEL + 1).to_string()).unwrap_err();
        assert!(error.to_string().ends_with(&format!("from 1 to {MAX_PACKET_NUMEL}")), "{error}");
        config.set("general.session", &"s".repeat(MAX_SESSION_NAME_LEN)).unwrap();
        let error = config.set("general.session", &"s".repeat(MAX_SESSION_NAME_LEN + 1)).unwrap_err();
        assert!(error.to_string().ends_with(&format!("of 1 to {MAX_SESSION_NAME_LEN} bytes")), "{error}");
    }

    #[test]
    fn unknown_keys_name_the_file_and_the_known_keys() {
        let error = ini("[general]\nnum_wokers = 4\n").unwrap_err();
        let message = error.to_string();
        assert!(
            message.starts_with("test.cfg: unknown key 'general.num_wokers'; known keys: general.rank, "),
            "{message}"
        );
        let error = ini("[backend.rdma]\nmsg_numel = 1024\n").unwrap_err();
        assert!(matches!(error, ConfigError::UnknownKey { key, .. } if key == "backend.rdma.msg_numel"));
    }

    #[test]
    fn bad_values_say_what_is_allowed() {
        let cases = [
            (
                "[general]\nnum_workers = 0\n",
                "key 'general.num_workers' = '0': expected an integer from 1 to 65535",
            ),
            ("[general]\nbackend = dpdk\n", "key 'general.backend' = 'dpdk': expected 'udp' or 'dummy'"),
            ("[general]\nsparse = yes\n", "key 'general.sparse' = 'yes': expected 'auto' or 'off'"),
            ("[general]\npacket_numel = 20000\n", "expected an integer from 1 to 16364"),
            ("[general]\ndepth = 6\n", "expected a power of two from 2 to 64"),
            ("[general]\ntimeout = -1\n", "expected milliseconds, above 0 and at most 30 days"),
            ("[general]\njob_timeout = 1e19\n", "expected seconds, above 0 and at most 30 days"),
            ("[backend.dummy]\nbandwidth = 1e-30\n", "expected Mbit/s: 0, or from 0.001 to 1e9"),
            ("[general]\nprepostprocessor = bypass\n", "expected 'native' or 'cpu_exponent_quantizer'"),
            ("[backend.dummy]\nprocess_packets = maybe\n", "expected true or false"),
            ("[backend.udp]\nbind_ip = 300.1.1.1\n", "expected an IP address"),
            ("[switch]\nmax_session_memory = 0\n", "key 'switch.max_session_memory' = '0': expected bytes, an integer of at least 1"),
            ("[switch]\nmax_memory = lots\n", "key 'switch.max_memory' = 'lots': expected bytes"),
            ("[switch]\nmax_sessions = 0\n", "key 'switch.max_sessions' = '0': expected an integer from 1 to 65535"),
            ("[switch]\nmax_workers = 70000\n", "key 'switch.max_workers' = '70000': expected an integer from 1 to 65535"),
            ("[switch]\nmax_slots = -1\n", "key 'switch.max_slots' = '-1': expected an integer from 1 to 65535"),
            ("[switch]\ndata = 1.2.3.4\n", "key 'switch.data' = '1.2.3.4': expected an address IP:PORT"),
            ("[switch]\nidle_timeout = -5\n", "key 'switch.idle_timeout' = '-5': expected seconds, at most 30 days"),
            ("[switch]\nstats_interval = soon\n", "key 'switch.stats_interval' = 'soon': expected seconds"),
            ("[switch]\nlog_level = loud\n", "key 'switch.log_level' = 'loud': expected error, warn, info, debug or trace"),
            ("[general]\nrank = 65535\n", "key 'general.rank' = '65535': expected an integer from 0 to 65534"),
            ("[general]\nnum_worker_threads = 0\n", "key 'general.num_worker_threads' = '0': expected an integer from 1 to 1024"),
            ("[general]\nmax_outstanding_packets = 0\n", "key 'general.max_outstanding_packets' = '0': expected an integer"),
            ("[general]\nconnect_timeout = 0\n", "key 'general.connect_timeout' = '0': expected seconds, above 0"),
            ("[general]\ncontroller_port = 0\n", "key 'general.controller_port' = '0': expected a port from 1 to 65535"),
            ("[general]\ncontroller_ip = \"\"\n", "key 'general.controller_ip' = '': expected a host name or IP address"),
            ("[general]\nsession = \"\"\n", "key 'general.session' = '': expected a name of 1 to 64 bytes"),
            ("[backend.udp]\nsocket_buffer = 2000000000\n", "key 'backend.udp.socket_buffer' = '2000000000': expected bytes, an integer from 0 to 1073741824"),
        ];
        for (text, expected) in cases {
            let message = ini(text).unwrap_err().to_string();
            assert!(message.starts_with("test.cfg: key"), "{message}");
            assert!(message.contains(expected), "{message} lacks {expected}");
        }
    }

    #[test]
    fn fault_sections_set_each_direction_and_reject_what_is_not_allowed() {
        let config = ini("[faults]\nsend_drop = 0.01\nreceive_duplicate = 0.5\nsend_delay = 2.5\nseed = 9\n\
             [switch.faults]\nreceive_drop = 0.05\nsend_reorder = 1\nsend_corrupt = 0.001\n")
        .unwrap();
        assert_eq!(config.faults.send.drop, 0.01);
        assert_eq!(config.faults.receive.duplicate, 0.5);
        assert_eq!(config.faults.send.delay, Duration::from_micros(2500));
        assert_eq!(config.faults.seed, 9);
        assert_eq!(config.switch.faults.receive.drop, 0.05);
        assert_eq!(config.switch.faults.send.reorder, 1.0);
        assert_eq!(config.switch.faults.send.corrupt, 0.001);
        assert!(!config.switch.faults.receive.is_active() || config.switch.faults.receive.drop > 0.0);
        assert!(!Config::default().faults.is_active());

        let bad = [
            (
                "[faults]\nsend_drop = 1.5\n",
                "key 'faults.send_drop' = '1.5': expected a probability from 0 to 1",
            ),
            (
                "[faults]\nreceive_reorder = -0.1\n",
                "key 'faults.receive_reorder' = '-0.1': expected a probability",
            ),
            (
                "[faults]\nsend_duplicate = often\n",
                "key 'faults.send_duplicate' = 'often': expected a probability",
            ),
            (
                "[faults]\nreceive_corrupt = NaN\n",
                "key 'faults.receive_corrupt' = 'NaN': expected a probability",
            ),
            (
                "[faults]\nsend_delay = 10001\n",
                "key 'faults.send_delay' = '10001': expected milliseconds, from 0 to 10000",
            ),
            ("[faults]\nreceive_delay = -1\n", "key 'faults.receive_delay' = '-1': expected milliseconds"),
            (
                "[faults]\nseed = -3\n",
                "key 'faults.seed' = '-3': expected an integer from 0 to 18446744073709551615",
            ),
            (
                "[switch.faults]\nsend_drop = 2\n",
                "key 'switch.faults.send_drop' = '2': expected a probability",
            ),
            (
                "[switch.faults]\nreceive_delay = x\n",
                "key 'switch.faults.receive_delay' = 'x': expected milliseconds",
            ),
        ];
        for (text, expected) in bad {
            let message = ini(text).unwrap_err().to_string();
            assert!(message.starts_with("test.cfg: "), "{message}");
            assert!(message.contains(expected), "{message} lacks {expected}");
        }
        let message = ini("[faults]\ndrop = 0.1\n").unwrap_err().to_string();
        assert_eq!(
            message,
            "test.cfg: unknown key 'faults.drop'; known keys: send_drop, send_duplicate, send_reorder, \
             send_corrupt, send_delay, receive_drop, receive_duplicate, receive_reorder, receive_corrupt, \
             receive_delay, seed"
        );
        let error = Config::load_with_environment(
            None,
            &[("NETAGG_SWITCH_FAULTS__RECEIVE_DROP".to_string(), "5%".to_string())],
        )
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "environment variable NETAGG_SWITCH_FAULTS__RECEIVE_DROP: key 'switch.faults.receive_drop' = '5%': expected a probability from 0 to 1"
        );

        let mut faults = Faults::default();
        faults.apply_assignments("--faults", "receive_drop=0.01, send_drop=0.02,seed=4").unwrap();
        assert_eq!((faults.receive.drop, faults.send.drop, faults.seed), (0.01, 0.02, 4));
        assert_eq!(
            faults.apply_assignments("--faults", "send_drop=3").unwrap_err().to_string(),
            "flag --faults: key 'send_drop' = '3': expected a probability from 0 to 1"
        );
        assert_eq!(
            faults.apply_assignments("--faults", "drop").unwrap_err().to_string(),
            "flag --faults: key 'drop' = '': expected KEY=VALUE"
        );
        assert!(faults
            .apply_assignments("--faults", "jitter=1")
            .unwrap_err()
            .to_string()
            .starts_with("flag --faults: unknown key 'jitter'; known keys: send_drop,"));
    }

    #[test]
    fn every_key_refuses_a_bad_value_naming_the_file_the_key_and_what_is_allowed() {
        for (key, expected) in Config::keys() {
            let (section, name) = key.rsplit_once('.').unwrap();
            // Names and host names take any text but an empty or over-long one.
            let bad = match expected {
                "a name of 1 to 64 bytes" => "n".repeat(65),
                "a host name or IP address" => "\"\"".to_string(),
                _ => "x?".to_string(),
            };
            let message = ini(&format!("[{section}]\n{name} = {bad}\n")).unwrap_err().to_string();
            let shown = bad.trim_matches('"');
            assert_eq!(message, format!("test.cfg: key '{key}' = '{shown}': expected {expected}"));
        }
    }

    #[test]
    fn impossible_combinations_are_rejected() {
        let message = ini("[general]\nrank = 4\nnum_workers = 4\n").unwrap_err().to_string();
        assert_eq!(message, "test.cfg: general.rank 4 must be below general.num_workers 4");
        let message =
            ini("[general]\nnum_worker_threads = 8\nmax_outstanding_packets = 4\n").unwrap_err().to_string();
        assert!(message.contains("every thread needs a slot"), "{message}");
    }

    #[test]
    fn environment_overrides_file_and_launcher_variables_set_rank() {
        let dir = std::env::temp_dir().join(format!("netagg-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("netagg.cfg");
        std::fs::write(&file, "[general]\nnum_workers = 2\npacket_numel = 64\n").unwrap();
        let vars = |pairs: &[(&str, &str)]| {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>()
        };

        let config = Config::load_with_environment(
            Some(&file),
            &vars(&[
                ("OMPI_COMM_WORLD_RANK", "2"),
                ("OMPI_COMM_WORLD_SIZE", "3"),
                ("NETAGG_GENERAL__PACKET_NUMEL", "1024"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (config.general.rank, config.general.num_workers, config.general.packet_numel),
            (2, 3, 1024)
        );

        let config = Config::load_with_environment(
            None,
            &vars(&[("NETAGG_CONFIG", file.to_str().unwrap()), ("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")]),
        )
        .unwrap();
        assert_eq!((config.general.rank, config.general.num_workers), (1, 2));

        let error =
            Config::load_with_environment(Some(&file), &vars(&[("NETAGG_BACKEND_UDP__BIND_IP", "nowhere")]))
                .unwrap_err();
        assert_eq!(
            error.to_string(),
            "environment variable NETAGG_BACKEND_UDP__BIND_IP: key 'backend.udp.bind_ip' = 'nowhere': expected an IP address"
        );
        let error = Config::load_with_environment(Some(&dir.join("missing.cfg")), &[]).unwrap_err();
        assert!(matches!(error, ConfigError::File { .. }), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
