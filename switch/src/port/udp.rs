//! The kernel UDP port: one socket, batched system calls.
//!
//! Datagrams arrive through recvmmsg, with GRO where the kernel coalesces them. The data
//! path's results come in batches it wrote them into ([`DataPort::send_batches`]), each
//! sent as it is, one GSO message per batch and recipient, all of a receive call's worth
//! in one sendmmsg call (or a few), whatever their sizes. Results sent one
//! by one (through a [`super::FaultyPort`]) wait in one [`SegmentBatch`] per group of
//! destinations and leave together at [`DataPort::flush`]; a result for every rank is
//! written once, into a batch shared by its destinations and sent to each.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_udp::{BatchSocket, SegmentBatch};
use netagg_wire::Endpoint;
use rustc_hash::FxHashMap;

use super::{DataPort, ThreadLink};

/// Socket buffer size asked for; the kernel caps it at net.core.rmem_max / wmem_max.
pub const SOCKET_BUFFER: usize = 16 << 20;

pub struct UdpPort {
    socket: BatchSocket,
    local: SocketAddr,
    /// Results queued since the last flush, by destinations: keyed by the first and how
    /// many there are, since a session's broadcasts for one worker thread's slots all go
    /// to the same threads, first rank 0's.
    queues: FxHashMap<(SocketAddr, usize), Queue>,
}

/// Datagrams for the same destinations, sent to each as one GSO batch.
struct Queue {
    destinations: Vec<SocketAddr>,
    batch: SegmentBatch,
}

impl Queue {
    /// Sends the batch to every destination, and empties it.
    fn send(&mut self, socket: &BatchSocket) {
        for &destination in &self.destinations {
            if let Err(error) = socket.send(destination, &self.batch) {
                tracing::debug!(%error, %destination, "send failed");
            }
        }
        self.batch.clear();
    }
}

impl UdpPort {
    /// Binds the data path's socket at `address` (port 0: any free port).
    pub fn bind(address: SocketAddr) -> io::Result<UdpPort> {
        let socket = BatchSocket::bind(address, SOCKET_BUFFER)?;
        let local = socket.local_addr()?;
        Ok(UdpPort { socket, local, queues: FxHashMap::default() })
    }

    /// The address bound, with the port actually chosen.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl DataPort for UdpPort {
    type Address = SocketAddr;

    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(self.local)
    }

    fn resolve(&mut self, endpoint: &Endpoint, peer: IpAddr, _: ThreadLink) -> Result<SocketAddr, String> {
        super::udp_peer(endpoint, peer)
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(SocketAddr, &[u8])) -> io::Result<usize> {
        self.socket.recv(timeout, sink)
    }

    fn send(&mut self, destination: SocketAddr, datagram: &[u8]) {
        self.broadcast(&[destination], datagram);
    }

    fn broadcast(&mut self, destinations: &[SocketAddr], datagram: &[u8]) {
        let Some(&first) = destinations.first() else { return };
        let max_segments = self.socket.max_segments();
        let queue = self.queues.entry((first, destinations.len())).or_insert_with(|| Queue {
            destinations: destinations.to_vec(),
            batch: SegmentBatch::new(max_segments),
        });
        if queue.destinations != destinations {
            // Another group led by the same thread: not a session's broadcast, and rare.
            for &destination in destinations {
                self.broadcast(&[destination], datagram);
            }
            return;
        }
        if !queue.batch.accepts(datagram.len()) {
            queue.send(&self.socket);
        }
        queue.batch.push(datagram);
    }

    fn send_batches<'b>(&mut self, batches: impl Iterator<Item = (&'b [SocketAddr], &'b SegmentBatch)>) {
        let each = batches.flat_map(|(destinations, batch)| destinations.iter().map(move |&to| (to, batch)));
        if let Err(error) = self.socket.send_all(each) {
            tracing::debug!(%error, "send failed");
        }
    }

    fn batch_segments(&self) -> usize {
        self.socket.max_segments()
    }

    fn flush(&mut self) {
        for queue in self.queues.values_mut().filter(|queue| !queue.batch.is_empty()) {
            queue.send(&self.socket);
        }
    }

    fn forget(&mut self, address: SocketAddr) {
        self.queues.retain(|_, queue| !queue.destinations.contains(&address));
    }
}
