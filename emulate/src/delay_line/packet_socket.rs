//! AF_PACKET sockets bound to one device, and the other system calls of the delay line:
//! the only unsafe code of the module, each call wrapped once.

use std::ffi::CString;
use std::io;
use std::mem;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// Length of the `virtio_net_hdr` that PACKET_VNET_HDR puts before every frame.
pub(super) const VNET_HDR_LEN: usize = 10;

/// Every protocol, in network byte order as `sockaddr_ll` and `socket` want it.
const ETH_P_ALL_BE: u16 = (libc::ETH_P_ALL as u16).to_be();

/// Asks for the kernel's receive and send buffers this big; frames wait in our own queue,
/// so these only absorb bursts between two wake-ups of the thread.
const SOCKET_BUFFER_BYTES: libc::c_int = 16 << 20;

/// A raw packet socket bound to one device, whose frames carry a `virtio_net_hdr`.
///
/// Frames that the local TCP/UDP stack hands a veth have partial checksums and may be 64 KB
/// segmentation-offload super-frames. Read and written back with their `virtio_net_hdr`,
/// the kernel finishes the checksum and segmentation on the way out; copied bare, they would
/// arrive with bad checksums or be refused as too long.
pub(super) struct PacketSocket {
    fd: OwnedFd,
}

/// One frame read into the caller's buffer.
pub(super) struct Received {
    /// Bytes of the buffer filled: the `virtio_net_hdr`, then the Ethernet frame.
    pub len: usize,
    /// The frame did not fit the buffer and was cut.
    pub truncated: bool,
    /// The frame was sent out of the device rather than received on it.
    pub outgoing: bool,
}

impl PacketSocket {
    /// A socket that reads every frame arriving on the device `ifindex`, but none leaving it
    /// (such as those the opposite direction sends).
    pub fn receiver(ifindex: libc::c_int) -> io::Result<Self> {
        let socket = Self::open(ETH_P_ALL_BE, ifindex)?;
        // Kernels before 4.20 lack the option; `receive` then tells outgoing frames apart.
        let _ = socket.set_option(libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, 1);
        socket.set_buffer(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF)?;
        Ok(socket)
    }

    /// A socket that writes frames out of the device `ifindex` and reads nothing: protocol 0
    /// keeps the kernel from queueing it a copy of every frame.
    pub fn sender(ifindex: libc::c_int) -> io::Result<Self> {
        let socket = Self::open(0, ifindex)?;
        // Frames queued in a rate limiter on the device count against the send buffer; a
        // small one would block us before the limiter's own queue is full.
        socket.set_buffer(libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)?;
        Ok(socket)
    }

