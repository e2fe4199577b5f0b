//! The UDP backend: one socket per worker thread, batched system calls.
//!
//! A worker thread's packets leave as GSO batches and its results arrive through
//! recvmmsg and GRO ([`netagg_udp::BatchSocket`]), so a window of packets costs a few
//! system calls rather than one each.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use netagg_udp::{BatchSocket, SegmentBatch};

use super::Transport;

/// A worker thread's socket, bound before registration so its port can be announced.
pub struct UdpTransport {
    socket: BatchSocket,
    switch: Option<SocketAddr>,
    pending: SegmentBatch,
}

impl UdpTransport {
    /// Binds a socket at `bind`; `socket_buffer` sizes its kernel buffers (0: default).
    pub fn bind(bind: SocketAddr, socket_buffer: usize) -> io::Result<UdpTransport> {
        let socket = BatchSocket::bind(bind, socket_buffer)?;
        let pending = SegmentBatch::new(socket.max_segments());
        Ok(UdpTransport { socket, switch: None, pending })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// Sends to and accepts datagrams only from the switch's data address.
    pub fn connect(&mut self, switch: SocketAddr) -> io::Result<()> {
        self.socket.connect(switch)?;
        self.switch = Some(switch);
        Ok(())
    }
}

impl Transport for UdpTransport {
    fn send(&mut self, datagram: &[u8]) -> io::Result<()> {
        if !self.pending.accepts(datagram.len()) {
            self.flush()?;
        }
        self.pending.push(datagram);
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let Some(switch) = self.switch else {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the UDP transport has no switch address yet",
            ));
        };
        let result = self.socket.send(switch, &self.pending);
        self.pending.clear();
        result
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        self.socket.recv(timeout, |_, datagram| sink(datagram))
    }
}
