//! The UDP backend: one socket per worker thread, batched system calls.
//!
//! A worker thread's packets are written straight into a GSO batch and leave together;
//! its results arrive through recvmmsg and GRO ([`netagg_udp::BatchSocket`]), so a
//! window of packets costs a few system calls rather than one each. A batch goes to one
//! destination: with several data endpoints, a packet for another endpoint than the
//! batch's sends the batch first. The switches' slot split gives a thread's contiguous
//! slots to as few endpoints as it can, so batches stay long.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_udp::{BatchSocket, SegmentBatch};
use netagg_wire::Endpoint;

use super::{DataPaths, SwitchTransport, Transport};

/// A worker thread's socket, bound before registration so its port can be announced.
pub struct UdpTransport {
    socket: BatchSocket,
    local: SocketAddr,
    /// The switches' data addresses, in [`DataPaths::endpoints`] order, and which takes
    /// each datagram; `None` until connected.
    switch: Option<(Vec<SocketAddr>, DataPaths)>,
    pending: SegmentBatch,
    /// The index in the switch's addresses of where `pending` goes.
    pending_path: usize,
}

impl UdpTransport {
    /// Binds a socket at `ip` on a free port; `socket_buffer` sizes its kernel buffers
    /// (0: default).
    pub fn bind(ip: IpAddr, socket_buffer: usize) -> io::Result<UdpTransport> {
        let socket = BatchSocket::bind(SocketAddr::new(ip, 0), socket_buffer)?;
        let local = socket.local_addr()?;
        let pending = SegmentBatch::new(socket.max_segments());
        Ok(UdpTransport { socket, local, switch: None, pending, pending_path: 0 })
    }

    /// Sends the batch held, if any, to where it goes.
    fn send_pending(&self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let (addresses, _) = self.switch.as_ref().ok_or_else(not_connected)?;
        self.socket.send(addresses[self.pending_path], &self.pending)
    }
}

fn not_connected() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the UDP transport has no switch address yet")
}

impl Transport for UdpTransport {
    fn describe(&self) -> String {
        format!("udp: a kernel socket at {}", self.local)
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        self.pending.room(len)
    }

    fn send(&mut self, len: usize) -> io::Result<()> {
        let (_, paths) = self.switch.as_ref().ok_or_else(not_connected)?;
        let path = paths.owner(&self.pending.room(len)[..len]);
        if path == self.pending_path && self.pending.accepts(len) {
            self.pending.commit(len);
            return Ok(());
        }
        // The batch is full, holds datagrams of another size or goes elsewhere: it leaves
        // now, and the new datagram starts the next one.
        let result = self.send_pending();
        self.pending.restart_with_room(len);
        self.pending_path = path;
        result
    }

    fn flush(&mut self) -> io::Result<()> {
        let result = self.send_pending();
        self.pending.clear();
        result
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        match &self.switch {
            // Connected: the kernel takes datagrams from the one data address only.
            Some((addresses, _)) if addresses.len() > 1 => self.socket.recv(timeout, |source, datagram| {
                if addresses.contains(&source) {
                    sink(datagram);
                }
            }),
            _ => self.socket.recv(timeout, |_, datagram| sink(datagram)),
        }
    }
}

impl SwitchTransport for UdpTransport {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(self.local)
    }

    fn connect(&mut self, paths: &DataPaths) -> io::Result<()> {
        let addresses = paths
            .endpoints()
            .map(|(endpoint, control)| {
                endpoint.udp_address(control.switch).ok_or_else(|| {
                    let message = format!("the switch's data path is {endpoint}, not UDP");
                    io::Error::new(io::ErrorKind::Unsupported, message)
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        // One data address: the kernel accepts datagrams from it only. With several, the
        // socket stays unconnected and `recv` keeps theirs.
        if let [one] = addresses[..] {
            self.socket.connect(one)?;
        }
        self.switch = Some((addresses, paths.clone()));
        Ok(())
    }
}
