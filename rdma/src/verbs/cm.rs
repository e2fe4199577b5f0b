//! rdma_cm's objects: an event channel, and the ids whose events it carries.

use std::borrow::Cow;
use std::ffi::CStr;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_context, ibv_pd, ibv_qp_init_attr, rdma_cm_event, rdma_cm_event_type, rdma_cm_id, rdma_conn_param,
    rdma_event_channel, rdma_port_space,
};

use super::{call, failed, set_nonblocking};
use crate::connection::remaining;

/// How long rdma_cm may take to resolve an address or a route.
const RESOLVE_TIMEOUT_MS: i32 = 2000;
/// The most private data a connection request carries over RoCE.
pub(crate) const MAX_REQUEST_PRIVATE: usize = 56;
/// The most private data a rejection carries.
const MAX_REJECT_PRIVATE: usize = 148;

/// An rdma_cm event channel, destroyed on drop (after every id whose events it carries:
/// they hold it).
pub(crate) struct EventChannel(NonNull<rdma_event_channel>);

// SAFETY: librdmacm's calls on a channel are thread-safe; the channel holds no
// thread-local state.
unsafe impl Send for EventChannel {}
// SAFETY: as for Send; `&EventChannel` only reads its descriptor and events.
unsafe impl Sync for EventChannel {}

/// An rdma_cm event, acknowledged once read: what it was, and a connection request's
/// new id and private data.
pub(crate) struct Event {
    pub kind: rdma_cm_event_type::Type,
    pub status: i32,
    /// The id a connection request made, owned from now on; `None` for other events.
    pub request: Option<CmId>,
    pub private: Vec<u8>,
}

impl EventChannel {
    /// A channel whose descriptor does not block: librdmacm may read it again inside
    /// `rdma_get_cm_event`, which must then fail with EAGAIN rather than wait.
    pub fn new() -> io::Result<Arc<EventChannel>> {
        // SAFETY: no arguments; a null result is handled.
        let channel = unsafe { rdma_sys::rdma_create_event_channel() };
        let channel = NonNull::new(channel)
            .map(EventChannel)
            .ok_or_else(|| failed("creating an rdma_cm event channel", io::Error::last_os_error()))?;
        set_nonblocking(channel.fd(), "the rdma_cm channel")?;
        Ok(Arc::new(channel))
    }

    fn as_ptr(&self) -> *mut rdma_event_channel {
        self.0.as_ptr()
    }

    /// The descriptor that becomes readable when an event waits.
    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is alive (owned) and librdmacm never changes its fd.
        unsafe { (*self.as_ptr()).fd }
    }

    /// The next event, if one comes within `timeout`.
    pub fn next(self: &Arc<Self>, timeout: Duration) -> io::Result<Option<Event>> {
        let fd = self.fd();
        let deadline = Instant::now().checked_add(timeout);
        let mut event: *mut rdma_cm_event = ptr::null_mut();
        loop {
            let mut poll = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            let millis = i32::try_from(remaining(deadline).as_millis()).unwrap_or(i32::MAX);
            // SAFETY: `poll` is one valid pollfd, alive for the call.
            match unsafe { libc::poll(&mut poll, 1, millis) } {
                0 => return Ok(None),
                -1 if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => continue,
                -1 => return Err(failed("waiting for an rdma_cm event", io::Error::last_os_error())),
                _ => {}
            }
            // SAFETY: the channel is alive; `event` is written only on success.
            if unsafe { rdma_sys::rdma_get_cm_event(self.as_ptr(), &mut event) } == 0 {
                break;
            }
            let error = io::Error::last_os_error();
            // Read by librdmacm for itself (a request it dropped), or woken by a signal.
            if !matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) {
                return Err(failed("reading an rdma_cm event", error));
            }
        }
        // SAFETY: rdma_get_cm_event succeeded, so `event` points to an event that stays
        // valid until it is acknowledged below; its private data, if any, is
        // `private_data_len` bytes long.
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
        // SAFETY: the event came from rdma_get_cm_event and nothing of it is used after.
        unsafe { rdma_sys::rdma_ack_cm_event(event) };
        let request = match (kind, NonNull::new(id)) {
            // A request's id is new, made by librdmacm for us to accept or reject.
            (rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST, Some(id)) => {
                Some(CmId { raw: id, channel: Arc::clone(self) })
            }
            _ => None,
        };
        Ok(Some(Event { kind, status, request, private }))
    }

    /// Waits for an event of type `expected`; any other is an error that names it.
    pub fn expect(
        self: &Arc<Self>,
        expected: rdma_cm_event_type::Type,
        timeout: Duration,
    ) -> io::Result<Event> {
        let Some(event) = self.next(timeout)? else {
            let wanted = event_name(expected);
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("no {wanted} within {timeout:?}")));
        };
        if event.kind != expected {
            let (name, wanted) = (event_name(event.kind), event_name(expected));
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

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: owned, and every id of this channel holds it, so none is left.
        unsafe { rdma_sys::rdma_destroy_event_channel(self.as_ptr()) }
    }
}

