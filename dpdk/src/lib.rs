//! netagg's DPDK endpoint, over Debian's DPDK 22.11 through a small C shim
//! (`shim/shim.c`): the published `dpdk-sys` bindings do not build against it.
//!
//! - [`Eal`]: EAL, started once per process from arguments checked against what netagg
//!   supports (one lcore, options written in full); its failures come back as errors
//!   with EAL's own explanation, never as an exit or abort of the process;
//! - [`Port`]: a probed and started device with its mbuf pool, and its [`Queue`]s (pairs
//!   of receive and transmit queues, each owned by one user), closed with the last of
//!   them; [`Frame`]: an mbuf, freed on drop;
//! - [`Station`]: a UDP endpoint on a queue, with ARP, so that a DPDK worker or switch
//!   speaks the same datagrams as a kernel socket; [`headers`]: the headers, as pure
//!   code; [`PortReservation`]: the kernel's hold on the UDP ports a station answers at;
//! - [`ThreadEndpoint`]: one of several threads' UDP endpoints on a port whose queues
//!   they share, each receiving what others polled for it (netagg's worker threads);
//!   [`PortEndpoint`]: the one UDP endpoint on a port, polled by one thread (its switch);
//! - [`Settings`]: what a program's configuration gives; [`IdleWait`]: how a poller
//!   waits while nothing comes, in a [`PollMode`].
//!
//! All unsafe code of netagg's DPDK path is in this crate, in its thin bottom layer:
//! `ffi` (the shim's declarations), `eal`, `frame` (mbufs and their pool) and `port`
//! (the port and its queues), each call with the reason it is sound. Everything above
//! them is safe Rust.

mod eal;
mod eal_args;
mod endpoint;
mod ffi;
mod frame;
pub mod headers;
mod idle;
mod neighbours;
mod port;
mod reservation;
mod settings;
mod shared;
mod station;

use std::net::Ipv4Addr;
use std::time::Duration;

pub use eal::Eal;
pub use endpoint::PortEndpoint;
pub use frame::{Frame, FrameAllocator};
pub use idle::{IdleWait, PollMode};
pub use port::{Port, PortSettings, Queue};
pub use reservation::PortReservation;
pub use settings::Settings;
pub use shared::ThreadEndpoint;
pub use station::{Datagram, OutgoingDatagram, Station, StationCounters};

/// Why DPDK could not do what was asked. Texts are whole sentences for the user, with
/// DPDK's own explanation where it gave one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DpdkError {
    #[error("EAL argument '{argument}' is refused: {why}")]
    RefusedArgument { argument: String, why: String },
    #[error("DPDK's EAL did not start with arguments '{args}': {reason}")]
    Eal { args: String, reason: String },
    #[error(
        "DPDK's EAL runs in this process with arguments '{running}', not '{asked}': EAL starts \
         once per process, so every DPDK endpoint of a process must use the same arguments"
    )]
    EalRunning { running: String, asked: String },
    #[error(
        "{section}.device is empty: name the DPDK device (net_af_packet0,iface=eth0 for a kernel \
         interface, or a NIC's PCI address)"
    )]
    NoDevice { section: &'static str },
    #[error("DPDK device '{device}': {reason}")]
    Device { device: String, reason: String },
    #[error("no ARP reply from {ip} within {timeout:?}: is it up, on this port's network?")]
    Unresolved { ip: Ipv4Addr, timeout: Duration },
    #[error("cannot reserve UDP port {port} at {ip}: {reason}")]
    Reservation { ip: Ipv4Addr, port: u16, reason: String },
}

/// An Ethernet MAC address.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    pub const BROADCAST: MacAddr = MacAddr([0xff; 6]);

    /// Whether it names a group (broadcast included), never one station.
    pub fn is_multicast(&self) -> bool {
        self.0[0] & 1 == 1
    }
}

impl std::fmt::Display for MacAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl std::fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_addresses_print_as_ip_link_does() {
        let mac = MacAddr([2, 0, 10, 255, 0, 1]);
        assert_eq!(mac.to_string(), "02:00:0a:ff:00:01");
        assert!(MacAddr::BROADCAST.is_multicast() && !mac.is_multicast());
    }
}
