//! The kernel UDP port: one socket, batched system calls.
//!
//! Datagrams arrive through recvmmsg, with GRO where the kernel coalesces them; results
//! wait in one [`SegmentBatch`] per destination and leave together at
//! [`DataPort::flush`], one GSO send each, so that a receive call's worth of results
//! costs a system call per worker thread rather than one per datagram.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_udp::{BatchSocket, SegmentBatch};
use netagg_wire::Endpoint;
use rustc_hash::FxHashMap;

use super::DataPort;

/// Socket buffer size asked for; the kernel caps it at net.core.rmem_max / wmem_max.
pub const SOCKET_BUFFER: usize = 16 << 20;

pub struct UdpPort {
    socket: BatchSocket,
    local: SocketAddr,
    /// Results queued since the last flush, by destination.
    outgoing: FxHashMap<SocketAddr, SegmentBatch>,
    /// Batches that filled up since the last flush, sent first.
    full: Vec<(SocketAddr, SegmentBatch)>,
    /// Sent batches kept for reuse: a new one would grow its buffer a datagram at a time,
    /// copying and faulting in pages, for every batch a burst of results fills.
    spare: Vec<SegmentBatch>,
}

impl UdpPort {
    /// Binds the data path's socket at `address` (port 0: any free port).
    pub fn bind(address: SocketAddr) -> io::Result<UdpPort> {
        let socket = BatchSocket::bind(address, SOCKET_BUFFER)?;
        let local = socket.local_addr()?;
        Ok(UdpPort { socket, local, outgoing: FxHashMap::default(), full: Vec::new(), spare: Vec::new() })
    }

    /// The address bound, with the port actually chosen.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

fn send_batch(socket: &BatchSocket, destination: SocketAddr, batch: &SegmentBatch) {
    if let Err(error) = socket.send(destination, batch) {
        tracing::debug!(%error, %destination, "send failed");
    }
}

impl DataPort for UdpPort {
    type Address = SocketAddr;

    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(self.local)
    }

    fn resolve(&self, endpoint: &Endpoint, peer: IpAddr) -> Result<SocketAddr, String> {
        super::udp_peer(endpoint, peer)
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(SocketAddr, &[u8])) -> io::Result<usize> {
        self.socket.recv(timeout, sink)
    }

    fn send(&mut self, destination: SocketAddr, datagram: &[u8]) {
        let max_segments = self.socket.max_segments();
        let batch = self.outgoing.entry(destination).or_insert_with(|| SegmentBatch::new(max_segments));
        if !batch.accepts(datagram.len()) {
            let next = self.spare.pop().unwrap_or_else(|| SegmentBatch::new(max_segments));
            self.full.push((destination, std::mem::replace(batch, next)));
        }
        batch.push(datagram);
    }

    fn flush(&mut self) {
        for (destination, mut batch) in self.full.drain(..) {
            send_batch(&self.socket, destination, &batch);
            batch.clear();
            self.spare.push(batch);
        }
        for (destination, batch) in self.outgoing.iter_mut().filter(|(_, batch)| !batch.is_empty()) {
            send_batch(&self.socket, *destination, batch);
            batch.clear();
        }
    }

    fn forget(&mut self, address: SocketAddr) {
        self.outgoing.remove(&address);
    }
}
