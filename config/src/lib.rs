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
//!
//! Every key is declared once, in `keys.rs`: its section, default, what it accepts and
//! its comment. Parsing, checks, error messages, environment variable names and
//! `configs/netagg.cfg` (which a test keeps equal to the table) derive from there.
//!
//! Fault injection has the same keys in two sections: `[faults]` for a worker's
//! transport and `[switch.faults]` for the switch's data path (also `netagg-switch
//! --faults KEY=VALUE,...`).
//!
//! [`logging`] sets up the log output every netagg program shares.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use netagg_faults::FaultRates;

/// Largest `general.packet_numel`: the most elements a packet carries inside a 64 KiB
/// datagram, the protocol's `netagg_wire::packet::MAX_ELEMENTS` (a test checks they agree).
pub const MAX_PACKET_NUMEL: u16 = 16364;
/// Longest `general.session`, in bytes: the protocol's
/// `netagg_wire::control::MAX_SESSION_NAME_LEN` (a test checks they agree).
pub const MAX_SESSION_NAME_LEN: usize = 64;

mod keys;
mod kind;
pub mod logging;

pub use ipnet::IpNet;
mod table;

/// Which transport carries the packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// No network: an in-process switch sums as if every worker sent the same data.
    Dummy,
    /// UDP to a `netagg-switch`.
    Udp,
    /// UDP datagrams from a DPDK port to a `netagg-switch`, kernel bypassed.
    Dpdk,
    /// The same datagrams as RDMA SEND messages over reliable connections to a
    /// `netagg-switch` (`[backend.rdma]`).
    Rdma,
}

impl BackendKind {
    /// The backend `general.backend` names `name`.
    fn from_name(name: &str) -> Option<BackendKind> {
        match name {
            "dummy" => Some(BackendKind::Dummy),
            "udp" => Some(BackendKind::Udp),
            "dpdk" => Some(BackendKind::Dpdk),
            "rdma" => Some(BackendKind::Rdma),
            _ => None,
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Dummy => "dummy",
            BackendKind::Udp => "udp",
            BackendKind::Dpdk => "dpdk",
            BackendKind::Rdma => "rdma",
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

impl SparseMode {
    /// The mode `general.sparse` names `name`.
    fn from_name(name: &str) -> Option<SparseMode> {
        match name {
            "auto" => Some(SparseMode::Auto),
            "off" => Some(SparseMode::Off),
            _ => None,
        }
    }
}

impl fmt::Display for SparseMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SparseMode::Auto => "auto",
            SparseMode::Off => "off",
        })
    }
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
    /// Whether threads space their packets at the rate the path carries once a standing
    /// queue shows.
    pub pacing: bool,
    /// The standing queueing delay the pacer aims below.
    pub pacing_target: Duration,
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

/// `[backend.dpdk]` and `[switch.dpdk]`: a DPDK port and the UDP endpoint on it.
#[derive(Debug, Clone, PartialEq)]
pub struct Dpdk {
    /// EAL's arguments, split at white space; EAL starts once per process.
    pub eal_args: String,
    /// The device: a virtual device's arguments or a PCI address.
    pub device: String,
    /// The endpoint's IPv4 address; unspecified: the side's default (see the keys).
    pub ip: IpAddr,
    /// Where every frame goes, if set; else each peer's MAC, by ARP.
    pub peer_mac: Option<[u8; 6]>,
    pub rx_descriptors: u16,
    pub tx_descriptors: u16,
    /// Mbufs in the port's pool.
    pub pool_size: u32,
    /// Frames received or sent at a time.
    pub burst: u16,
    /// How an idle receive queue is watched.
    pub poll: PollMode,
}

impl Dpdk {
    /// EAL's arguments, one string each.
    pub fn eal_arguments(&self) -> Vec<String> {
        self.eal_args.split_whitespace().map(String::from).collect()
    }
}

/// How a DPDK endpoint waits for frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollMode {
    /// Polls the queue without pause: the lowest latency, a core per polling thread.
    Busy,
    /// Polls without pause while frames come, naps between polls once the queue has
    /// been idle a while: for cores shared with other work.
    Adaptive,
}

impl PollMode {
    fn from_name(name: &str) -> Option<PollMode> {
        match name {
            "busy" => Some(PollMode::Busy),
            "adaptive" => Some(PollMode::Adaptive),
            _ => None,
        }
    }
}

