//! What a DPDK endpoint starts from, in this crate's own terms: a program maps its
//! configuration onto [`Settings`] and says which part of it they came from, so that an
//! error about a setting names the key the user wrote.

use crate::{MacAddr, PollMode, PortSettings};

/// EAL's arguments, the device, and the UDP endpoint on the device's port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Where these came from, such as the configuration section `backend.dpdk`: errors
    /// name a setting as `{section}.{field}`.
    pub section: &'static str,
    /// EAL's arguments, one string each; EAL starts once per process.
    pub eal_args: Vec<String>,
    /// The device: a virtual device's arguments (`net_af_packet0,iface=eth0`) or a PCI
    /// address (`0000:3b:00.0`).
    pub device: String,
    /// Where every frame goes, if set (the peer's or a router's MAC); else each peer's
    /// own, asked by ARP and learned from its frames.
    pub peer_mac: Option<MacAddr>,
    /// Descriptors of the receive and transmit rings (the driver may round them).
    pub rx_descriptors: u16,
    pub tx_descriptors: u16,
    /// Mbufs in the port's pool, shared by its rings and every frame being built.
    pub pool_size: u32,
    /// Frames received or sent at a time.
    pub burst: u16,
    /// How an idle receive queue is watched.
    pub poll: PollMode,
}

impl Settings {
    /// The port these settings open, with up to `queues` queue pairs.
    pub(crate) fn port(&self, queues: u16) -> PortSettings {
        PortSettings {
            device: self.device.clone(),
            rx_descriptors: self.rx_descriptors,
            tx_descriptors: self.tx_descriptors,
            pool_size: self.pool_size,
            queues,
        }
    }
}
