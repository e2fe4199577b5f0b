//! Data ports: how the switch's data path meets the network.
//!
//! The data path feeds the engine whatever datagrams a [`DataPort`] receives and hands
//! the port the results to send; it knows nothing of sockets, rings or queue pairs. A
//! port names the worker threads it talks to with its own [`DataPort::Address`] (a UDP
//! socket address, a connection), resolved once, when a session opens, from the
//! [`Endpoint`] each thread registered.
//!
//! - [`UdpPort`]: a kernel UDP socket with batched system calls;
//! - [`DpdkPort`]: a DPDK device, speaking the same UDP;
//! - [`RdmaPort`]: RDMA reliable connections, one per worker thread, accepted through
//!   rdma_cm;
//! - [`FaultyPort`]: wraps any port to drop, duplicate, reorder, delay or corrupt
//!   datagrams each way, for `[switch.faults]`;
//! - [`memory`]: a network in memory, so that the data path and whole sessions are
//!   tested without sockets.
//!
//! A new transport implements [`DataPort`] over its own crate, and
//! [`crate::Switch::start`] maps its configuration to it.

#[cfg(feature = "dpdk")]
pub mod dpdk;
pub mod faulty;
pub mod memory;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod udp;

use std::fmt::Debug;
use std::hash::Hash;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_aggregator::faults::FaultCounters;
use netagg_udp::SegmentBatch;
use netagg_wire::Endpoint;

#[cfg(feature = "dpdk")]
pub use dpdk::DpdkPort;
pub use faulty::FaultyPort;
pub use memory::{MemoryNetwork, MemorySocket};
#[cfg(feature = "rdma")]
pub use rdma::RdmaPort;
pub use udp::UdpPort;

/// One network attachment of the switch's data path, owned by the data path's thread.
///
/// Sending is best effort, as a switch's is: what cannot leave (a full queue, a peer
/// gone) is lost as on a congested link, and the workers' retransmissions recover it.
/// Receiving fails only when the port itself is broken, which stops the data path.
pub trait DataPort: Send + 'static {
    /// How the port names a worker thread, as a source and as a destination.
    type Address: Copy + Eq + Hash + Debug + Send + 'static;

    /// Where workers send their packets: every accept announces it. An unspecified IP
    /// stands for the address the worker registered at.
    fn endpoint(&self) -> Endpoint;

    /// The address of a worker thread that registered `endpoint` over a control
    /// connection from `peer`, for a session that asks `link` of it; a message for the
    /// worker if this port cannot reach it.
    fn resolve(
        &mut self,
        endpoint: &Endpoint,
        peer: IpAddr,
        link: ThreadLink,
    ) -> Result<Self::Address, String>;

    /// Waits up to `timeout` for datagrams and hands each, with its source, to `sink`;
    /// returns how many it handed over (0 when the time ran out).
    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(Self::Address, &[u8])) -> io::Result<usize>;

    /// Queues `datagram` for `destination`; it leaves at the latest at [`DataPort::flush`].
    fn send(&mut self, destination: Self::Address, datagram: &[u8]);

    /// Queues one datagram for several destinations: a port that can share one buffer
    /// among several sends (a registered RDMA buffer, a reference-counted mbuf) does so.
    fn broadcast(&mut self, destinations: &[Self::Address], datagram: &[u8]) {
        for &destination in destinations {
            self.send(destination, datagram);
        }
    }

    /// Queues every datagram of each batch for each of its destinations. The data path
    /// writes results straight into such batches, one list per group of recipients: a
    /// port that sends a batch as it is (UDP, with segmentation offload, all of them in
    /// one system call) overrides this to take them without a copy.
    fn send_batches<'b>(&mut self, batches: impl Iterator<Item = (&'b [Self::Address], &'b SegmentBatch)>) {
        for (destinations, batch) in batches {
            for datagram in batch.datagrams() {
                self.broadcast(destinations, datagram);
            }
        }
    }

    /// Most datagrams a batch for [`DataPort::send_batches`] should hold.
    fn batch_segments(&self) -> usize {
        64
    }

    /// Sends everything queued.
    fn flush(&mut self);

    /// The longest datagram the port carries, where it has a limit below UDP's (a DPDK
    /// port's MTU); registrations for longer packets are refused.
    fn max_datagram(&self) -> Option<usize> {
        None
    }

    /// `address` belongs to no session any more: whatever the port keeps for it goes.
    fn forget(&mut self, address: Self::Address) {
        let _ = address;
    }

    /// Fails the connection to `address` as a failing device would, to inject that
    /// fault (`sever_after` of `[switch.faults]`); a port without connections has none
    /// to fail.
    fn sever(&mut self, address: Self::Address) {
        let _ = address;
    }

    /// The worker threads whose connections ended since the last call (a port with a
    /// connection per thread: RDMA's), each with how: nothing reaches them any more, so
    /// the data path ends what waits for them. Addresses forgotten are not among them.
    fn take_failed(&mut self) -> Vec<(Self::Address, ConnectionEnd)> {
        Vec::new()
    }

    /// What fault injection did to the datagrams received and sent, for a port that
    /// injects faults.
    fn fault_counters(&self) -> Option<(FaultCounters, FaultCounters)> {
        None
    }
}

/// How a worker thread's connection ended, as [`DataPort::take_failed`] tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionEnd {
    /// Its peer disconnected, no request failing: a worker closing its connections as it
    /// leaves, whose Leave may come after.
    Disconnected,
    /// It failed, as the message says: what the thread sent last may be lost.
    Failed(String),
}

/// What a session asks of the link to each of its worker threads, for ports that size
/// their buffers per thread (RDMA's registered ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadLink {
    /// Bytes of the session's longest datagram.
    pub datagram_len: usize,
    /// Packets a thread keeps in flight at most: its share of the slots.
    pub window: usize,
}

/// The socket address of a worker thread's UDP endpoint, for ports that address workers
/// as UDP does. The control plane has checked that it is where the switch may send
/// (at the registration's address, or in `switch.data_networks`).
fn udp_peer(endpoint: &Endpoint, peer: IpAddr) -> Result<SocketAddr, String> {
    endpoint.udp_address(peer).ok_or_else(|| format!("{endpoint} is not a UDP endpoint"))
}