/// rdma_cm's name of an event type (`RDMA_CM_EVENT_ESTABLISHED`).
fn event_name(kind: rdma_cm_event_type::Type) -> Cow<'static, str> {
    // SAFETY: rdma_event_str returns a static string for any value, "UNKNOWN EVENT" for
    // one it does not know.
    unsafe { CStr::from_ptr(rdma_sys::rdma_event_str(kind)) }.to_string_lossy()
}

/// An rdma_cm id for reliable connections, destroyed on drop; it holds the channel its
/// events come to. Its queue pair, once made, is a [`super::ibv::QueuePair`], which holds
/// the id.
pub(crate) struct CmId {
    raw: NonNull<rdma_cm_id>,
    channel: Arc<EventChannel>,
}

// SAFETY: librdmacm keeps no per-thread state for an id, so any thread may call on it;
// it moves between threads only whole, with the connection or listener that owns it.
unsafe impl Send for CmId {}
// SAFETY: an id is shared (by `Arc`) only among the parts of one connection (its
// protection domain, completion queues, queue pair and the connection itself) or one
// listener, which are used by one thread at a time (`&mut`); so no two threads call
// through the same id at once, although its calls (connect, accept, disconnect, ...)
// take `&self`. Sync is what those parts need to hold the `Arc`, not a licence to share.
unsafe impl Sync for CmId {}

impl CmId {
    /// A new id whose events come to `channel`.
    pub fn new(channel: &Arc<EventChannel>) -> io::Result<CmId> {
        let mut id = ptr::null_mut();
        // SAFETY: the channel is alive; `id` is written only on success; no context.
        call("creating an rdma_cm id", unsafe {
            rdma_sys::rdma_create_id(channel.as_ptr(), &mut id, ptr::null_mut(), rdma_port_space::RDMA_PS_TCP)
        })?;
        let raw = NonNull::new(id).ok_or_else(|| io::Error::other("rdma_create_id returned no id"))?;
        Ok(CmId { raw, channel: Arc::clone(channel) })
    }

    pub(crate) fn as_ptr(&self) -> *mut rdma_cm_id {
        self.raw.as_ptr()
    }

    /// The channel this id's events come to.
    pub fn channel(&self) -> &Arc<EventChannel> {
        &self.channel
    }

    /// Moves the id's events to `channel` (a request's, off its listener's).
    pub fn migrate(&mut self, channel: Arc<EventChannel>) -> io::Result<()> {
        // SAFETY: both are alive; the old channel is kept until the call returns.
        call("migrating the connection's id", unsafe {
            rdma_sys::rdma_migrate_id(self.as_ptr(), channel.as_ptr())
        })?;
        self.channel = channel;
        Ok(())
    }

