//! AF_PACKET sockets bound to one device, and the other system calls of the delay line:
//! the only unsafe code of the module, each call wrapped once.

use std::ffi::CString;
use std::io;
use std::mem;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, SystemTime};

/// Length of the `virtio_net_hdr` that PACKET_VNET_HDR puts before every frame.
pub(super) const VNET_HDR_LEN: usize = 10;

/// Every protocol, in network byte order as `sockaddr_ll` and `socket` want it.
const ETH_P_ALL_BE: u16 = (libc::ETH_P_ALL as u16).to_be();

/// Asks for the kernel's receive and send buffers this big; frames wait in our own queue,
/// so these only absorb what arrives between two reads (at most 2 ms apart
/// while frames are held).
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

/// What `receive_batch` learnt of one frame it read into a [`ReceiveBatch`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Received {
    /// Bytes of the frame's buffer filled: the `virtio_net_hdr`, then the Ethernet frame.
    pub len: usize,
    /// The frame did not fit its buffer and was cut.
    pub truncated: bool,
    /// The frame was sent out of the device rather than received on it.
    pub outgoing: bool,
    /// The kernel's receive time stamp (SO_TIMESTAMPNS) on the system clock, if it gave one.
    pub stamp: Option<SystemTime>,
}

/// Buffers for reading up to `capacity` frames with one `recvmmsg`, reused call after call:
/// the frames, and the descriptors the call takes, so that a call allocates nothing.
pub(super) struct ReceiveBatch {
    frames: Vec<Vec<u8>>,
    /// One control buffer per frame, with room for a timestamp message (u64s: aligned as
    /// cmsghdr wants).
    controls: Vec<[u64; 8]>,
    senders: Vec<libc::sockaddr_ll>,
    /// One per frame; their pointers are written afresh by each call, from that call's
    /// borrows of the buffers above, and mean nothing between calls.
    iovecs: Vec<libc::iovec>,
    messages: Vec<libc::mmsghdr>,
    received: Vec<Received>,
}

impl ReceiveBatch {
    pub fn new(capacity: usize, frame_bytes: usize) -> Self {
        // SAFETY: sockaddr_ll is a plain C struct for which all zeroes is valid.
        let no_sender: libc::sockaddr_ll = unsafe { mem::zeroed() };
        let no_buffer = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        // SAFETY: mmsghdr is a plain C struct for which all zeroes (null pointers) is valid.
        let no_message: libc::mmsghdr = unsafe { mem::zeroed() };
        ReceiveBatch {
            frames: vec![vec![0; frame_bytes]; capacity],
            controls: vec![[0; 8]; capacity],
            senders: vec![no_sender; capacity],
            iovecs: vec![no_buffer; capacity],
            messages: vec![no_message; capacity],
            received: Vec::with_capacity(capacity),
        }
    }

    /// The frames the last `receive_batch` read, each with its bytes.
    pub fn iter(&self) -> impl Iterator<Item = (&Received, &[u8])> {
        self.received.iter().zip(&self.frames).map(|(received, frame)| (received, &frame[..received.len]))
    }
}

