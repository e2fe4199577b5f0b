//! The UDP backend: one socket per worker thread, batched system calls.
//!
//! Sends of equal-sized datagrams are coalesced into one GSO send where the kernel offers
//! it, and receives use recvmmsg with GRO, so a window of packets costs a few system calls
//! rather than one each (the per-datagram cost, not summing, bounds UDP on one machine).

use std::io::{self, IoSliceMut};
use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use netagg_wire::batch::SegmentBatch;
use netagg_wire::MAX_DATAGRAM_LEN;
use quinn_udp::{RecvMeta, Transmit, UdpSocketState};

use super::Transport;

/// Receive buffers per call; each holds one datagram or a GRO batch of up to 64 KiB.
const RECV_BATCH: usize = 16;
/// The shortest wait handed to the socket: a zero read timeout means "forever".
const MIN_WAIT: Duration = Duration::from_micros(50);

/// A worker thread's socket, bound before registration so its port can be announced.
pub struct UdpTransport {
    socket: UdpSocket,
    state: UdpSocketState,
    switch: Option<SocketAddr>,
    /// Datagrams queued for one GSO send.
    pending: SegmentBatch,
    buffers: Vec<Vec<u8>>,
    read_timeout: Option<Duration>,
}

impl UdpTransport {
    /// Binds a socket at `bind`; `socket_buffer` sizes its kernel buffers (0: default).
    pub fn bind(bind: SocketAddr, socket_buffer: usize) -> io::Result<UdpTransport> {
        let socket = UdpSocket::bind(bind)?;
        let state = UdpSocketState::new((&socket).into())?;
        if socket_buffer > 0 {
            // Best effort: the kernel caps buffers at its configured maximum.
            let _ = state.set_send_buffer_size((&socket).into(), socket_buffer);
            let _ = state.set_recv_buffer_size((&socket).into(), socket_buffer);
        }
        let pending = SegmentBatch::new(state.max_gso_segments().min(64));
        Ok(UdpTransport {
            socket,
            state,
            switch: None,
            pending,
            buffers: vec![vec![0u8; MAX_DATAGRAM_LEN]; RECV_BATCH],
            read_timeout: None,
        })
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
        let Some(destination) = self.switch else {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the UDP transport has no switch address yet",
            ));
        };
        let transmit = Transmit {
            destination,
            ecn: None,
            contents: self.pending.contents(),
            segment_size: self.pending.segment_size(),
            src_ip: None,
        };
        let result = self.state.try_send((&self.socket).into(), &transmit);
        self.pending.clear();
        match result {
            // The switch not listening (yet, or any more) looks like loss to the protocol,
            // which retransmits and finally times out with a clear error.
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(()),
            other => other,
        }
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        let timeout = timeout.max(MIN_WAIT);
        if self.read_timeout != Some(timeout) {
            self.socket.set_read_timeout(Some(timeout))?;
            self.read_timeout = Some(timeout);
        }
        let mut meta = [RecvMeta::default(); RECV_BATCH];
        let received = {
            let mut slices: Vec<IoSliceMut> = self.buffers.iter_mut().map(|b| IoSliceMut::new(b)).collect();
            match self.state.recv((&self.socket).into(), &mut slices, &mut meta) {
                Ok(count) => count,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
                    ) =>
                {
                    0
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => 0,
                Err(e) => return Err(e),
            }
        };
        let mut datagrams = 0;
        for (buffer, meta) in self.buffers.iter().zip(&meta).take(received) {
            for datagram in buffer[..meta.len].chunks(meta.stride.max(1)) {
                sink(datagram);
                datagrams += 1;
            }
        }
        Ok(datagrams)
    }
}
