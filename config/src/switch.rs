//! `[switch]`: the `netagg-switch` process, and the transport its data path runs on.

use std::net::SocketAddr;
use std::time::Duration;

use crate::kind::named_enum;
use crate::{Dpdk, Faults, Rdma};

named_enum! {
    /// Which transport the switch's data path runs on.
    pub enum SwitchTransport {
        /// A kernel UDP socket at `switch.data`.
        Udp = "udp",
        /// A DPDK port (`[switch.dpdk]`), UDP at `switch.data`'s port.
        Dpdk = "dpdk",
        /// RDMA reliable connections accepted through rdma_cm at `switch.data`
        /// (`[switch.rdma]`).
        Rdma = "rdma",
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
    /// Data-path threads, each with a socket and a share of every session's slots.
    pub threads: u16,
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
    /// The upper switch's control address, for a switch serving one rack of an
    /// aggregation tree; empty for none.
    pub upstream: String,
    /// With `upstream`: the rack this switch serves, of `racks`.
    pub rack: u16,
    pub racks: u16,
    /// Print counters this often; zero prints them only on exit.
    pub stats_interval: Duration,
    /// error, warn, info, debug or trace.
    pub log_level: String,
    /// Where to serve the counters in Prometheus's text format (GET /metrics), if
    /// anywhere.
    pub metrics: Option<SocketAddr>,
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
