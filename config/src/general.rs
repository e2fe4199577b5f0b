//! `[general]`: what every backend shares, and the names its choices take.

use std::time::Duration;

use crate::kind::named_enum;

/// Largest `general.packet_numel`: the most elements a packet carries inside a 64 KiB
/// datagram, the protocol's `netagg_wire::packet::MAX_ELEMENTS` (a test checks they agree).
pub const MAX_PACKET_NUMEL: u16 = 16363;
/// Longest `general.session`, in bytes: the protocol's
/// `netagg_wire::control::MAX_SESSION_NAME_LEN` (a test checks they agree).
pub const MAX_SESSION_NAME_LEN: usize = 64;

named_enum! {
    /// Which transport carries the packets.
    pub enum BackendKind {
        /// UDP to a `netagg-switch`.
        Udp = "udp",
        /// UDP datagrams from a DPDK port to a `netagg-switch`, kernel bypassed.
        Dpdk = "dpdk",
        /// The same datagrams as RDMA SEND messages over reliable connections to a
        /// `netagg-switch` (`[backend.rdma]`).
        Rdma = "rdma",
        /// No network: an in-process switch sums as if every worker sent the same data.
        Dummy = "dummy",
    }
}

named_enum! {
    /// Whether a job's blocks that are zero may stay off the wire.
    pub enum SparseMode {
        /// Jobs travel as sparse block streams (OmniReduce's) wherever the codec keeps zeros
        /// zero: each worker sends only its non-zero blocks. Every rank must agree.
        Auto = "auto",
        /// Every block is sent, in SwitchML's dense rounds: the default, since streaming a
        /// tensor without zero blocks costs more as sparse streams than as dense rounds.
        Off = "off",
    }
}

named_enum! {
    /// How float32 tensors travel on the wire; other types always travel as they are.
    pub enum WirePrecision {
        /// As float32: 4 bytes an element.
        Float32 = "float32",
        /// Rounded to IEEE binary16 by the worker threads as they load each packet, and
        /// widened back as they store its sum: half the bytes, as PyTorch DDP's
        /// `fp16_compress_hook` sends.
        Float16 = "float16",
        /// Rounded to bfloat16 the same way (float32's range, 8 significant bits), as
        /// `bf16_compress_hook` sends.
        BFloat16 = "bfloat16",
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
    /// How float32 tensors travel: as float32, or narrowed to 16 bits by the workers.
    pub wire_precision: WirePrecision,
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
    /// The control addresses of the switches (shards) a session spans, HOST:PORT; empty:
    /// the one at `controller_ip` and `controller_port`.
    pub switches: Vec<String>,
    /// Session name: the ranks of one job share it; other jobs use other names.
    pub session: String,
    /// Rounds each slot retains at the switch (2: SwitchML's shadow copy).
    pub depth: u8,
    /// Whether zero blocks stay off the wire.
    pub sparse: SparseMode,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::ini;
    use crate::Config;

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
}