impl PacketSocket {
    /// A socket that reads every frame arriving on the device `ifindex`, but none leaving it
    /// (such as those the opposite direction sends).
    pub fn receiver(ifindex: libc::c_int) -> io::Result<Self> {
        let socket = Self::open(ETH_P_ALL_BE, ifindex)?;
        // Kernels before 4.20 lack the option; `receive_batch` then tells outgoing frames apart.
        let _ = socket.set_option(libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, 1);
        // The time each frame reached the device, so that frames may wait in the socket
        // while the thread sleeps (see `ReadWindow::arrival`, which decides whether to trust it).
        socket.set_option(libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, 1)?;
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

    /// Reads every frame waiting, up to the batch's capacity, with one system call and
    /// without blocking; the count read, 0 when none was waiting.
    pub fn receive_batch(&self, batch: &mut ReceiveBatch) -> io::Result<usize> {
        let ReceiveBatch { frames, controls, senders, iovecs, messages, received } = batch;
        received.clear();
        // Every field the kernel reads is set, and those it writes back (the lengths) reset.
        for ((((message, iovec), frame), control), sender) in messages
            .iter_mut()
            .zip(iovecs.iter_mut())
            .zip(frames.iter_mut())
            .zip(controls.iter_mut())
            .zip(senders.iter_mut())
        {
            *iovec = libc::iovec { iov_base: frame.as_mut_ptr().cast(), iov_len: frame.len() };
            let header = &mut message.msg_hdr;
            header.msg_name = (sender as *mut libc::sockaddr_ll).cast();
            header.msg_namelen = mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            header.msg_iov = iovec;
            header.msg_iovlen = 1;
            header.msg_control = control.as_mut_ptr().cast();
            header.msg_controllen = mem::size_of_val(control);
            header.msg_flags = 0;
            message.msg_len = 0;
        }
        // SAFETY: every pointer in `messages` was just taken from a buffer of `batch`, alive
        // and borrowed mutably for the call, with its true length; the kernel writes within
        // those lengths and into at most messages.len() entries.
        let count = unsafe {
            libc::recvmmsg(
                self.fd.as_raw_fd(),
                messages.as_mut_ptr(),
                messages.len() as libc::c_uint,
                libc::MSG_DONTWAIT | libc::MSG_TRUNC,
                std::ptr::null_mut(),
            )
        };
        if count < 0 {
            let error = io::Error::last_os_error();
            return match error.kind() {
                io::ErrorKind::WouldBlock => Ok(0),
                _ => Err(error),
            };
        }
        for ((message, frame), sender) in
            messages.iter().zip(frames.iter()).take(count as usize).zip(senders.iter())
        {
            // MSG_TRUNC makes the kernel report the frame's whole length even if it was cut.
            let whole = message.msg_len as usize;
            received.push(Received {
                len: whole.min(frame.len()),
                truncated: whole > frame.len(),
                outgoing: sender.sll_pkttype == libc::PACKET_OUTGOING,
                stamp: receive_stamp(&message.msg_hdr),
            });
        }
        Ok(received.len())
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

/// Waits until a frame can be read from one of the `sockets` given or `timeout` has passed
/// (with none given, simply sleeps); true if one can be read or has an error to report.
pub(super) fn wait_readable<const N: usize>(
    sockets: [Option<&PacketSocket>; N],
    timeout: Duration,
) -> io::Result<bool> {
    // An array rather than a Vec: this runs every pass of the line's loop. ppoll skips an
    // entry whose descriptor is negative, which stands for a socket not given.
    let mut polls = sockets.map(|socket| libc::pollfd {
        fd: socket.map_or(-1, |socket| socket.fd.as_raw_fd()),
        events: libc::POLLIN,
        revents: 0,
    });
    // ppoll rather than poll: a timeout in nanoseconds, not whole milliseconds.
    let timeout = libc::timespec {
        tv_sec: timeout.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos().into(),
    };
    // SAFETY: `polls` (N entries) and `timeout` are alive for the call; a null signal mask
    // is allowed.
    let ready =
        unsafe { libc::ppoll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, &timeout, std::ptr::null()) };
    if ready < 0 {
        let error = io::Error::last_os_error();
        return match error.kind() {
            io::ErrorKind::Interrupted => Ok(false),
            _ => Err(error),
        };
    }
    Ok(ready > 0)
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

/// The SCM_TIMESTAMPNS control message of a received message, if it has one.
fn receive_stamp(message: &libc::msghdr) -> Option<SystemTime> {
    // SAFETY: `message` was filled by recvmmsg, so CMSG_FIRSTHDR and CMSG_NXTHDR walk control
    // messages within msg_control's msg_controllen bytes, and an SCM_TIMESTAMPNS message's
    // data is a timespec (read unaligned, as CMSG_DATA need not align it).
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(message);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_TIMESTAMPNS {
                let time = std::ptr::read_unaligned(libc::CMSG_DATA(header).cast::<libc::timespec>());
                let since_epoch =
                    Duration::new(u64::try_from(time.tv_sec).ok()?, u32::try_from(time.tv_nsec).ok()?);
                return SystemTime::UNIX_EPOCH.checked_add(since_epoch);
            }
            header = libc::CMSG_NXTHDR(message, header);
        }
    }
    None
}