impl fmt::Display for PollMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PollMode::Busy => "busy",
            PollMode::Adaptive => "adaptive",
        })
    }
}

/// `[backend.rdma]` and `[switch.rdma]`: the RDMA device and the queue pairs on it.
#[derive(Debug, Clone, PartialEq)]
pub struct Rdma {
    /// The verbs device (rxe0, mlx5_0); empty: the one rdma_cm routes the peer through.
    pub device: String,
    /// The device's port, from 1.
    pub device_port: u8,
    /// With a named device, the GID whose address the endpoint takes.
    pub gid_index: u32,
    /// Messages each queue pair keeps posted for receiving, and sends in flight at most.
    pub queue_depth: u32,
    /// Bytes of each registered receive and send buffer; 0: what a packet needs.
    pub message_size: usize,
    /// How a queue pair's completions are waited for.
    pub poll: RdmaPoll,
}

/// How an RDMA endpoint waits for completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaPoll {
    /// Polls the completion queue without pause: the lowest latency, a core per polling
    /// thread.
    Busy,
    /// Sleeps on the completion channel until the device signals a completion: for cores
    /// shared with other work.
    Event,
}

impl RdmaPoll {
    fn from_name(name: &str) -> Option<RdmaPoll> {
        match name {
            "busy" => Some(RdmaPoll::Busy),
            "event" => Some(RdmaPoll::Event),
            _ => None,
        }
    }
}

impl fmt::Display for RdmaPoll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RdmaPoll::Busy => "busy",
            RdmaPoll::Event => "event",
        })
    }
}

/// Which transport the switch's data path runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwitchTransport {
    /// A kernel UDP socket at `switch.data`.
    Udp,
    /// A DPDK port (`[switch.dpdk]`), UDP at `switch.data`'s port.
    Dpdk,
    /// RDMA reliable connections accepted through rdma_cm at `switch.data`
    /// (`[switch.rdma]`).
    Rdma,
}

impl SwitchTransport {
    fn from_name(name: &str) -> Option<SwitchTransport> {
        match name {
            "udp" => Some(SwitchTransport::Udp),
            "dpdk" => Some(SwitchTransport::Dpdk),
            "rdma" => Some(SwitchTransport::Rdma),
            _ => None,
        }
    }
}

impl fmt::Display for SwitchTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SwitchTransport::Udp => "udp",
            SwitchTransport::Dpdk => "dpdk",
            SwitchTransport::Rdma => "rdma",
        })
    }
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
                return Err(ConfigError::refused(&origin, assignment, "", "KEY=VALUE".into()));
            };
            let key = key.trim();
            let Some(found) = table::find(keys::FAULT_KEYS, key) else {
                let known = table::names(keys::FAULT_KEYS.iter().map(|key| &key.about));
                return Err(ConfigError::UnknownKey { origin, key: key.to_string(), known });
            };
            found.set(self, value).map_err(|expected| ConfigError::refused(&origin, key, value, expected))?;
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
    /// What the data path runs on.
    pub transport: SwitchTransport,
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
    /// Networks where a worker's data endpoint may be although it registered from
    /// another address (a NIC of its own for DPDK or RDMA).
    pub data_networks: Vec<ipnet::IpNet>,
    /// Faults injected into the data path (`[switch.faults]`).
    pub faults: Faults,
    /// The DPDK port of `transport = dpdk` (`[switch.dpdk]`).
    pub dpdk: Dpdk,
    /// The RDMA device of `transport = rdma` (`[switch.rdma]`).
    pub rdma: Rdma,
}

/// A whole configuration.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Config {
    pub general: General,
    pub dummy: Dummy,
    pub udp: Udp,
    pub dpdk: Dpdk,
    pub rdma: Rdma,
    /// Faults injected into this worker's transport (`[faults]`).
    pub faults: Faults,
    pub switch: Switch,
    /// Where each key that is not at its default was set, for the errors about
    /// combinations.
    origins: Origins,
}

/// Where keys were set, by key. Two configurations with the same values are equal
/// wherever their values came from.
#[derive(Debug, Clone, Default)]
struct Origins(BTreeMap<String, Origin>);

