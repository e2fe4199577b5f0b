//! A reliable connection (an RC queue pair) set up through rdma_cm, carrying whole
//! messages with two-sided SEND and RECV from a registered buffer: the simplest verbs a
//! peer without remote keys needs, and the ones Soft-RoCE carries best.
//!
//! Every wait has a timeout: rdma_cm's events are read from its channel's descriptor
//! after `poll`, never by blocking in `rdma_get_cm_event` itself.

use std::ffi::CStr;
use std::io;
use std::net::SocketAddr;
use std::ptr::{self, NonNull};
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_access_flags, ibv_cq, ibv_mr, ibv_pd, ibv_qp_init_attr, ibv_qp_type, ibv_recv_wr, ibv_send_flags,
    ibv_send_wr, ibv_sge, ibv_wc, ibv_wc_opcode, ibv_wc_status, ibv_wr_opcode, rdma_cm_event,
    rdma_cm_event_type, rdma_cm_id, rdma_conn_param, rdma_event_channel, rdma_port_space,
};

/// How long rdma_cm may take to resolve an address or a route.
const RESOLVE_TIMEOUT_MS: i32 = 2000;
/// How many times a send is retried while the peer has no receive posted: finite (7
/// would mean for ever), so that a peer that stops receiving fails the send.
const RNR_RETRIES: u8 = 6;

/// An error of the connection: what failed, and why.
fn failed(what: &str, error: io::Error) -> io::Error {
    io::Error::new(error.kind(), format!("{what}: {error}"))
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
        let fd = unsafe { (*channel.0.as_ptr()).fd };
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(failed("making the rdma_cm channel non-blocking", io::Error::last_os_error()));
        }
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

    /// The next event, within `timeout`: its type, status, the id it is for, and its
    /// private data (a connection request's).
    fn next(&self, timeout: Duration) -> io::Result<Event> {
        let fd = unsafe { (*self.0.as_ptr()).fd };
        let deadline = Instant::now().checked_add(timeout);
        let mut event: *mut rdma_cm_event = ptr::null_mut();
        loop {
            let left =
                deadline.map_or(Duration::MAX, |deadline| deadline.saturating_duration_since(Instant::now()));
            let mut poll = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            let millis = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
            match unsafe { libc::poll(&mut poll, 1, millis) } {
                0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no rdma_cm event within {timeout:?}"),
                    ))
                }
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
        Ok(Event { kind, status, id, private })
    }

    /// Waits for an event of type `expected`; any other is an error that names it.
    fn expect(&self, expected: rdma_cm_event_type::Type, timeout: Duration) -> io::Result<Event> {
        let event = self.next(timeout)?;
        if event.kind != expected {
            let name = unsafe { CStr::from_ptr(rdma_sys::rdma_event_str(event.kind)) }.to_string_lossy();
            let wanted = unsafe { CStr::from_ptr(rdma_sys::rdma_event_str(expected)) }.to_string_lossy();
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!("rdma_cm said {name} (status {}) where {wanted} was awaited", event.status),
            ));
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

/// A listening rdma_cm id, where peers connect.
pub struct Listener {
    id: NonNull<rdma_cm_id>,
    channel: Channel,
}

unsafe impl Send for Listener {}

impl Listener {
    /// Listens at `address` (an RDMA device's IP address, and a port).
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

