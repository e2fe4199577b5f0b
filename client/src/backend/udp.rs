//! The UDP backend: one socket per worker thread, batched system calls.
//!
//! A worker thread's packets are written straight into a GSO batch and leave together;
//! its results arrive through recvmmsg and GRO ([`netagg_udp::BatchSocket`]), so a
//! window of packets costs a few system calls rather than one each.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_udp::{BatchSocket, SegmentBatch};
use netagg_wire::Endpoint;

use super::{ControlAddresses, SwitchTransport, Transport};

/// A worker thread's socket, bound before registration so its port can be announced.
pub struct UdpTransport {
    socket: BatchSocket,
    local: SocketAddr,
    switch: Option<SocketAddr>,
    pending: SegmentBatch,
}

impl UdpTransport {
    /// Binds a socket at `ip` on a free port; `socket_buffer` sizes its kernel buffers
    /// (0: default).
    pub fn bind(ip: IpAddr, socket_buffer: usize) -> io::Result<UdpTransport> {
        let socket = BatchSocket::bind(SocketAddr::new(ip, 0), socket_buffer)?;
        let local = socket.local_addr()?;
        let pending = SegmentBatch::new(socket.max_segments());
        Ok(UdpTransport { socket, local, switch: None, pending })
    }

    fn switch(&self) -> io::Result<SocketAddr> {
        self.switch.ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotConnected, "the UDP transport has no switch address yet")
        })
    }
}

impl Transport for UdpTransport {
    fn describe(&self) -> String {
        format!("udp: a kernel socket at {}", self.local)
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        self.pending.room(len)
    }

    fn send(&mut self, len: usize) -> io::Result<()> {
        if self.pending.accepts(len) {
            self.pending.commit(len);
            return Ok(());
        }
        // The batch is full or holds datagrams of another size: it leaves now, and the
        // new datagram starts the next one.
        let result = self.socket.send(self.switch()?, &self.pending);
        self.pending.restart_with_room(len);
        result
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let result = self.socket.send(self.switch()?, &self.pending);
        self.pending.clear();
        result
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        self.socket.recv(timeout, |_, datagram| sink(datagram))
    }
}

impl SwitchTransport for UdpTransport {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(self.local)
    }

    fn connect(&mut self, switch: &Endpoint, control: ControlAddresses) -> io::Result<()> {
        let Some(switch) = switch.udp_address(control.switch) else {
            let message = format!("the switch's data path is {switch}, not UDP");
            return Err(io::Error::new(io::ErrorKind::Unsupported, message));
        };
        // Accepts datagrams from the switch's data address only.
        self.socket.connect(switch)?;
        self.switch = Some(switch);
        Ok(())
    }
}
