//! A reliable connection (an RC queue pair) set up through rdma_cm, carrying whole
//! messages with two-sided SEND and RECV from a registered buffer: the simplest verbs a
//! peer without remote keys needs, and the ones Soft-RoCE carries best.
//!
//! Every wait has a timeout: rdma_cm's events are read from its channel's descriptor
//! after `poll`, never by blocking in `rdma_get_cm_event` itself, and completions are
//! waited for either by polling the completion queue ([`Wait::Busy`]) or by sleeping in
//! `poll` on a completion channel ([`Wait::Event`]) together with rdma_cm's descriptor,
//! so that a peer leaving wakes the wait too.
//!
//! Sends are written straight into registered send buffers ([`Connection::send_buffer`])
//! and posted together, one chain of work requests per [`Connection::flush`].

use std::ffi::CStr;
use std::io;
use std::marker::PhantomData;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_access_flags, ibv_comp_channel, ibv_cq, ibv_mr, ibv_pd, ibv_qp_init_attr, ibv_qp_type, ibv_recv_wr,
    ibv_send_wr, ibv_sge, ibv_wc, ibv_wc_opcode, ibv_wc_status, ibv_wr_opcode, rdma_cm_event,
    rdma_cm_event_type, rdma_cm_id, rdma_conn_param, rdma_event_channel, rdma_port_space,
};

/// How long rdma_cm may take to resolve an address or a route.
const RESOLVE_TIMEOUT_MS: i32 = 2000;
/// How many times a send is retried while the peer has no receive posted: finite (7
/// would mean for ever), so that a peer that stops receiving fails the send.
const RNR_RETRIES: u8 = 6;

/// How often a busy wait looks at rdma_cm's channel for a departed peer.
const PEER_CHECK_INTERVAL: Duration = Duration::from_millis(1);
/// How long an event-mode sender naps while every send buffer is in flight.
const SEND_WAIT_NAP: Duration = Duration::from_micros(20);

/// How a connection waits for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Polls the completion queue without pause: the lowest latency, a core per waiter.
    Busy,
    /// Sleeps until the device signals a completion on the connection's completion
    /// channel: for cores shared with other work.
    Event,
}

/// What a connection is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Receive buffers kept posted, and send buffers: sends in flight at most.
    pub depth: usize,
    /// Bytes of each buffer: the longest message.
    pub message_size: usize,
    pub wait: Wait,
}

/// An error of the connection: what failed, and why.
fn failed(what: &str, error: io::Error) -> io::Error {
    io::Error::new(error.kind(), format!("{what}: {error}"))
}

/// What is left of the time until `deadline` (`None`: no deadline, for ever).
fn remaining(deadline: Option<Instant>) -> Duration {
    deadline.map_or(Duration::MAX, |deadline| deadline.saturating_duration_since(Instant::now()))
}

/// Refuses a connection request, telling the peer `reason` (its first 148 bytes, what
/// the connection manager carries).
///
/// # Safety
/// `id` is a request's id not yet accepted.
unsafe fn reject(id: NonNull<rdma_cm_id>, reason: &str) {
    let reason = &reason.as_bytes()[..reason.len().min(148)];
    rdma_sys::rdma_reject(id.as_ptr(), reason.as_ptr().cast(), reason.len() as u8);
}

/// [`reject`], then destroys the id.
///
/// # Safety
/// As for [`reject`], and `id` is not used again.
unsafe fn refuse(id: NonNull<rdma_cm_id>, reason: &str) {
    reject(id, reason);
    rdma_sys::rdma_destroy_id(id.as_ptr());
}

/// The errno of a verbs or rdma_cm call that returned `result` (-1 with errno set, or an
/// errno itself).
fn call(what: &str, result: i32) -> io::Result<()> {
    match result {
        0 => Ok(()),
        -1 => Err(failed(what, io::Error::last_os_error())),
        code => Err(failed(what, io::Error::from_raw_os_error(code.abs()))),
    }
}

/// An rdma_cm event channel, destroyed on drop.
struct Channel(NonNull<rdma_event_channel>);

impl Channel {
    /// A channel whose descriptor does not block: librdmacm may read it again inside
    /// `rdma_get_cm_event`, which must then fail with EAGAIN rather than wait.
    fn new() -> io::Result<Channel> {
        let channel = unsafe { rdma_sys::rdma_create_event_channel() };
        let channel = NonNull::new(channel)
            .map(Channel)
            .ok_or_else(|| failed("creating an rdma_cm event channel", io::Error::last_os_error()))?;
        set_nonblocking(channel.fd(), "the rdma_cm channel")?;
        Ok(channel)
    }