    /// Accepts the next connection within `timeout`; returns it and the private data its
    /// peer sent.
    pub fn accept(
        &self,
        timeout: Duration,
        slots: usize,
        slot_size: usize,
    ) -> io::Result<(Connection, Vec<u8>)> {
        let deadline = Instant::now().checked_add(timeout);
        let left =
            || deadline.map_or(Duration::MAX, |deadline| deadline.saturating_duration_since(Instant::now()));
        // Events of other kinds (an address change) are not this call's to answer.
        let request = loop {
            let event = self.channel.next(left())?;
            if event.kind == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                break event;
            }
        };
        let id = NonNull::new(request.id).expect("a request names its id");
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
                unsafe {
                    rdma_sys::rdma_reject(id.as_ptr(), ptr::null(), 0);
                    rdma_sys::rdma_destroy_id(id.as_ptr());
                }
                return Err(error);
            }
        };
        // From here the connection owns the id: dropping it rejects the peer.
        let mut connection = Connection::prepare(id, channel, slots, slot_size)?;
        let mut parameters = connection_parameters();
        call("accepting", unsafe { rdma_sys::rdma_accept(id.as_ptr(), &mut parameters) })?;
        connection.channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, left())?;
        connection.established = true;
        Ok((connection, request.private))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        unsafe { rdma_sys::rdma_destroy_id(self.id.as_ptr()) };
    }
}

/// One connected RC queue pair and its registered buffer: `slots` receive buffers and
/// `slots` send buffers of `slot_size` bytes each. The verbs objects are null until made,
/// so that a connection that fails half-way frees what it made, and only that.
pub struct Connection {
    id: NonNull<rdma_cm_id>,
    pd: *mut ibv_pd,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    mr: *mut ibv_mr,
    /// The registered memory, owned here (from `Box::into_raw`) and reached only through
    /// raw pointers: the device writes receive slots and reads send slots behind Rust's
    /// back, so no reference may span them.
    buffer: NonNull<[u8]>,
    slots: usize,
    slot_size: usize,
    /// Send buffers not in flight.
    free_sends: Vec<usize>,
    established: bool,
    /// rdma_cm said the peer left.
    peer_gone: bool,
    /// Last: destroyed after the id, whose events it carried.
    channel: Channel,
}

unsafe impl Send for Connection {}