    /// A packet socket that takes frames of `protocol_be` from the device `ifindex` only.
    fn open(protocol_be: u16, ifindex: libc::c_int) -> io::Result<Self> {
        // Protocol 0 at first, and the protocol only in `bind`: a socket opened with one
        // takes every device's frames until it is bound, and would forward other links'.
        // SAFETY: socket() takes no pointers.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a descriptor socket() just returned, owned by nothing else.
        let socket = PacketSocket { fd: unsafe { OwnedFd::from_raw_fd(fd) } };
        socket.set_option(libc::SOL_PACKET, libc::PACKET_VNET_HDR, 1)?;
        let address = libc::sockaddr_ll {
            sll_family: libc::AF_PACKET as u16,
            sll_protocol: protocol_be,
            sll_ifindex: ifindex,
            sll_hatype: 0,
            sll_pkttype: 0,
            sll_halen: 0,
            sll_addr: [0; 8],
        };
        // SAFETY: the pointer and length describe `address`, alive for the call.
        let bound = unsafe {
            libc::bind(
                socket.fd.as_raw_fd(),
                (&address as *const libc::sockaddr_ll).cast(),
                mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if bound < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(socket)
    }

    fn set_option(&self, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
        // SAFETY: the pointer and length describe `value`, alive for the call.
        let result = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                level,
                name,
                (&value as *const libc::c_int).cast(),
                mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if result < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Sets a buffer's size with the option that may pass the system's maximum (as root),
    /// else with the one capped by it.
    fn set_buffer(&self, forced: libc::c_int, capped: libc::c_int) -> io::Result<()> {
        self.set_option(libc::SOL_SOCKET, forced, SOCKET_BUFFER_BYTES)
            .or_else(|_| self.set_option(libc::SOL_SOCKET, capped, SOCKET_BUFFER_BYTES))
    }

    /// Reads one frame without blocking; `None` when none is waiting.
    pub fn receive(&self, buffer: &mut [u8]) -> io::Result<Option<Received>> {
        let mut from = libc::sockaddr_ll {
            sll_family: 0,
            sll_protocol: 0,
            sll_ifindex: 0,
            sll_hatype: 0,
            sll_pkttype: 0,
            sll_halen: 0,
            sll_addr: [0; 8],
        };
        let mut from_len = mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: the kernel writes at most buffer.len() bytes into `buffer` and at most
        // `from_len` into `from`, both borrowed mutably for the call.
        let length = unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                libc::MSG_DONTWAIT | libc::MSG_TRUNC,
                (&mut from as *mut libc::sockaddr_ll).cast(),
                &mut from_len,
            )
        };
        if length < 0 {
            let error = io::Error::last_os_error();
            return match error.kind() {
                io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(error),
            };
        }
        // MSG_TRUNC makes the kernel return the frame's whole length even if it was cut.
        let whole = length as usize;
        Ok(Some(Received {
            len: whole.min(buffer.len()),
            truncated: whole > buffer.len(),
            outgoing: from.sll_pkttype == libc::PACKET_OUTGOING,
        }))
    }

    /// Writes one frame, its `virtio_net_hdr` first, out of the bound device.
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: the kernel reads frame.len() bytes from `frame`, borrowed for the call.
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits until a frame can be read or `timeout` has passed; true if one can be read or
    /// the socket has an error to report.
    pub fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        let mut poll = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // ppoll rather than poll: a timeout in nanoseconds, not whole milliseconds.
        let timeout = libc::timespec {
            tv_sec: timeout.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos().into(),
        };
        // SAFETY: `poll` and `timeout` are alive for the call; a null signal mask is allowed.
        let ready = unsafe { libc::ppoll(&mut poll, 1, &timeout, std::ptr::null()) };
        if ready < 0 {
            let error = io::Error::last_os_error();
            return match error.kind() {
                io::ErrorKind::Interrupted => Ok(false),
                _ => Err(error),
            };
        }
        Ok(ready > 0)
    }

    /// Frames the kernel dropped since the last call because the receive buffer was full.
    pub fn take_kernel_drops(&self) -> io::Result<u64> {
        let mut stats = libc::tpacket_stats { tp_packets: 0, tp_drops: 0 };
        let mut length = mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
        // SAFETY: the kernel writes at most `length` bytes into `stats`, alive for the call.
        // Reading PACKET_STATISTICS resets the kernel's counters, hence "since the last call".
        let result = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_STATISTICS,
                (&mut stats as *mut libc::tpacket_stats).cast(),
                &mut length,
            )
        };
        if result < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stats.tp_drops.into())
    }
}

/// The index of a device of the calling thread's network namespace.
pub(super) fn interface_index(name: &str) -> io::Result<libc::c_int> {
    let name = CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a device name"))?;
    // SAFETY: `name` is a NUL-terminated string alive for the call.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(io::Error::last_os_error());
    }
    libc::c_int::try_from(index).map_err(|_| io::Error::other("device index out of range"))
}

/// Lets the calling thread's timed waits end within a microsecond of their deadline instead
/// of the default 50 µs slack, which would add to every frame's lateness.
pub(super) fn tighten_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes an integer, no pointers. Failing leaves the default
    // slack, which only makes frames a little later, so the result is ignored.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong);
    }
}

/// Puts the calling thread in the real-time class (`SCHED_FIFO`), so that a frame due now
/// is sent now even when the programs on the emulated network keep every core busy (an
/// MPI rank polls while it waits): netem runs in the kernel's softirqs, ahead of every
/// process, and this is the nearest a thread comes to that. The thread sleeps between
/// frames, and the kernel's real-time throttling keeps 5 % of each core for the rest
/// even under a flood. Without the privilege the thread keeps its ordinary class, and
/// the lateness the delay line reports shows the cost.
pub(super) fn run_before_ordinary_threads() {
    let parameters = libc::sched_param { sched_priority: 10 };
    // SAFETY: the pointer is to a live sched_param for the duration of the call; pid 0 is
    // the calling thread. Failing (no CAP_SYS_NICE) leaves the thread as it was.
    unsafe {
        libc::sched_setscheduler(0, libc::SCHED_FIFO, &parameters);
    }
}
