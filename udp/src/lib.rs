//! A UDP endpoint with batched system calls, shared by the switch and the client.
//!
//! On one machine the kernel's cost per datagram, not summing, bounds UDP throughput, so
//! the endpoint receives with recvmmsg and GRO (many datagrams per call) and sends
//! equal-sized datagrams to one destination as one GSO [`SegmentBatch`], and batches of
//! any sizes and destinations together through sendmmsg, queued in an [`Outbox`]. The
//! socket is non-blocking, because recvmmsg on a blocking socket waits to fill every
//! buffer; a `poll(2)` with a timeout does the waiting instead.

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
/// Batches per sendmmsg call, whose headers are built on the stack.
const BATCHES_PER_CALL: usize = 64;
/// Bytes of a message's control data: one UDP_SEGMENT option, a `u16`.
// SAFETY: CMSG_SPACE only computes a length.
const SEGMENT_CONTROL_LEN: usize =
    unsafe { libc::CMSG_SPACE(std::mem::size_of::<u16>() as libc::c_uint) } as usize;

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
            Err(error) if segmentation_refused(&error) => {
                self.coalesce.store(false, Ordering::Relaxed);
                batch
                    .contents()
                    .chunks(segment)
                    .try_for_each(|datagram| self.send_one(destination, datagram, None))
            }
            other => other,
        }
    }

    /// Sends each batch to its destination, as many batches as one sendmmsg call takes
    /// (each one message, segmented by the kernel if it holds several datagrams): batches
    /// of several sizes and destinations cost one system call together, not one each.
    /// On an error the other batches still go, but for a send buffer that stays full,
    /// which loses the rest of that call's batches (retransmission repairs them); the
    /// first error is returned.
    pub fn send_all<'a>(
        &self,
        batches: impl IntoIterator<Item = (SocketAddr, &'a SegmentBatch)>,
    ) -> io::Result<()> {
        let mut batches = batches.into_iter().filter(|(_, batch)| !batch.is_empty()).peekable();
        let mut result = Ok(());
        while batches.peek().is_some() {
            let mut call = [None; BATCHES_PER_CALL];
            let count = call.iter_mut().zip(&mut batches).map(|(slot, batch)| *slot = Some(batch)).count();
            let sent = self.send_many(&call[..count]);
            result = result.and(sent);
        }
        result
    }

    /// One sendmmsg call's worth of [`BatchSocket::send_all`] (every entry `Some`), repeated
    /// for those the kernel did not take at once.
    fn send_many(&self, batches: &[Option<(SocketAddr, &SegmentBatch)>]) -> io::Result<()> {
        let coalesce = self.coalesce.load(Ordering::Relaxed);
        if !coalesce {
            // Without segmentation a message is one datagram: a batch of several goes as
            // `send` splits it, one datagram at a time.
            let mut result = Ok(());
            for (destination, batch) in batches.iter().flatten() {
                result = result.and(self.send(*destination, batch));
            }
            return result;
        }
        // SAFETY: plain C structs, for which all zeroes are valid (null pointers, zero
        // lengths).
        let mut names = [unsafe { std::mem::zeroed::<libc::sockaddr_storage>() }; BATCHES_PER_CALL];
        let mut iovecs = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; BATCHES_PER_CALL];
        // u64s: aligned as a cmsghdr must be.
        let mut controls = [[0u64; SEGMENT_CONTROL_LEN.div_ceil(8)]; BATCHES_PER_CALL];
        // SAFETY: as above.
        let mut headers = [unsafe { std::mem::zeroed::<libc::mmsghdr>() }; BATCHES_PER_CALL];
        for (index, (destination, batch)) in batches.iter().flatten().enumerate() {
            let contents = batch.contents();
            iovecs[index] =
                libc::iovec { iov_base: contents.as_ptr() as *mut libc::c_void, iov_len: contents.len() };
            let header = &mut headers[index].msg_hdr;
            header.msg_namelen = write_address(*destination, &mut names[index]);
            header.msg_name = std::ptr::from_mut(&mut names[index]).cast();
            header.msg_iov = &mut iovecs[index];
            header.msg_iovlen = 1;
            let Some(segment) = batch.segment_size().filter(|_| coalesce) else { continue };
            header.msg_control = controls[index].as_mut_ptr().cast();
            header.msg_controllen = SEGMENT_CONTROL_LEN as _;
            // SAFETY: `header` has a control buffer of SEGMENT_CONTROL_LEN bytes, aligned,
            // room for one option of a u16, whose header and data CMSG_FIRSTHDR and
            // CMSG_DATA find inside it.
            unsafe {
                let option = libc::CMSG_FIRSTHDR(header);
                (*option).cmsg_level = libc::SOL_UDP;
                (*option).cmsg_type = libc::UDP_SEGMENT;
                (*option).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as libc::c_uint) as _;
                libc::CMSG_DATA(option).cast::<u16>().write_unaligned(segment as u16);
            }
        }
        let mut result = Ok(());
        let (mut next, mut tries, mut refused) = (0, 0, false);
        while next < batches.len() {
            let waiting = &mut headers[next..batches.len()];
            // SAFETY: a valid descriptor, and `waiting.len()` headers whose pointers lead to
            // the names, iovecs and control buffers above and to the batches' bytes, all
            // alive and unmoved during the call.
            let sent = unsafe {
                libc::sendmmsg(
                    self.socket.as_raw_fd(),
                    waiting.as_mut_ptr(),
                    waiting.len() as libc::c_uint,
                    0,
                )
            };
            if sent > 0 {
                (next, tries, refused) = (next + sent as usize, 0, false);
                continue;
            }
            let error = io::Error::last_os_error();
            match error.kind() {
                io::ErrorKind::Interrupted => continue,
                // A full send buffer, as in `send_one`: wait a little, but never long.
                io::ErrorKind::WouldBlock if tries + 1 < SEND_ATTEMPTS => {
                    tries += 1;
                    if let Err(error) = wait_writable(&self.socket, Duration::from_millis(10)) {
                        return result.and(Err(error));
                    }
                    continue;
                }
                // Still full: the buffer is the socket's, shared by every destination, so
                // the rest of this call is lost as the first message is (retransmission
                // repairs it) rather than each waiting its own turn.
                io::ErrorKind::WouldBlock => return result,
                // A connected socket reports an earlier datagram's ICMP error on this
                // send, which the kernel did not make: try it once more.
                io::ErrorKind::ConnectionRefused if !refused => {
                    refused = true;
                    continue;
                }
                // Lost, as a send to a gone peer is.
                io::ErrorKind::ConnectionRefused => {}
                // Segmentation refused: `send` finds out why and sends one by one.
                _ if segmentation_refused(&error) => {
                    let fallback =
                        batches[next].map_or(Ok(()), |(destination, batch)| self.send(destination, batch));
                    result = result.and(fallback);
                }
                _ => result = result.and(Err(error)),
            }
            (next, tries, refused) = (next + 1, 0, false);
        }
        result
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