    /// A new rdma_cm id for reliable connections, whose events come to this channel.
    fn create_id(&self) -> io::Result<NonNull<rdma_cm_id>> {
        let mut id = ptr::null_mut();
        call("creating an rdma_cm id", unsafe {
            rdma_sys::rdma_create_id(self.0.as_ptr(), &mut id, ptr::null_mut(), rdma_port_space::RDMA_PS_TCP)
        })?;
        Ok(NonNull::new(id).expect("rdma_create_id succeeded"))
    }

    fn fd(&self) -> RawFd {
        unsafe { (*self.0.as_ptr()).fd }
    }

    /// The next event, if one comes within `timeout`: its type, status, the id it is
    /// for, and its private data (a connection request's).
    fn next(&self, timeout: Duration) -> io::Result<Option<Event>> {
        let fd = self.fd();
        let deadline = Instant::now().checked_add(timeout);
        let mut event: *mut rdma_cm_event = ptr::null_mut();
        loop {
            let mut poll = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            let millis = i32::try_from(remaining(deadline).as_millis()).unwrap_or(i32::MAX);
            match unsafe { libc::poll(&mut poll, 1, millis) } {
                0 => return Ok(None),
                -1 if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => continue,
                -1 => return Err(failed("waiting for an rdma_cm event", io::Error::last_os_error())),
                _ => {}
            }
            if unsafe { rdma_sys::rdma_get_cm_event(self.0.as_ptr(), &mut event) } == 0 {
                break;
            }
            let error = io::Error::last_os_error();
            // Read by librdmacm for itself (a request it dropped), or woken by a signal.
            if !matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) {
                return Err(failed("reading an rdma_cm event", error));
            }
        }
        let (kind, status, id, private) = unsafe {
            let conn = (*event).param.conn;
            let private = if conn.private_data.is_null() {
                Vec::new()
            } else {
                std::slice::from_raw_parts(conn.private_data.cast::<u8>(), usize::from(conn.private_data_len))
                    .to_vec()
            };
            ((*event).event, (*event).status, (*event).id, private)
        };
        unsafe { rdma_sys::rdma_ack_cm_event(event) };
        Ok(Some(Event { kind, status, id, private }))
    }

    /// Waits for an event of type `expected`; any other is an error that names it.
    fn expect(&self, expected: rdma_cm_event_type::Type, timeout: Duration) -> io::Result<Event> {
        let Some(event) = self.next(timeout)? else {
            let wanted = unsafe { CStr::from_ptr(rdma_sys::rdma_event_str(expected)) }.to_string_lossy();
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("no {wanted} within {timeout:?}")));
        };
        if event.kind != expected {
            let name = unsafe { CStr::from_ptr(rdma_sys::rdma_event_str(event.kind)) }.to_string_lossy();
            let wanted = unsafe { CStr::from_ptr(rdma_sys::rdma_event_str(expected)) }.to_string_lossy();
            let mut message =
                format!("rdma_cm said {name} (status {}) where {wanted} was awaited", event.status);
            // A listener that refuses says why in its private data (zero-padded).
            let reason = String::from_utf8_lossy(&event.private);
            let reason = reason.trim_end_matches('\0');
            if event.kind == rdma_cm_event_type::RDMA_CM_EVENT_REJECTED && !reason.is_empty() {
                message = format!("{message}: {reason}");
            }
            return Err(io::Error::new(io::ErrorKind::ConnectionRefused, message));
        }
        Ok(event)
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        unsafe { rdma_sys::rdma_destroy_event_channel(self.0.as_ptr()) }
    }
}

struct Event {
    kind: rdma_cm_event_type::Type,
    status: i32,
    id: *mut rdma_cm_id,
    private: Vec<u8>,
}

/// What both sides of a connection ask of it: one outstanding read each way (netagg
/// reads nothing remote, but rdma_cm wants one), and finite RNR retries.
fn connection_parameters() -> rdma_conn_param {
    let mut parameters: rdma_conn_param = unsafe { std::mem::zeroed() };
    parameters.responder_resources = 1;
    parameters.initiator_depth = 1;
    parameters.rnr_retry_count = RNR_RETRIES;
    parameters
}

/// A socket address as rdma_cm takes it.
fn sockaddr(address: SocketAddr) -> libc::sockaddr_storage {
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match address {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(v4.ip().octets()) },
                sin_zero: [0; 8],
            };
            unsafe { ptr::write(ptr::addr_of_mut!(storage).cast(), sin) };
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr { s6_addr: v6.ip().octets() },
                sin6_scope_id: v6.scope_id(),
            };
            unsafe { ptr::write(ptr::addr_of_mut!(storage).cast(), sin6) };
        }
    }
    storage
}

/// A socket address from rdma_cm's; `None` for a family other than IPv4 and IPv6.
///
/// # Safety
/// `address` points to a `sockaddr_storage`'s worth of readable bytes.
unsafe fn socket_address(address: *const libc::sockaddr_storage) -> Option<SocketAddr> {
    // The family says which address the storage holds.
    unsafe {
        match i32::from((*address).ss_family) {
            libc::AF_INET => {
                let sin = &*address.cast::<libc::sockaddr_in>();
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
            }
            libc::AF_INET6 => {
                let sin6 = &*address.cast::<libc::sockaddr_in6>();
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
            }
            _ => None,
        }
    }
}