impl Connection {
    /// Connects to the listener at `address` within `timeout`, sending `private` (at most
    /// 56 bytes) with the request. The listener receives it padded with zeros to 56 bytes
    /// over RoCE: private data that varies in length carries its own.
    pub fn connect(
        address: SocketAddr,
        private: &[u8],
        timeout: Duration,
        slots: usize,
        slot_size: usize,
    ) -> io::Result<Connection> {
        let channel = Channel::new()?;
        let id = channel.create_id()?;
        let mut storage = sockaddr(address);
        let resolved = unsafe {
            rdma_sys::rdma_resolve_addr(
                id.as_ptr(),
                ptr::null_mut(),
                ptr::addr_of_mut!(storage).cast(),
                RESOLVE_TIMEOUT_MS,
            )
        };
        if let Err(error) = call(&format!("resolving {address}"), resolved)
            .and_then(|()| channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED, timeout).map(drop))
            .and_then(|()| {
                call("resolving the route", unsafe {
                    rdma_sys::rdma_resolve_route(id.as_ptr(), RESOLVE_TIMEOUT_MS)
                })
            })
            .and_then(|()| {
                channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED, timeout).map(drop)
            })
        {
            unsafe { rdma_sys::rdma_destroy_id(id.as_ptr()) };
            return Err(error);
        }
        let mut connection = Connection::prepare(id, channel, slots, slot_size)?;
        let mut parameters = connection_parameters();
        parameters.private_data = private.as_ptr().cast();
        parameters.private_data_len = u8::try_from(private.len()).unwrap_or(u8::MAX).min(56);
        // Transport retries: the side that connects sets them for both.
        parameters.retry_count = 7;
        call(&format!("connecting to {address}"), unsafe {
            rdma_sys::rdma_connect(id.as_ptr(), &mut parameters)
        })?;
        connection.channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, timeout)?;
        connection.established = true;
        Ok(connection)
    }

    /// The protection domain, completion queues, queue pair and registered buffer of a
    /// connection whose id has its device; every receive buffer posted.
    fn prepare(
        id: NonNull<rdma_cm_id>,
        channel: Channel,
        slots: usize,
        slot_size: usize,
    ) -> io::Result<Connection> {
        // Owns the id from here: dropping it destroys whatever was made.
        let mut connection = Connection {
            id,
            pd: ptr::null_mut(),
            send_cq: ptr::null_mut(),
            recv_cq: ptr::null_mut(),
            mr: ptr::null_mut(),
            buffer: NonNull::from(Box::leak(vec![0u8; 2 * slots * slot_size].into_boxed_slice())),
            slots,
            slot_size,
            free_sends: (0..slots).rev().collect(),
            established: false,
            peer_gone: false,
            channel,
        };
        let made = |made: bool, what: &str| match made {
            true => Ok(()),
            false => Err(failed(what, io::Error::last_os_error())),
        };
        let verbs = unsafe { (*id.as_ptr()).verbs };
        connection.pd = unsafe { rdma_sys::ibv_alloc_pd(verbs) };
        made(!connection.pd.is_null(), "allocating a protection domain")?;
        let depth = i32::try_from(slots).unwrap_or(i32::MAX);
        connection.send_cq =
            unsafe { rdma_sys::ibv_create_cq(verbs, depth, ptr::null_mut(), ptr::null_mut(), 0) };
        made(!connection.send_cq.is_null(), "creating a completion queue")?;
        connection.recv_cq =
            unsafe { rdma_sys::ibv_create_cq(verbs, depth, ptr::null_mut(), ptr::null_mut(), 0) };
        made(!connection.recv_cq.is_null(), "creating a completion queue")?;
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32;
        let (start, len) = (connection.buffer.cast::<u8>().as_ptr(), connection.buffer.len());
        connection.mr = unsafe { rdma_sys::ibv_reg_mr(connection.pd, start.cast(), len, access) };
        made(!connection.mr.is_null(), "registering the buffers")?;
        let mut attributes: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attributes.send_cq = connection.send_cq;
        attributes.recv_cq = connection.recv_cq;
        attributes.cap.max_send_wr = slots as u32;
        attributes.cap.max_recv_wr = slots as u32;
        attributes.cap.max_send_sge = 1;
        attributes.cap.max_recv_sge = 1;
        attributes.qp_type = ibv_qp_type::IBV_QPT_RC;
        attributes.sq_sig_all = 1;
        call("creating the queue pair", unsafe {
            rdma_sys::rdma_create_qp(id.as_ptr(), connection.pd, &mut attributes)
        })?;
        for slot in 0..slots {
            connection.post_receive(slot)?;
        }
        Ok(connection)
    }

    fn sge(&self, buffer_slot: usize, len: usize) -> ibv_sge {
        ibv_sge {
            addr: self.buffer.cast::<u8>().as_ptr() as u64 + (buffer_slot * self.slot_size) as u64,
            length: len as u32,
            lkey: unsafe { (*self.mr).lkey },
        }
    }

    fn post_receive(&mut self, slot: usize) -> io::Result<()> {
        let mut sge = self.sge(slot, self.slot_size);
        let mut request =
            ibv_recv_wr { wr_id: slot as u64, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad = ptr::null_mut();
        call("posting a receive", unsafe {
            rdma_sys::ibv_post_recv((*self.id.as_ptr()).qp, &mut request, &mut bad)
        })
    }

    /// Sends `message` (at most `slot_size` bytes); waits for a free send buffer if every
    /// one is in flight.
    pub fn send(&mut self, message: &[u8]) -> io::Result<()> {
        if message.len() > self.slot_size {
            let detail = format!("a message of {} bytes; the buffers hold {}", message.len(), self.slot_size);
            return Err(io::Error::new(io::ErrorKind::InvalidInput, detail));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.free_sends.is_empty() {
            self.reap_sends()?;
            if Instant::now() >= deadline {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no send completed within 10 s"));
            }
        }
        let index = self.free_sends.pop().expect("a free send buffer");
        let slot = self.slots + index;
        let start = slot * self.slot_size;
        // SAFETY: the slot lies in the buffer, and no send uses it (it was free).
        unsafe {
            ptr::copy_nonoverlapping(
                message.as_ptr(),
                self.buffer.cast::<u8>().as_ptr().add(start),
                message.len(),
            )
        };
        let mut sge = self.sge(slot, message.len());
        let mut request: ibv_send_wr = unsafe { std::mem::zeroed() };
        request.wr_id = index as u64;
        request.sg_list = &mut sge;
        request.num_sge = 1;
        request.opcode = ibv_wr_opcode::IBV_WR_SEND;
        request.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = ptr::null_mut();
        call("posting a send", unsafe {
            rdma_sys::ibv_post_send((*self.id.as_ptr()).qp, &mut request, &mut bad)
        })
    }

    /// An error if rdma_cm said the peer left (a process that exits disconnects its
    /// queue pairs; a host that vanishes shows as failed completions instead).
    /// Once said, it stays said.
    fn check_peer(&mut self) -> io::Result<()> {
        let gone = || io::Error::new(io::ErrorKind::ConnectionAborted, "the peer disconnected");
        if self.peer_gone {
            return Err(gone());
        }
        match self.channel.next(Duration::ZERO) {
            Ok(event)
                if matches!(
                    event.kind,
                    rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                        | rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL
                ) =>
            {
                self.peer_gone = true;
                // Our side too, so that the queue pair flushes now rather than at drop.
                if self.established {
                    unsafe { rdma_sys::rdma_disconnect(self.id.as_ptr()) };
                    self.established = false;
                }
                Err(gone())
            }
            Ok(_) => Ok(()),
            Err(error) if error.kind() == io::ErrorKind::TimedOut => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// Takes the send completions there are, freeing their buffers.
    fn reap_sends(&mut self) -> io::Result<()> {
        let mut completions: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
        let count = unsafe { rdma_sys::ibv_poll_cq(self.send_cq, 16, completions.as_mut_ptr()) };
        if count < 0 {
            return Err(failed("polling the send completions", io::Error::last_os_error()));
        }
        for completion in &completions[..count as usize] {
            check(completion)?;
            self.free_sends.push(completion.wr_id as usize);
        }
        Ok(())
    }

    /// Waits up to `timeout` for messages and hands each to `sink`; returns how many.
    pub fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            self.reap_sends()?;
            let mut completions: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
            let count = unsafe { rdma_sys::ibv_poll_cq(self.recv_cq, 16, completions.as_mut_ptr()) };
            if count < 0 {
                return Err(failed("polling the receive completions", io::Error::last_os_error()));
            }
            for completion in &completions[..count as usize] {
                check(completion)?;
                debug_assert_eq!(completion.opcode, ibv_wc_opcode::IBV_WC_RECV);
                let slot = completion.wr_id as usize;
                let start = slot * self.slot_size;
                let len = (completion.byte_len as usize).min(self.slot_size);
                // SAFETY: the device has finished with this receive slot (its completion is
                // here) and it is posted again only after `sink` returns.
                sink(unsafe {
                    std::slice::from_raw_parts(self.buffer.cast::<u8>().as_ptr().add(start), len)
                });
                self.post_receive(slot)?;
            }
            if count > 0 {
                return Ok(count as usize);
            }
            self.check_peer()?;
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return Ok(0);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// An error for a completion that did not succeed: a flushed queue pair (the peer gone),
/// retries exhausted.
fn check(completion: &ibv_wc) -> io::Result<()> {
    if completion.status == ibv_wc_status::IBV_WC_SUCCESS {
        return Ok(());
    }
    let status = unsafe { CStr::from_ptr(rdma_sys::ibv_wc_status_str(completion.status)) }.to_string_lossy();
    Err(io::Error::new(io::ErrorKind::ConnectionAborted, format!("an RDMA completion failed: {status}")))
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
            if !self.pd.is_null() {
                rdma_sys::ibv_dealloc_pd(self.pd);
            }
            rdma_sys::rdma_destroy_id(id);
            // Deregistered above: the device no longer touches it.
            drop(Box::from_raw(self.buffer.as_ptr()));
        }
    }
}
