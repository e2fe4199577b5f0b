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
//! The sections' structs sit by concern: `general.rs`, `backends.rs` (dummy, udp, dpdk,
//! rdma), `switch.rs` and `faults.rs`, each enum of names declared once by `named_enum!`
//! (`kind.rs`, with what every key accepts). `sources.rs` reads the file, the launcher's
//! and `NETAGG_` variables and records where each value came from; `validation.rs` checks
//! the combinations no single key can; `table.rs` is the machinery behind the key table.
//!
//! Fault injection has the same keys in two sections: `[faults]` for a worker's
//! transport and `[switch.faults]` for the switch's data path (also `netagg-switch
//! --faults KEY=VALUE,...`).
//!
//! [`logging`] sets up the log output every netagg program shares.

#![forbid(unsafe_code)]

mod backends;
mod error;
mod faults;
mod general;
mod keys;
mod kind;
pub mod logging;
mod sources;
mod switch;
mod table;
mod validation;

pub use backends::{Dpdk, Dummy, PollMode, Rdma, RdmaPoll, Udp};
pub use error::ConfigError;
pub use faults::Faults;
pub use general::{BackendKind, General, SparseMode, WirePrecision, MAX_PACKET_NUMEL, MAX_SESSION_NAME_LEN};
pub use ipnet::IpNet;
pub use sources::Origin;
pub use switch::{Switch, SwitchTransport};

use sources::Origins;

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

impl Config {
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
                self.origins.record(key, origin);
                Ok(())
            }
            Some(Err(expected)) => Err(ConfigError::refused(origin, key, value, expected)),
            None if section.lists_own_keys() => Err(unknown(table::names(section.keys()))),
            None => Err(unknown(every_key())),
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

    /// The control addresses of the switches a session spans, HOST:PORT, in the order
    /// that gives each its share of the slots: `general.switches`, or the one switch at
    /// `general.controller_ip` and `general.controller_port`.
    pub fn switch_addresses(&self) -> Vec<String> {
        let general = &self.general;
        if !general.switches.is_empty() {
            return general.switches.clone();
        }
        let host = &general.controller_ip;
        // An IPv6 address needs brackets before its port.
        match host.parse::<std::net::Ipv6Addr>() {
            Ok(_) => vec![format!("[{host}]:{}", general.controller_port)],
            Err(_) => vec![format!("{host}:{}", general.controller_port)],
        }
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// The configuration `text` makes as the file `test.cfg`.
    pub(crate) fn ini(text: &str) -> Result<Config, ConfigError> {
        Config::from_ini(text, Path::new("test.cfg"))
    }

    /// Whether a key of the kind that `expected` describes takes an empty value (text,
    /// and a MAC address left to ARP).
    pub(crate) fn takes_empty(expected: &str) -> bool {
        expected == "text" || expected.ends_with("or nothing")
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
            ("[general]\npacket_numel = 20000\n", "expected an integer from 1 to 16363"),
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
            ("[general]\nswitches = h1:50099,h1:50099\n", "key 'general.switches' = 'h1:50099,h1:50099': expected addresses HOST:PORT, comma-separated, each once"),
            ("[general]\nswitches = h1\n", "key 'general.switches' = 'h1': expected addresses HOST:PORT"),
            ("[general]\nswitches = h1:0\n", "expected addresses HOST:PORT"),
            ("[general]\nswitches = fd00::1:80\n", "expected addresses HOST:PORT"),
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
}