/// A listening rdma_cm id, where peers connect.
pub struct Listener {
    id: NonNull<rdma_cm_id>,
    channel: Channel,
}

unsafe impl Send for Listener {}

impl Listener {
    /// Listens at `address` (an RDMA device's IP address, or the unspecified address for
    /// every device, and a port).
    pub fn bind(address: SocketAddr) -> io::Result<Listener> {
        let channel = Channel::new()?;
        let id = channel.create_id()?;
        let listener = Listener { id, channel };
        let mut storage = sockaddr(address);
        call(&format!("binding {address}"), unsafe {
            rdma_sys::rdma_bind_addr(id.as_ptr(), ptr::addr_of_mut!(storage).cast())
        })?;
        call("listening", unsafe { rdma_sys::rdma_listen(id.as_ptr(), 64) })?;
        Ok(listener)
    }

    /// The address listened at, with the port actually bound.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        // SAFETY: the route's source is a union as large as a sockaddr_storage.
        let address = unsafe { ptr::addr_of!((*self.id.as_ptr()).route.addr.src_addr_union) };
        unsafe { socket_address(address.cast()) }
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "rdma_cm bound no IP address"))
    }

    /// The descriptor that becomes readable when a request arrives, for a `poll` that
    /// waits on connections too.
    pub fn fd(&self) -> RawFd {
        self.channel.fd()
    }

    /// The next connection request, if one waits (within `timeout`); events of other
    /// kinds (an address change) are not the listener's to answer.
    pub fn request(&self, timeout: Duration) -> io::Result<Option<Request<'_>>> {
        let deadline = Instant::now().checked_add(timeout);
        while let Some(event) = self.channel.next(remaining(deadline))? {
            if event.kind == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                let id = NonNull::new(event.id).expect("a request names its id");
                return Ok(Some(Request { id: Some(id), private: event.private, listener: PhantomData }));
            }
        }
        Ok(None)
    }

    /// Accepts the next connection within `timeout` and waits until it is established;
    /// returns it and the private data its peer sent.
    pub fn accept(&self, timeout: Duration, options: Options) -> io::Result<(Connection, Vec<u8>)> {
        let deadline = Instant::now().checked_add(timeout);
        let Some(request) = self.request(remaining(deadline))? else {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("no connection within {timeout:?}")));
        };
        let private = request.private().to_vec();
        let connection = request.accept(options)?;
        connection.channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, remaining(deadline))?;
        Ok((connection, private))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        unsafe { rdma_sys::rdma_destroy_id(self.id.as_ptr()) };
    }
}

/// A peer's connection request, to accept or reject; dropped, it is rejected. Until
/// accepted, its id's events come to the listener's channel, so it cannot outlive it.
pub struct Request<'listener> {
    id: Option<NonNull<rdma_cm_id>>,
    private: Vec<u8>,
    listener: PhantomData<&'listener Listener>,
}

unsafe impl Send for Request<'_> {}

impl Request<'_> {
    /// What the peer sent with its request: over RoCE, padded with zeros to 56 bytes.
    pub fn private(&self) -> &[u8] {
        &self.private
    }

    /// Accepts the connection without waiting for it to be established: the queue pair
    /// is ready to send once this returns, and the peer's first message can only follow
    /// its own establishment.
    pub fn accept(mut self, options: Options) -> io::Result<Connection> {
        let id = self.id.take().expect("a request not yet answered");
        // Its own channel at once, so that its events (a disconnect) are its own; a
        // request that cannot be served is rejected, so that its peer learns it now.
        let prepared = Channel::new().and_then(|channel| {
            call("migrating the connection's id", unsafe {
                rdma_sys::rdma_migrate_id(id.as_ptr(), channel.0.as_ptr())
            })?;
            Ok(channel)
        });
        let channel = match prepared {
            Ok(channel) => channel,
            Err(error) => {
                unsafe { refuse(id, &error.to_string()) };
                return Err(error);
            }
        };
        let mut connection = Connection::new(id, channel, options);
        if let Err(error) = connection.make_verbs() {
            // The peer learns why (memory it cannot lock, say); the connection's drop
            // then destroys the id.
            unsafe { reject(id, &error.to_string()) };
            return Err(error);
        }
        let mut parameters = connection_parameters();
        call("accepting", unsafe { rdma_sys::rdma_accept(id.as_ptr(), &mut parameters) })?;
        connection.established = true;
        Ok(connection)
    }

    /// Refuses the connection, telling the peer `reason` (its first 148 bytes, what
    /// the connection manager carries).
    pub fn reject(mut self, reason: &str) {
        let id = self.id.take().expect("a request not yet answered");
        unsafe { refuse(id, reason) };
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            unsafe { refuse(id, "") };
        }
    }
}