    /// Binds the id to `address` and listens there for requests, `backlog` at most
    /// waiting.
    pub fn listen(&self, address: SocketAddr, backlog: i32) -> io::Result<()> {
        let mut storage = sockaddr(address);
        // SAFETY: the id is alive; rdma_bind_addr copies the address, alive for the call.
        call(&format!("binding {address}"), unsafe {
            rdma_sys::rdma_bind_addr(self.as_ptr(), ptr::addr_of_mut!(storage).cast())
        })?;
        // SAFETY: a bound id.
        call("listening", unsafe { rdma_sys::rdma_listen(self.as_ptr(), backlog) })
    }

    /// Starts resolving `address` (from `source`, if given); ADDR_RESOLVED follows.
    pub fn resolve_addr(&self, source: Option<SocketAddr>, address: SocketAddr) -> io::Result<()> {
        let mut destination = sockaddr(address);
        let mut source = source.map(sockaddr);
        let source_ptr = source.as_mut().map_or(ptr::null_mut(), |source| ptr::addr_of_mut!(*source).cast());
        // SAFETY: the id is alive; both addresses (the source may be null) are alive for
        // the call, which copies them.
        call(&format!("resolving {address}"), unsafe {
            rdma_sys::rdma_resolve_addr(
                self.as_ptr(),
                source_ptr,
                ptr::addr_of_mut!(destination).cast(),
                RESOLVE_TIMEOUT_MS,
            )
        })
    }

    /// Starts resolving the route to the resolved address; ROUTE_RESOLVED follows.
    pub fn resolve_route(&self) -> io::Result<()> {
        // SAFETY: the id is alive and its address resolved.
        call("resolving the route", unsafe {
            rdma_sys::rdma_resolve_route(self.as_ptr(), RESOLVE_TIMEOUT_MS)
        })
    }

    /// The verbs context of the id's device: known once its address is resolved, or for
    /// a request's id.
    pub fn context(&self) -> io::Result<NonNull<ibv_context>> {
        // SAFETY: the id is alive; librdmacm sets `verbs` once, when it binds a device.
        let context = unsafe { (*self.as_ptr()).verbs };
        NonNull::new(context)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "the rdma_cm id has no device yet"))
    }

    /// The name of the id's verbs device (`rxe0`, `mlx5_0`); empty if none.
    pub fn device_name(&self) -> String {
        let Ok(context) = self.context() else { return String::new() };
        // SAFETY: the context stays open while the id lives, and its device with it.
        unsafe { crate::device::device_name((*context.as_ptr()).device) }
    }

    /// The address the id is bound to, with its port.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the id is alive; the route's source is a union as large as a
        // sockaddr_storage.
        let address = unsafe { ptr::addr_of!((*self.as_ptr()).route.addr.src_addr_union) };
        // SAFETY: as above, a sockaddr_storage's worth of readable bytes.
        unsafe { socket_address(address.cast()) }
    }

    /// Makes the id's queue pair in `pd`, as `attributes` say; a [`super::ibv::QueuePair`]
    /// owns it.
    ///
    /// # Safety
    /// `pd` is a live protection domain of the id's device, and the completion queues
    /// `attributes` names are live; all three outlive the queue pair.
    pub unsafe fn create_qp(&self, pd: *mut ibv_pd, attributes: &mut ibv_qp_init_attr) -> io::Result<()> {
        // SAFETY: the id is alive; the caller vouches for the rest.
        call("creating the queue pair", unsafe { rdma_sys::rdma_create_qp(self.as_ptr(), pd, attributes) })
    }

    /// Connects to the resolved peer, sending `private` (at most 56 bytes are carried)
    /// with the request; ESTABLISHED or a refusal follows.
    pub fn connect(
        &self,
        private: &[u8],
        rnr_retries: u8,
        retries: u8,
        address: SocketAddr,
    ) -> io::Result<()> {
        let mut parameters = parameters(rnr_retries);
        parameters.private_data = private.as_ptr().cast();
        parameters.private_data_len = private.len().min(MAX_REQUEST_PRIVATE) as u8;
        parameters.retry_count = retries;
        // SAFETY: the id is alive with its queue pair; the parameters and the private
        // data they point to are alive for the call, which copies them.
        call(&format!("connecting to {address}"), unsafe {
            rdma_sys::rdma_connect(self.as_ptr(), &mut parameters)
        })
    }

    /// Accepts the request this id came from.
    pub fn accept(&self, rnr_retries: u8) -> io::Result<()> {
        let mut parameters = parameters(rnr_retries);
        // SAFETY: a request's id with its queue pair; the parameters are alive for the call.
        call("accepting", unsafe { rdma_sys::rdma_accept(self.as_ptr(), &mut parameters) })
    }

    /// Refuses the request this id came from, telling the peer `reason` (its first 148
    /// bytes, what the connection manager carries).
    pub fn reject(&self, reason: &str) {
        let reason = &reason.as_bytes()[..reason.len().min(MAX_REJECT_PRIVATE)];
        // SAFETY: the id is alive; the reason is alive for the call, which copies it. A
        // failure leaves nothing to undo: the id is destroyed after.
        unsafe { rdma_sys::rdma_reject(self.as_ptr(), reason.as_ptr().cast(), reason.len() as u8) };
    }

    /// Disconnects an established connection; DISCONNECTED follows on both sides.
    pub fn disconnect(&self) {
        // SAFETY: the id is alive; a failure (already disconnected) leaves nothing to undo.
        unsafe { rdma_sys::rdma_disconnect(self.as_ptr()) };
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: owned; its queue pair (which holds the id) is destroyed, and its events
        // were acknowledged as they were read.
        unsafe { rdma_sys::rdma_destroy_id(self.as_ptr()) };
    }
}