/// Whether a send that asked the kernel to segment (UDP_SEGMENT) failed for that alone:
/// segments larger than the path MTU (EMSGSIZE, or EINVAL on older kernels), or
/// a device without checksum offload, where the kernel cannot segment at all (EIO; a VM's
/// virtio NIC).
fn segmentation_refused(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EMSGSIZE | libc::EIO | libc::EINVAL))
}

/// Writes `address` as the kernel takes it into `name`; returns its length.
fn write_address(address: SocketAddr, name: &mut libc::sockaddr_storage) -> libc::socklen_t {
    match address {
        SocketAddr::V4(address) => {
            let v4 = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: address.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*address.ip()).to_be() },
                sin_zero: [0; 8],
            };
            // SAFETY: a sockaddr_storage is large and aligned enough for any address.
            unsafe { std::ptr::from_mut(name).cast::<libc::sockaddr_in>().write(v4) };
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t
        }
        SocketAddr::V6(address) => {
            let v6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: address.port().to_be(),
                sin6_flowinfo: address.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: address.ip().octets() },
                sin6_scope_id: address.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::from_mut(name).cast::<libc::sockaddr_in6>().write(v6) };
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t
        }
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

    #[test]
    fn batches_of_mixed_sizes_and_destinations_arrive_exactly() {
        send_mixed_batches(true);
    }

    /// Batches made while the kernel segmented, sent once it refuses to (a device without
    /// checksum offload found on an earlier send): each datagram still arrives on its own.
    #[test]
    fn batches_of_several_datagrams_arrive_exactly_once_segmentation_is_refused() {
        send_mixed_batches(false);
    }

    fn send_mixed_batches(coalesce: bool) {
        let receivers: Vec<BatchSocket> =
            (0..2).map(|_| BatchSocket::bind("127.0.0.1:0".parse().unwrap(), 1 << 20).unwrap()).collect();
        let sender = BatchSocket::bind("127.0.0.1:0".parse().unwrap(), 1 << 20).unwrap();
        // A sparse job's kinds: full data packets with a shorter last one, header-only
        // acks, a single datagram of another size; more batches than one call takes.
        let mut batches = Vec::new();
        for round in 0..100u8 {
            let sizes: &[usize] = match round % 4 {
                0 => &[1072, 1072, 1072, 600],
                1 => &[48; 5],
                2 => &[300],
                _ => &[1072; 2],
            };
            let mut batch = SegmentBatch::new(sender.max_segments());
            for (index, &len) in sizes.iter().enumerate() {
                batch.push(&vec![round.wrapping_mul(7).wrapping_add(index as u8); len]);
            }
            batches.push((receivers[usize::from(round % 2)].local_addr().unwrap(), batch));
        }
        batches.push((receivers[0].local_addr().unwrap(), SegmentBatch::new(4)));
        sender.coalesce.store(coalesce, Ordering::Relaxed);
        sender.send_all(batches.iter().map(|(destination, batch)| (*destination, batch))).unwrap();

        for (index, receiver) in receivers.into_iter().enumerate() {
            let mut receiver = receiver;
            let expected: Vec<Vec<u8>> = batches
                .iter()
                .filter(|(destination, _)| *destination == receiver.local_addr().unwrap())
                .flat_map(|(_, batch)| batch.datagrams().map(<[u8]>::to_vec))
                .collect();
            let mut received = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(5);
            while received.len() < expected.len() && Instant::now() < deadline {
                receiver
                    .recv(Duration::from_millis(100), |_, datagram| received.push(datagram.to_vec()))
                    .unwrap();
            }
            assert_eq!(received.len(), expected.len(), "receiver {index}");
            assert!(received == expected, "receiver {index}: every datagram, in order, byte for byte");
        }
    }
}