/// One connected RC queue pair and its registered buffer: `depth` receive buffers and
/// `depth` send buffers of `message_size` bytes each. The verbs objects are null until
/// made, so that a connection that fails half-way frees what it made, and only that.
pub struct Connection {
    id: NonNull<rdma_cm_id>,
    pd: *mut ibv_pd,
    /// Signals receive completions, in [`Wait::Event`] only.
    completions: *mut ibv_comp_channel,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    mr: *mut ibv_mr,
    /// The registered memory, owned here (from `Box::into_raw`) and reached only through
    /// raw pointers: the device writes receive buffers and reads send buffers behind
    /// Rust's back, so no reference may span them.
    buffer: NonNull<[u8]>,
    options: Options,
    /// Send buffers neither lent nor in flight.
    free_sends: Vec<usize>,
    /// The send buffer [`Connection::send_buffer`] lent last, until queued.
    lent: Option<usize>,
    /// Sends queued for the next flush: buffer and length.
    queued: Vec<(usize, usize)>,
    established: bool,
    /// Why the connection can no longer carry anything (the peer left, a completion
    /// failed): every call after says so at once.
    broken: Option<String>,
    last_peer_check: Instant,
    /// Last: destroyed after the id, whose events it carried.
    channel: Channel,
}

unsafe impl Send for Connection {}