/// What both sides of a connection ask of it: one outstanding read each way (netagg
/// reads nothing remote, but rdma_cm wants one), and `rnr_retries`.
fn parameters(rnr_retries: u8) -> rdma_conn_param {
    // SAFETY: a C struct of integers and pointers, for which all zeros is valid (no
    // private data).
    let mut parameters: rdma_conn_param = unsafe { std::mem::zeroed() };
    parameters.responder_resources = 1;
    parameters.initiator_depth = 1;
    parameters.rnr_retry_count = rnr_retries;
    parameters
}

/// A socket address as rdma_cm takes it.
pub(crate) fn sockaddr(address: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: a C struct of integers, for which all zeros is valid.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match address {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(v4.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: a sockaddr_storage is larger than, and aligned for, a sockaddr_in.
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
            // SAFETY: a sockaddr_storage is larger than, and aligned for, a sockaddr_in6.
            unsafe { ptr::write(ptr::addr_of_mut!(storage).cast(), sin6) };
        }
    }
    storage
}

/// A socket address from rdma_cm's; `None` for a family other than IPv4 and IPv6.
///
/// # Safety
/// `address` points to a `sockaddr_storage`'s worth of readable bytes.
pub(crate) unsafe fn socket_address(address: *const libc::sockaddr_storage) -> Option<SocketAddr> {
    // SAFETY: the caller vouches for the storage; its family says which address it
    // holds, and both fit in it.
    unsafe {
        match i32::from((*address).ss_family) {
            libc::AF_INET => {
                let sin = &*address.cast::<libc::sockaddr_in>();
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
            }
            libc::AF_INET6 => {
                let sin6 = &*address.cast::<libc::sockaddr_in6>();
                let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
            }
            _ => None,
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
            // SAFETY: a whole sockaddr_storage.
            assert_eq!(unsafe { socket_address(&storage) }, Some(address));
        }
        // SAFETY: all zeros is a valid sockaddr_storage (family AF_UNSPEC).
        let unknown: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        // SAFETY: a whole sockaddr_storage.
        assert_eq!(unsafe { socket_address(&unknown) }, None);
    }
}
