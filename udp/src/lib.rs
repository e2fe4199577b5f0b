//! A UDP endpoint with batched system calls, shared by the switch and the client.
//!
//! On one machine the kernel's cost per datagram, not summing, bounds UDP throughput, so
//! the endpoint receives with recvmmsg and GRO (many datagrams per call) and sends
//! equal-sized datagrams to one destination as one GSO [`SegmentBatch`], queued in an
//! [`Outbox`]. The socket is non-blocking, because recvmmsg on a blocking socket waits to
//! fill every buffer; a `poll(2)` with a timeout does the waiting instead.

pub mod batch;
pub mod outbox;

use std::io::{self, IoSliceMut};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use netagg_wire::MAX_DATAGRAM_LEN;
use quinn_udp::{RecvMeta, Transmit, UdpSocketState};

pub use batch::SegmentBatch;
pub use outbox::Outbox;

/// Receive buffers per call; each holds one datagram or a GRO batch of up to 64 KiB.
const RECV_BUFFERS: usize = 16;
/// Tries of a send that finds the socket's buffer full, 10 ms apart.
const SEND_ATTEMPTS: usize = 10;

/// Lets the kernel fragment datagrams larger than the path MTU. quinn-udp forbids it for
/// QUIC's path-MTU probing; netagg's packets may be up to 64 KiB on any link.
fn allow_fragmentation(socket: &UdpSocket, address: SocketAddr) -> io::Result<()> {
    let (level, option, value) = match address {
        SocketAddr::V4(_) => (libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DONT),
        SocketAddr::V6(_) => (libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IPV6_PMTUDISC_DONT),
    };
    // SAFETY: a valid descriptor, and a c_int option value whose size is passed with it.
    let result = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A bound, non-blocking UDP socket with batched receive and send.
pub struct BatchSocket {
    socket: UdpSocket,
    state: UdpSocketState,
    buffers: [Vec<u8>; RECV_BUFFERS],
    /// Cleared when the kernel refuses a GSO batch: segmentation never fragments, so
    /// segments larger than the path MTU must go one by one, as must every datagram on a
    /// device without checksum offload.
    coalesce: AtomicBool,
}

impl BatchSocket {
    /// Binds at `address`, asking for `buffer_bytes` of kernel buffers each way (capped by
    /// the kernel at `net.core.rmem_max` / `wmem_max`; 0 keeps the defaults).
    pub fn bind(address: SocketAddr, buffer_bytes: usize) -> io::Result<BatchSocket> {
        let socket = UdpSocket::bind(address)?;
        socket.set_nonblocking(true)?;
        let state = UdpSocketState::new((&socket).into())?;
        allow_fragmentation(&socket, address)?;
        if buffer_bytes > 0 {
            // Best effort: a smaller buffer only means more loss under bursts.
            let _ = state.set_recv_buffer_size((&socket).into(), buffer_bytes);
            let _ = state.set_send_buffer_size((&socket).into(), buffer_bytes);
        }
        Ok(BatchSocket {
            socket,
            state,
            buffers: std::array::from_fn(|_| vec![0u8; MAX_DATAGRAM_LEN]),
            coalesce: AtomicBool::new(true),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// Accepts datagrams from `peer` only.
    pub fn connect(&self, peer: SocketAddr) -> io::Result<()> {
        self.socket.connect(peer)
    }

    /// Most datagrams one [`SegmentBatch`] may hold on this socket (1 without GSO).
    pub fn max_segments(&self) -> usize {
        if self.coalesce.load(Ordering::Relaxed) {
            self.state.max_gso_segments().clamp(1, 64)
        } else {
            1
        }
    }

    /// Waits up to `timeout` for datagrams and hands each, with its source, to `sink`;
    /// returns how many arrived (0 when the time ran out).
    pub fn recv(&mut self, timeout: Duration, mut sink: impl FnMut(SocketAddr, &[u8])) -> io::Result<usize> {
        let mut count = self.try_recv(&mut sink)?;
        if count == 0 && wait_readable(&self.socket, timeout)? {
            count = self.try_recv(&mut sink)?;
        }
        Ok(count)
    }

    fn try_recv(&mut self, sink: &mut impl FnMut(SocketAddr, &[u8])) -> io::Result<usize> {
        let mut meta = [RecvMeta::default(); RECV_BUFFERS];
        let received = {
            // On the stack: this runs once per receive call.
            let mut slices = self.buffers.each_mut().map(|buffer| IoSliceMut::new(buffer));
            match self.state.recv((&self.socket).into(), &mut slices, &mut meta) {
                Ok(count) => count,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => 0,
                // An ICMP port-unreachable from an earlier send: the peer is gone, which
                // the protocol above notices by its own timeouts.
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => 0,
                Err(e) => return Err(e),
            }
        };
        let mut datagrams = 0;
        for (buffer, meta) in self.buffers.iter().zip(&meta).take(received) {
            if meta.len == 0 {
                // An empty datagram is a datagram too: the receiver counts and drops it.
                sink(meta.addr, &[]);
                datagrams += 1;
                continue;
            }
            // With GRO one buffer holds several datagrams of `stride` bytes each.
            for datagram in buffer[..meta.len].chunks(meta.stride.max(1)) {
                sink(meta.addr, datagram);
                datagrams += 1;
            }
        }
        Ok(datagrams)
    }

    /// Sends a batch to `destination`, in one system call where the kernel can.
    pub fn send(&self, destination: SocketAddr, batch: &SegmentBatch) -> io::Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let Some(segment) = batch.segment_size().filter(|_| self.coalesce.load(Ordering::Relaxed)) else {
            let segment = batch.segment_size().unwrap_or(batch.contents().len());
            return batch
                .contents()
                .chunks(segment)
                .try_for_each(|datagram| self.send_one(destination, datagram, None));
        };
        match self.send_one(destination, batch.contents(), Some(segment)) {
            // Segments larger than the path MTU (EMSGSIZE), or a device without checksum
            // offload, where the kernel cannot segment at all (EIO; a VM's virtio NIC).
            Err(error) if matches!(error.raw_os_error(), Some(libc::EMSGSIZE | libc::EIO)) => {
                self.coalesce.store(false, Ordering::Relaxed);
                batch
                    .contents()
                    .chunks(segment)
                    .try_for_each(|datagram| self.send_one(destination, datagram, None))
            }
            other => other,
        }
    }

    fn send_one(
        &self,
        destination: SocketAddr,
        contents: &[u8],
        segment_size: Option<usize>,
    ) -> io::Result<()> {
        let transmit = Transmit { destination, ecn: None, contents, segment_size, src_ip: None };
        // A full send buffer: wait a little for room rather than drop what the window
        // already allows in flight, but never long: past that the batch counts as lost,
        // which retransmission repairs, so that no caller blocks on a stuck peer.
        for _ in 0..SEND_ATTEMPTS {
            match self.state.try_send((&self.socket).into(), &transmit) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait_writable(&self.socket, Duration::from_millis(10))?
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Ok(()),
                other => return other,
            }
        }
        Ok(())
    }
}

fn wait_readable(socket: &UdpSocket, timeout: Duration) -> io::Result<bool> {
    wait(socket, libc::POLLIN, timeout)
}

fn wait_writable(socket: &UdpSocket, timeout: Duration) -> io::Result<()> {
    wait(socket, libc::POLLOUT, timeout).map(|_| ())
}

fn wait(socket: &UdpSocket, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
    let mut descriptor = libc::pollfd { fd: socket.as_raw_fd(), events, revents: 0 };
    // ppoll rather than poll: a timeout in nanoseconds, not whole milliseconds, so that a
    // paced sender wakes when its next packet is due.
    let timeout = libc::timespec {
        tv_sec: timeout.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos().into(),
    };
    // SAFETY: one valid pollfd, for a descriptor `socket` keeps open during the call, and a
    // timespec alive for it; a null signal mask is allowed.
    let ready = unsafe { libc::ppoll(&mut descriptor, 1, &timeout, std::ptr::null()) };
    match ready {
        -1 => {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(error)
            }
        }
        0 => Ok(false),
        _ => Ok(true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_batch_arrives_as_its_datagrams_and_an_idle_wait_times_out() {
        let mut receiver = BatchSocket::bind("127.0.0.1:0".parse().unwrap(), 1 << 20).unwrap();
        let sender = BatchSocket::bind("127.0.0.1:0".parse().unwrap(), 1 << 20).unwrap();
        let mut batch = SegmentBatch::new(sender.max_segments());
        let mut sent = Vec::new();
        for i in 0..5u8 {
            let datagram = vec![i; if i == 4 { 300 } else { 1000 }];
            if !batch.accepts(datagram.len()) {
                sender.send(receiver.local_addr().unwrap(), &batch).unwrap();
                batch.clear();
            }
            batch.push(&datagram);
            sent.push(datagram);
        }
        sender.send(receiver.local_addr().unwrap(), &batch).unwrap();
        let mut received = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while received.len() < sent.len() && Instant::now() < deadline {
            receiver
                .recv(Duration::from_millis(100), |from, datagram| {
                    assert_eq!(from, sender.local_addr().unwrap());
                    received.push(datagram.to_vec());
                })
                .unwrap();
        }
        assert_eq!(received, sent);

        let started = Instant::now();
        assert_eq!(receiver.recv(Duration::from_millis(30), |_, _| panic!("nothing was sent")).unwrap(), 0);
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(29), "returned after {waited:?}");
    }
}