impl PartialEq for Origins {
    fn eq(&self, _: &Origins) -> bool {
        true
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
    /// Values valid alone but not together; the message names where each came from.
    #[error("{message}")]
    Combination { message: String },
}

impl ConfigError {
    /// `value`, given for `key` in `origin`, is not what the key expects.
    fn refused(origin: &Origin, key: &str, value: &str, expected: String) -> ConfigError {
        ConfigError::Value {
            origin: origin.clone(),
            key: key.to_string(),
            value: value.to_string(),
            expected,
        }
    }
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
            let origin = Origin::Environment(name.clone());
            // A variable that is no key's is named in the error as the key it would be.
            let key = match table::key_of_variable(name) {
                Some(key) => key,
                None => match rest.split_once("__") {
                    Some((section, key)) => format!(
                        "{}.{}",
                        section.to_ascii_lowercase().replace('_', "."),
                        key.to_ascii_lowercase()
                    ),
                    None => return Err(ConfigError::UnknownKey {
                        origin,
                        key: rest.to_ascii_lowercase(),
                        known:
                            "NETAGG_<SECTION>__<KEY>, e.g. NETAGG_GENERAL__RANK, NETAGG_BACKEND_UDP__BIND_IP"
                                .into(),
                    }),
                },
            };
            config.set_from(&origin, &key, value)?;
        }
        config.validate().map_err(|message| ConfigError::Combination { message })?;
        Ok(config)
    }

    /// Parses config-file text in SwitchML's INI format, without looking at the
    /// environment; `origin` names it in errors.
    pub fn from_ini(text: &str, origin: &Path) -> Result<Config, ConfigError> {
        let mut config = Config::default();
        config.apply_ini(text, origin)?;
        config.validate().map_err(|message| ConfigError::Combination { message })?;
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
        let (section, name) = table::section_of(key)?;
        section.get(self, name)
    }

    /// Sets one key from its text as given in `origin` (a program's command-line flag,
    /// say), by the rules of the config file; errors name `origin`, the key and what it
    /// accepts, and errors about combinations name `origin` as where the value came from.
    pub fn set_from(&mut self, origin: &Origin, key: &str, value: &str) -> Result<(), ConfigError> {
        let unknown = |known| ConfigError::UnknownKey { origin: origin.clone(), key: key.to_string(), known };
        let every_key = || Config::keys().map(|(name, _)| name).collect::<Vec<_>>().join(", ");
        let Some((section, name)) = table::section_of(key) else { return Err(unknown(every_key())) };
        match section.set(self, name, value) {
            Some(Ok(())) => {
                self.origins.0.insert(key.to_string(), origin.clone());
                Ok(())
            }
            Some(Err(expected)) => Err(ConfigError::refused(origin, key, value, expected)),
            None if section.lists_own_keys() => Err(unknown(table::names(section.keys()))),
            None => Err(unknown(every_key())),
        }
    }

    /// Checks what no single key can: combinations. The message names every value it
    /// speaks of, and where each came from.
    pub fn validate(&self) -> Result<(), String> {
        let g = &self.general;
        if g.rank >= g.num_workers {
            return Err(format!(
                "{} must be below {}",
                self.described("general.rank"),
                self.described("general.num_workers")
            ));
        }
        if g.max_outstanding_packets < g.num_worker_threads {
            return Err(format!(
                "{} must be at least {}: every thread needs a slot",
                self.described("general.max_outstanding_packets"),
                self.described("general.num_worker_threads")
            ));
        }
        Ok(())
    }

    /// `key value (from where)`, for messages about combinations.
    fn described(&self, key: &str) -> String {
        let value = self.get(key).unwrap_or_default();
        match self.origins.0.get(key) {
            None => format!("{key} {value} (the default)"),
            Some(Origin::Program) => format!("{key} {value} (set by the program)"),
            Some(origin) => format!("{key} {value} (from {origin})"),
        }
    }

    /// The comment of `key` in `configs/netagg.cfg`, its lines joined; None for unknown
    /// keys. Programs that take keys as flags show it as their help.
    pub fn key_doc(key: &str) -> Option<String> {
        let (section, name) = table::section_of(key)?;
        let about = section.keys().find(|about| about.name == name)?;
        Some(about.doc.iter().map(|line| line.trim()).collect::<Vec<_>>().join(" "))
    }

    /// Slots of each worker thread: the window divided evenly (the remainder is unused).
    pub fn slots_per_thread(&self) -> u16 {
        self.general.max_outstanding_packets / self.general.num_worker_threads
    }

    /// The commented config file that lists every key with its comment and its default:
    /// `configs/netagg.cfg`.
    pub fn example_file() -> String {
        table::example_file()
    }

    /// Every key (`general.rank`) with what it accepts, in the order of
    /// `configs/netagg.cfg`.
    pub fn keys() -> impl Iterator<Item = (String, String)> {
        keys::SECTIONS.iter().flat_map(|section| {
            section
                .keys()
                .map(move |about| (format!("{}.{}", section.name(), about.name), about.kind.expected()))
        })
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
    fn the_example_file_is_the_table_of_keys_and_loads_as_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/netagg.cfg");
        let written = Config::example_file();
        if std::env::var_os("NETAGG_BLESS").is_some() {
            std::fs::write(&path, &written).unwrap();
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            text == written,
            "{} differs from the table of keys in config/src/keys.rs: rewrite it with \
             `NETAGG_BLESS=1 cargo test -p netagg-config`",
            path.display()
        );
        assert_eq!(Config::from_ini(&text, &path).unwrap(), Config::default());
        for (key, _) in Config::keys() {
            let name = key.rsplit('.').next().unwrap();
            assert!(text.contains(&format!("\n{name} = ")), "configs/netagg.cfg lacks {key}");
        }
    }

    #[test]
    fn every_key_is_set_by_its_environment_variable() {
        assert_eq!(table::variable("switch.faults", "send_drop"), "NETAGG_SWITCH_FAULTS__SEND_DROP");
        for (key, expected) in Config::keys() {
            let (section, name) = key.rsplit_once('.').unwrap();
            let variable = table::variable(section, name);
            assert_eq!(table::key_of_variable(&variable.to_ascii_lowercase()).as_deref(), Some(key.as_str()));
            if takes_empty(&expected) {
                continue;
            }
            // No other key takes an empty value.
            let error =
                Config::load_with_environment(None, &[(variable.clone(), String::new())]).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!("environment variable {variable}: key '{key}' = '': expected {expected}")
            );
        }
    }

    #[test]
    fn every_choice_is_accepted_and_reads_back() {
        for section in keys::SECTIONS {
            for about in section.keys() {
                let kind::Kind::Choice { choices, .. } = about.kind else { continue };
                let key = format!("{}.{}", section.name(), about.name);
                for choice in choices {
                    let mut config = Config::default();
                    config.set(&key, choice).unwrap_or_else(|e| panic!("{e}"));
                    assert_eq!(config.get(&key).as_deref(), Some(*choice), "{key}");
                }
            }
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
        assert!(matches!(&error, ConfigError::UnknownKey { key, .. } if key == "backend.rdma.msg_numel"));
        assert_eq!(
            error.to_string(),
            "test.cfg: unknown key 'backend.rdma.msg_numel'; known keys: device, device_port, gid_index, \
             queue_depth, message_size, poll"
        );
    }

    #[test]
    fn rdma_sections_are_read_and_set_from_the_environment() {
        let config = ini(
            "[general]\nbackend = rdma\n[backend.rdma]\ndevice = mlx5_0\ndevice_port = 2\ngid_index = 3\n\
             queue_depth = 1024\nmessage_size = 4096\npoll = busy\n[switch]\ntransport = rdma\n\
             [switch.rdma]\nqueue_depth = 64\n",
        )
        .unwrap();
        assert_eq!(config.general.backend, BackendKind::Rdma);
        assert_eq!(config.switch.transport, SwitchTransport::Rdma);
        assert_eq!(
            config.rdma,
            Rdma {
                device: "mlx5_0".into(),
                device_port: 2,
                gid_index: 3,
                queue_depth: 1024,
                message_size: 4096,
                poll: RdmaPoll::Busy,
            }
        );
        assert_eq!(config.switch.rdma, Rdma { queue_depth: 64, ..Rdma::default() });
        let defaults = Rdma::default();
        assert_eq!(
            (defaults.device.as_str(), defaults.device_port, defaults.gid_index, defaults.queue_depth),
            ("", 1, 1, 512)
        );
        assert_eq!((defaults.message_size, defaults.poll), (0, RdmaPoll::Event));

        let vars = [
            ("NETAGG_BACKEND_RDMA__DEVICE".to_string(), "rxe0".to_string()),
            ("NETAGG_SWITCH_RDMA__POLL".to_string(), "busy".to_string()),
        ];
        let config = Config::load_with_environment(None, &vars).unwrap();
        assert_eq!(config.rdma.device, "rxe0");
        assert_eq!(config.switch.rdma.poll, RdmaPoll::Busy);
        assert_eq!(config.switch.rdma.device, "");
    }

    #[test]
    fn bad_values_say_what_is_allowed() {
        let cases = [
            (
                "[general]\nnum_workers = 0\n",
                "key 'general.num_workers' = '0': expected an integer from 1 to 65535",
            ),
            ("[general]\nbackend = tcp\n", "key 'general.backend' = 'tcp': expected 'udp', 'dpdk', 'rdma' or 'dummy'"),
            ("[backend.dpdk]\npeer_mac = 02:00:00:00:01\n", "key 'backend.dpdk.peer_mac' = '02:00:00:00:01': expected a MAC address"),
            ("[switch.dpdk]\nburst = 0\n", "key 'switch.dpdk.burst' = '0': expected an integer from 1 to 1024"),
            ("[switch]\ntransport = tcp\n", "key 'switch.transport' = 'tcp': expected 'udp', 'dpdk' or 'rdma'"),
            ("[backend.rdma]\npoll = spin\n", "key 'backend.rdma.poll' = 'spin': expected 'busy' or 'event'"),
            ("[switch.rdma]\nqueue_depth = 8\n", "key 'switch.rdma.queue_depth' = '8': expected an integer from 16 to 65536"),
            ("[backend.rdma]\ndevice_port = 0\n", "key 'backend.rdma.device_port' = '0': expected an integer from 1 to 255"),
            ("[backend.rdma]\nmessage_size = 2000000\n", "key 'backend.rdma.message_size' = '2000000': expected bytes, an integer from 0 to 1048576"),
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

    /// Whether a key of the kind that `expected` describes takes an empty value (text,
    /// and a MAC address left to ARP).
    fn takes_empty(expected: &str) -> bool {
        expected == "text" || expected.ends_with("or nothing")
    }

    #[test]
    fn every_key_refuses_a_bad_value_naming_the_file_the_key_and_what_is_allowed() {
        for (key, expected) in Config::keys().filter(|(_, expected)| expected != "text") {
            let (section, name) = key.rsplit_once('.').unwrap();
            // Names and host names take any text but an empty or over-long one.
            let bad = match expected.as_str() {
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
        assert_eq!(
            message,
            "general.rank 4 (from test.cfg) must be below general.num_workers 4 (from test.cfg)"
        );
        let message =
            ini("[general]\nnum_worker_threads = 8\nmax_outstanding_packets = 4\n").unwrap_err().to_string();
        assert!(message.contains("every thread needs a slot"), "{message}");
    }

    #[test]
    fn combination_errors_name_where_each_value_came_from() {
        let dir = std::env::temp_dir().join(format!("netagg-config-origins-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("valid.cfg");
        std::fs::write(&file, "[general]\npacket_numel = 64\n").unwrap();
        let load = |pairs: &[(&str, &str)]| {
            let vars: Vec<_> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            Config::load_with_environment(Some(&file), &vars).unwrap_err().to_string()
        };
        assert_eq!(
            load(&[("NETAGG_GENERAL__RANK", "5")]),
            "general.rank 5 (from environment variable NETAGG_GENERAL__RANK) must be below \
             general.num_workers 1 (the default)"
        );
        assert_eq!(
            load(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "2")]),
            "general.rank 3 (from environment variable OMPI_COMM_WORLD_RANK) must be below \
             general.num_workers 2 (from environment variable OMPI_COMM_WORLD_SIZE)"
        );
        std::fs::write(&file, "[general]\nnum_worker_threads = 8\n").unwrap();
        assert_eq!(
            load(&[("NETAGG_GENERAL__MAX_OUTSTANDING_PACKETS", "4")]),
            format!(
                "general.max_outstanding_packets 4 (from environment variable \
                 NETAGG_GENERAL__MAX_OUTSTANDING_PACKETS) must be at least general.num_worker_threads 8 \
                 (from {}): every thread needs a slot",
                file.display()
            )
        );
        let mut config = Config::default();
        config.set("general.rank", "1").unwrap();
        assert_eq!(
            config.validate().unwrap_err(),
            "general.rank 1 (set by the program) must be below general.num_workers 1 (the default)"
        );
        std::fs::remove_dir_all(&dir).unwrap();
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