impl Connection {
    /// Connects to the listener at `address` within `timeout`, from `source` if given
    /// (else where the route leads), sending `private` (at most 56 bytes) with the
    /// request. The listener receives it padded with zeros to 56 bytes over RoCE:
    /// private data that varies in length carries its own.
    pub fn connect(
        address: SocketAddr,
        source: Option<IpAddr>,
        private: &[u8],
        timeout: Duration,
        options: Options,
    ) -> io::Result<Connection> {
        // One deadline for every step: the whole connection within `timeout`.
        let deadline = Instant::now().checked_add(timeout);
        let channel = Channel::new()?;
        let id = channel.create_id()?;
        let mut storage = sockaddr(address);
        let mut source = source.map(|ip| sockaddr(SocketAddr::new(ip, 0)));
        let source_ptr = source.as_mut().map_or(ptr::null_mut(), |source| ptr::addr_of_mut!(*source).cast());
        let resolved = unsafe {
            rdma_sys::rdma_resolve_addr(
                id.as_ptr(),
                source_ptr,
                ptr::addr_of_mut!(storage).cast(),
                RESOLVE_TIMEOUT_MS,
            )
        };
        if let Err(error) = call(&format!("resolving {address}"), resolved)
            .and_then(|()| {
                channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED, remaining(deadline)).map(drop)
            })
            .and_then(|()| {
                call("resolving the route", unsafe {
                    rdma_sys::rdma_resolve_route(id.as_ptr(), RESOLVE_TIMEOUT_MS)
                })
            })
            .and_then(|()| {
                channel
                    .expect(rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED, remaining(deadline))
                    .map(drop)
            })
        {
            unsafe { rdma_sys::rdma_destroy_id(id.as_ptr()) };
            return Err(error);
        }
        let mut connection = Connection::new(id, channel, options);
        connection.make_verbs()?;
        let mut parameters = connection_parameters();
        parameters.private_data = private.as_ptr().cast();
        parameters.private_data_len = u8::try_from(private.len()).unwrap_or(u8::MAX).min(56);
        // Transport retries: the side that connects sets them for both.
        parameters.retry_count = 7;
        call(&format!("connecting to {address}"), unsafe {
            rdma_sys::rdma_connect(id.as_ptr(), &mut parameters)
        })?;
        connection.channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, remaining(deadline))?;
        connection.established = true;
        Ok(connection)
    }

    /// A connection that owns `id` and has made nothing yet: dropping it destroys the id
    /// and whatever [`Connection::make_verbs`] made.
    fn new(id: NonNull<rdma_cm_id>, channel: Channel, options: Options) -> Connection {
        Connection {
            id,
            pd: ptr::null_mut(),
            completions: ptr::null_mut(),
            send_cq: ptr::null_mut(),
            recv_cq: ptr::null_mut(),
            mr: ptr::null_mut(),
            buffer: NonNull::from(Box::leak(Box::<[u8]>::default())),
            options,
            free_sends: (0..options.depth).rev().collect(),
            lent: None,
            queued: Vec::with_capacity(options.depth),
            established: false,
            broken: None,
            last_peer_check: Instant::now(),
            channel,
        }
    }

    /// The buffer, protection domain, completion queues (and channel) and queue pair of a
    /// connection whose id has its device; every receive buffer posted.
    fn make_verbs(&mut self) -> io::Result<()> {
        let Options { depth, message_size, wait } = self.options;
        // Fallible, not an abort: the sizes come from a config file.
        let bytes = depth.checked_mul(message_size).and_then(|bytes| bytes.checked_mul(2));
        let mut buffer = Vec::new();
        if bytes.is_none_or(|bytes| buffer.try_reserve_exact(bytes).is_err()) {
            let what = format!("{depth} receive and {depth} send buffers of {message_size} bytes");
            return Err(io::Error::new(io::ErrorKind::OutOfMemory, format!("cannot allocate {what}")));
        }
        buffer.resize(bytes.expect("checked"), 0u8);
        // SAFETY: the empty buffer was never registered.
        drop(unsafe { Box::from_raw(self.buffer.as_ptr()) });
        self.buffer = NonNull::from(Box::leak(buffer.into_boxed_slice()));
        let made = |made: bool, what: &str| match made {
            true => Ok(()),
            false => Err(failed(what, io::Error::last_os_error())),
        };
        let verbs = unsafe { (*self.id.as_ptr()).verbs };
        self.pd = unsafe { rdma_sys::ibv_alloc_pd(verbs) };
        made(!self.pd.is_null(), "allocating a protection domain")?;
        if wait == Wait::Event {
            self.completions = unsafe { rdma_sys::ibv_create_comp_channel(verbs) };
            made(!self.completions.is_null(), "creating a completion channel")?;
            set_nonblocking(unsafe { (*self.completions).fd }, "the completion channel")?;
        }
        let cq_depth = i32::try_from(depth).unwrap_or(i32::MAX);
        self.send_cq =
            unsafe { rdma_sys::ibv_create_cq(verbs, cq_depth, ptr::null_mut(), ptr::null_mut(), 0) };
        made(!self.send_cq.is_null(), "creating a completion queue")?;
        self.recv_cq =
            unsafe { rdma_sys::ibv_create_cq(verbs, cq_depth, ptr::null_mut(), self.completions, 0) };
        made(!self.recv_cq.is_null(), "creating a completion queue")?;
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32;
        let (start, len) = (self.buffer.cast::<u8>().as_ptr(), self.buffer.len());
        self.mr = unsafe { rdma_sys::ibv_reg_mr(self.pd, start.cast(), len, access) };
        made(
            !self.mr.is_null(),
            &format!("registering {len} bytes of buffers (locked memory: ulimit -l, or run as root)"),
        )?;
        let mut attributes: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attributes.send_cq = self.send_cq;
        attributes.recv_cq = self.recv_cq;
        attributes.cap.max_send_wr = depth as u32;
        attributes.cap.max_recv_wr = depth as u32;
        attributes.cap.max_send_sge = 1;
        attributes.cap.max_recv_sge = 1;
        attributes.qp_type = ibv_qp_type::IBV_QPT_RC;
        // Every send completes, so that its buffer comes back.
        attributes.sq_sig_all = 1;
        call("creating the queue pair", unsafe {
            rdma_sys::rdma_create_qp(self.id.as_ptr(), self.pd, &mut attributes)
        })?;
        for buffer in 0..depth {
            self.post_receive(buffer)?;
        }
        Ok(())
    }

    /// The verbs device the connection runs on (`rxe0`, `mlx5_0`).
    pub fn device_name(&self) -> String {
        let name = unsafe { rdma_sys::ibv_get_device_name((*(*self.id.as_ptr()).verbs).device) };
        if name.is_null() {
            return String::new();
        }
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    }

    /// The longest message, in bytes.
    pub fn message_size(&self) -> usize {
        self.options.message_size
    }

    /// The address of byte 0 of buffer `index`: receive buffers first, then send buffers.
    fn buffer_start(&self, index: usize) -> *mut u8 {
        // SAFETY: every index used is below 2 * depth, within the allocation.
        unsafe { self.buffer.cast::<u8>().as_ptr().add(index * self.options.message_size) }
    }

    fn sge(&self, index: usize, len: usize) -> ibv_sge {
        ibv_sge {
            addr: self.buffer_start(index) as u64,
            length: len as u32,
            lkey: unsafe { (*self.mr).lkey },
        }
    }

    fn post_receive(&mut self, index: usize) -> io::Result<()> {
        let mut sge = self.sge(index, self.options.message_size);
        let mut request =
            ibv_recv_wr { wr_id: index as u64, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad = ptr::null_mut();
        call("posting a receive", unsafe {
            rdma_sys::ibv_post_recv((*self.id.as_ptr()).qp, &mut request, &mut bad)
        })
    }

    /// Lends the next send buffer, all [`Connection::message_size`] bytes of it, waiting
    /// up to `timeout` for one while every buffer is in flight. Whatever is written goes
    /// at [`Connection::queue`]; lent again, the same buffer comes back.
    pub fn send_buffer(&mut self, timeout: Duration) -> io::Result<&mut [u8]> {
        self.check_broken()?;
        if self.lent.is_none() {
            let deadline = Instant::now() + timeout;
            loop {
                self.reap_sends()?;
                if !self.free_sends.is_empty() {
                    break;
                }
                // Posted sends may still wait for the flush that lets them go.
                self.flush()?;
                self.check_peer()?;
                if Instant::now() >= deadline {
                    let message = format!("no send completed within {timeout:?}");
                    return Err(io::Error::new(io::ErrorKind::TimedOut, message));
                }
                match self.options.wait {
                    Wait::Busy => std::hint::spin_loop(),
                    // Sends complete at the pace of the peer's acknowledgements: a nap
                    // costs little and keeps a shared core free.
                    Wait::Event => std::thread::sleep(SEND_WAIT_NAP),
                }
            }
            self.lent = self.free_sends.pop();
        }
        let index = self.options.depth + self.lent.expect("a lent buffer");
        // SAFETY: the buffer lies in the allocation and no send uses it (it was free);
        // the borrow of self keeps it from being posted while lent.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.buffer_start(index), self.options.message_size) })
    }

    /// Queues the first `len` bytes of the buffer lent last as one message; it leaves at
    /// the next [`Connection::flush`].
    pub fn queue(&mut self, len: usize) -> io::Result<()> {
        let Some(lent) = self.lent.take() else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no send buffer was lent"));
        };
        if let Err(error) = self.fits(len) {
            self.free_sends.push(lent);
            return Err(error);
        }
        self.queued.push((lent, len));
        Ok(())
    }

    fn fits(&self, len: usize) -> io::Result<()> {
        if len <= self.options.message_size {
            return Ok(());
        }
        let detail = format!("a message of {len} bytes; the buffers hold {}", self.options.message_size);
        Err(io::Error::new(io::ErrorKind::InvalidInput, detail))
    }

    /// Queues a copy of `message` if a send buffer is free now; false if not (for a
    /// sender that drops what the network cannot take, as a switch does).
    pub fn try_queue_copy(&mut self, message: &[u8]) -> io::Result<bool> {
        self.fits(message.len())?;
        if self.free_sends.is_empty() && self.lent.is_none() {
            self.reap_sends()?;
            if self.free_sends.is_empty() {
                return Ok(false);
            }
        }
        self.send_buffer(Duration::ZERO)?[..message.len()].copy_from_slice(message);
        self.queue(message.len()).map(|()| true)
    }

    /// Sends a copy of `message` now, waiting up to `timeout` for a free send buffer.
    pub fn send(&mut self, message: &[u8], timeout: Duration) -> io::Result<()> {
        self.fits(message.len())?;
        self.send_buffer(timeout)?[..message.len()].copy_from_slice(message);
        self.queue(message.len())?;
        self.flush()
    }

    /// Posts every queued message, one chain of work requests.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.queued.is_empty() {
            return Ok(());
        }
        if let Err(error) = self.check_broken() {
            self.free_sends.extend(self.queued.drain(..).map(|(index, _)| index));
            return Err(error);
        }
        let mut sges: Vec<ibv_sge> =
            self.queued.iter().map(|&(index, len)| self.sge(self.options.depth + index, len)).collect();
        let mut requests: Vec<ibv_send_wr> = Vec::with_capacity(sges.len());
        for (sge, &(index, _)) in sges.iter_mut().zip(&self.queued) {
            let mut request: ibv_send_wr = unsafe { std::mem::zeroed() };
            request.wr_id = index as u64;
            request.sg_list = sge;
            request.num_sge = 1;
            request.opcode = ibv_wr_opcode::IBV_WR_SEND;
            requests.push(request);
        }
        // Linked only now that the vector no longer moves.
        for i in 1..requests.len() {
            let next: *mut ibv_send_wr = &mut requests[i];
            requests[i - 1].next = next;
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        let result =
            unsafe { rdma_sys::ibv_post_send((*self.id.as_ptr()).qp, requests.as_mut_ptr(), &mut bad) };
        // The requests before the bad one were posted; the rest come back free.
        let posted = match bad.is_null() {
            true => requests.len(),
            false => {
                let index = unsafe { bad.offset_from(requests.as_ptr()) };
                usize::try_from(index).unwrap_or(0).min(requests.len())
            }
        };
        for &(index, _) in &self.queued[posted..] {
            self.free_sends.push(index);
        }
        self.queued.clear();
        call("posting sends", result)
    }

    /// The error of a connection that can carry nothing more.
    fn check_broken(&self) -> io::Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(io::Error::new(io::ErrorKind::ConnectionAborted, why.clone())),
        }
    }

    /// Marks the connection broken for `why`, disconnecting our side too, so that the
    /// queue pair flushes now rather than at drop; returns the error.
    fn break_down(&mut self, why: String) -> io::Error {
        if self.established {
            unsafe { rdma_sys::rdma_disconnect(self.id.as_ptr()) };
            self.established = false;
        }
        self.broken.get_or_insert(why);
        self.check_broken().expect_err("broken")
    }

    /// An error if rdma_cm said the peer left (a process that exits disconnects its
    /// queue pairs; a host that vanishes shows as failed completions instead), or that
    /// a connection accepted without waiting never came about. Once said, it stays said.
    fn check_peer_now(&mut self) -> io::Result<()> {
        self.check_broken()?;
        self.last_peer_check = Instant::now();
        while let Some(event) = self.channel.next(Duration::ZERO)? {
            use rdma_cm_event_type::*;
            let why = match event.kind {
                RDMA_CM_EVENT_DISCONNECTED | RDMA_CM_EVENT_TIMEWAIT_EXIT => "the peer disconnected",
                RDMA_CM_EVENT_DEVICE_REMOVAL => "the RDMA device was removed",
                RDMA_CM_EVENT_ADDR_CHANGE => "the RDMA device's address changed",
                RDMA_CM_EVENT_CONNECT_ERROR | RDMA_CM_EVENT_UNREACHABLE | RDMA_CM_EVENT_REJECTED => {
                    "the connection never came about"
                }
                // ESTABLISHED, for a connection accepted without waiting.
                _ => continue,
            };
            return Err(self.break_down(why.into()));
        }
        Ok(())
    }

    /// [`Connection::check_peer_now`] at most every millisecond, for busy waits.
    pub fn check_peer(&mut self) -> io::Result<()> {
        if self.last_peer_check.elapsed() < PEER_CHECK_INTERVAL && self.broken.is_none() {
            return Ok(());
        }
        self.check_peer_now()
    }

    /// After a completion that failed: the peer's departure if rdma_cm says so (it says
    /// more), else the completion's status; the connection is broken either way.
    fn failed_completion(&mut self, status: ibv_wc_status::Type) -> io::Error {
        if let Err(error) = self.check_peer_now() {
            return error;
        }
        let status = unsafe { CStr::from_ptr(rdma_sys::ibv_wc_status_str(status)) }.to_string_lossy();
        self.break_down(format!("an RDMA completion failed: {status}"))
    }

    /// Takes the send completions there are, freeing their buffers; the first failed
    /// one breaks the connection, once all are taken.
    fn reap_sends(&mut self) -> io::Result<()> {
        let mut completions: [ibv_wc; 32] = unsafe { std::mem::zeroed() };
        let mut failure = None;
        loop {
            let count = unsafe { rdma_sys::ibv_poll_cq(self.send_cq, 32, completions.as_mut_ptr()) };
            if count < 0 {
                return Err(failed("polling the send completions", io::Error::last_os_error()));
            }
            for completion in &completions[..count as usize] {
                self.free_sends.push(completion.wr_id as usize);
                if completion.status != ibv_wc_status::IBV_WC_SUCCESS && failure.is_none() {
                    failure = Some(completion.status);
                }
            }
            if count < 32 {
                break;
            }
        }
        match failure {
            Some(status) => Err(self.failed_completion(status)),
            None => Ok(()),
        }
    }

    /// Hands every message received so far to `sink`, without waiting; returns how many.
    pub fn poll(&mut self, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        self.check_broken()?;
        self.reap_sends()?;
        let mut completions: [ibv_wc; 32] = unsafe { std::mem::zeroed() };
        let mut total = 0;
        loop {
            let count = unsafe { rdma_sys::ibv_poll_cq(self.recv_cq, 32, completions.as_mut_ptr()) };
            if count < 0 {
                return Err(failed("polling the receive completions", io::Error::last_os_error()));
            }
            for completion in &completions[..count as usize] {
                if completion.status != ibv_wc_status::IBV_WC_SUCCESS {
                    // Once one fails, the queue pair is in error: the rest are flushed.
                    return Err(self.failed_completion(completion.status));
                }
                debug_assert_eq!(completion.opcode, ibv_wc_opcode::IBV_WC_RECV);
                let index = completion.wr_id as usize;
                let len = (completion.byte_len as usize).min(self.options.message_size);
                // SAFETY: the device has finished with this receive buffer (its completion
                // is here) and it is posted again only after `sink` returns.
                sink(unsafe { std::slice::from_raw_parts(self.buffer_start(index), len) });
                self.post_receive(index)?;
            }
            total += count as usize;
            if count < 32 {
                return Ok(total);
            }
        }
    }

    /// Prepares to sleep: in [`Wait::Event`], asks the device to signal the next receive
    /// completion. Messages that arrived meanwhile are not signalled: poll once more
    /// after arming, and sleep only if it found none.
    pub fn arm(&mut self) -> io::Result<()> {
        if self.completions.is_null() {
            return Ok(());
        }
        call("asking for a completion event", unsafe { rdma_sys::ibv_req_notify_cq(self.recv_cq, 0) })
    }

    /// The descriptors a sleeping waiter watches: the completion channel's (in
    /// [`Wait::Event`]) and rdma_cm's, where a departing peer shows.
    pub fn wait_fds(&self) -> impl Iterator<Item = RawFd> {
        let completions = (!self.completions.is_null()).then(|| unsafe { (*self.completions).fd });
        completions.into_iter().chain([self.channel.fd()])
    }

    /// After a sleep: takes the completion events signalled and looks at rdma_cm's
    /// channel, so that a peer that left is an error now.
    pub fn woken(&mut self) -> io::Result<()> {
        if !self.completions.is_null() {
            let mut cq = ptr::null_mut();
            let mut context = ptr::null_mut();
            let mut events = 0;
            // Non-blocking: fails with EAGAIN once every event is taken.
            while unsafe { rdma_sys::ibv_get_cq_event(self.completions, &mut cq, &mut context) } == 0 {
                events += 1;
            }
            if events > 0 {
                unsafe { rdma_sys::ibv_ack_cq_events(self.recv_cq, events) };
            }
        }
        self.check_peer_now()
    }

    /// Waits up to `timeout` for messages and hands each to `sink`; returns how many (0
    /// when the time ran out).
    pub fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let count = self.poll(sink)?;
            if count > 0 {
                return Ok(count);
            }
            let now = Instant::now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Ok(0);
            }
            if self.options.wait == Wait::Busy {
                self.check_peer()?;
                std::hint::spin_loop();
                continue;
            }
            self.arm()?;
            let count = self.poll(sink)?;
            if count > 0 {
                return Ok(count);
            }
            sleep_until_readable(self.wait_fds(), remaining(deadline))?;
            self.woken()?;
        }
    }
}

/// Sleeps until one of `fds` is readable or `timeout` passes (a signal ends it early,
/// which callers treat as a spurious wake).
pub fn sleep_until_readable(fds: impl IntoIterator<Item = RawFd>, timeout: Duration) -> io::Result<()> {
    let mut polled: Vec<libc::pollfd> =
        fds.into_iter().map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    // ppoll rather than poll: a timeout in nanoseconds, not whole milliseconds, so that a
    // paced sender wakes when its next packet is due.
    let timeout = libc::timespec {
        tv_sec: timeout.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos().into(),
    };
    // SAFETY: `polled` and `timeout` are alive for the call; a null signal mask is allowed.
    let ready =
        unsafe { libc::ppoll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, &timeout, std::ptr::null()) };
    match ready {
        -1 if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted => {
            Err(failed("waiting for completions", io::Error::last_os_error()))
        }
        _ => Ok(()),
    }
}

fn set_nonblocking(fd: RawFd, what: &str) -> io::Result<()> {
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(failed(&format!("making {what} non-blocking"), io::Error::last_os_error()));
    }
    Ok(())
}

impl Drop for Connection {
    fn drop(&mut self) {
        // In the reverse order of making, each only if it was made.
        unsafe {
            let id = self.id.as_ptr();
            if self.established {
                rdma_sys::rdma_disconnect(id);
            }
            if !(*id).qp.is_null() {
                rdma_sys::rdma_destroy_qp(id);
            }
            if !self.mr.is_null() {
                rdma_sys::ibv_dereg_mr(self.mr);
            }
            for cq in [self.send_cq, self.recv_cq] {
                if !cq.is_null() {
                    rdma_sys::ibv_destroy_cq(cq);
                }
            }
            if !self.completions.is_null() {
                rdma_sys::ibv_destroy_comp_channel(self.completions);
            }
            if !self.pd.is_null() {
                rdma_sys::ibv_dealloc_pd(self.pd);
            }
            rdma_sys::rdma_destroy_id(id);
            // Deregistered above: the device no longer touches it.
            drop(Box::from_raw(self.buffer.as_ptr()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What rdma_cm is given comes back as the same address, both families.
    #[test]
    fn socket_addresses_round_trip_through_rdma_cm_s_storage() {
        for address in ["10.77.0.1:48864", "0.0.0.0:0", "[fd00::2]:7471", "[::]:1"] {
            let address: SocketAddr = address.parse().unwrap();
            let storage = sockaddr(address);
            assert_eq!(unsafe { socket_address(&storage) }, Some(address));
        }
        let unknown: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { socket_address(&unknown) }, None);
    }

    #[test]
    fn what_remains_of_a_deadline_never_goes_negative_and_none_is_for_ever() {
        assert_eq!(remaining(None), Duration::MAX);
        assert_eq!(remaining(Some(Instant::now() - Duration::from_secs(1))), Duration::ZERO);
        let left = remaining(Some(Instant::now() + Duration::from_secs(60)));
        assert!(left > Duration::from_secs(59) && left <= Duration::from_secs(60), "{left:?}");
    }
}
