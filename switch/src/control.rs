//! The control plane's TCP shell over [`Registry`], the I/O-free core that holds
//! registration, the barrier, limits and departures (its docs say what they do).
//!
//! This module accepts connections, reads and decodes their frames, feeds the registry
//! what happened with the time, and carries out its [`Action`]s: messages written to
//! connections, connections closed, sessions opened and closed in the data path. It
//! drives the registry's deadlines from a timer thread.
//!
//! One lock holds the registry and the table of connections, and every event is fed and
//! its actions taken under it, so the registry sees events one at a time in the order
//! they happened. Opening a session in the data path (in every lane, through [`Lanes`])
//! is done under the lock: each lane answers between two receive calls, within
//! milliseconds, involves no socket, and so keeps a session's opening atomic for the
//! other connections. Writes to sockets are not: what to send is decided under the lock
//! and sent after it. Every write is non-blocking: a control message is a few hundred
//! bytes, and a client whose socket cannot take one has stopped reading, so it is
//! disconnected rather than waited for.
//!
//! One thread per connection, each blocked in a read: connections are few and live as
//! long as their sessions, the registry's cap bounds the threads, and a read is all a
//! thread does. A thread of its own sleeps until the registry's next deadline (or until
//! an event may have set an earlier one) and closes the connections that missed it,
//! which ends their threads' reads.
//!
//! A registration for a rank whose previous connection its client has closed, while that
//! connection's thread has not yet handled its end, waits (boundedly) for that end rather
//! than being refused as a duplicate: a rank's next process can be that quick.
//!
//! The plane keeps every connection's stream and thread, so that a switch stopped in
//! process closes them all and joins their threads instead of leaving them behind.
//!
//! A lower switch of an aggregation tree opens each session at its upper switch first
//! ([`crate::tree`]), after the lock, on the thread of the connection whose registration
//! completed the rack; once the registry knows the session is open, a thread per session
//! watches the upper switch's connection, and the session's ending closes it.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use netagg_aggregator::control::{
    Action, Assembly, Closure, ConnectionId, ControlLimits, Group, OpenError, OpenRequest, Opened,
    Registered, Registry, SessionEnd,
};
use netagg_aggregator::{SessionId, SessionSpec};
use netagg_wire::{ControlMessage, Endpoint, RejectCode, WireError};
use rand::RngCore;

use crate::datapath::{Event, UpstreamPath};
use crate::lanes::Lanes;
use crate::tree::{self, UpperSwitch};

/// A connection's stream, shared by its thread and the table of connections: one
/// descriptor per connection.
type Stream = Arc<TcpStream>;

/// What the lock guards: the registry, and each connection's stream and thread (none
/// while it starts, or once it is refused).
struct Shared {
    registry: Registry,
    connections: HashMap<ConnectionId, (Stream, Option<JoinHandle<()>>)>,
}

/// Socket work decided under the lock, done after it.
enum Io {
    Send(Stream, u32, ControlMessage),
    Close(Stream),
    /// Close a session in the data path, waiting for its counters.
    CloseSession {
        id: SessionId,
        name: String,
        why: Closure,
    },
    /// Tell the data path a rank leaves, and feed its answer back to the registry.
    Depart {
        connection: ConnectionId,
        id: SessionId,
        rank: u16,
    },
    /// Open a rack's session at the upper switch, then in the data path, and feed the
    /// answer back to the registry.
    OpenInTree {
        request: OpenRequest,
        name: String,
        spec: SessionSpec,
        workers: Vec<Registered>,
        group: Group,
    },
}

/// A rack's session's membership in its upper switch's session.
struct Membership {
    stream: Arc<TcpStream>,
    /// The upper session's id, and this switch's rank in it, for *leave*.
    session: u32,
    rank: u16,
}

/// What the control plane holds at one moment, for the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Census {
    pub open: usize,
    pub assembling: usize,
    pub connections: usize,
}

pub struct ControlPlane {
    shared: Mutex<Shared>,
    /// Wakes the timer thread: an event may have set an earlier deadline, or the switch
    /// stops.
    deadlines: Condvar,
    /// Wakes registrations waiting for the end of a connection that holds their rank
    /// ([`ControlPlane::await_holder_end`]): an event was handled, or the switch stops.
    handled: Condvar,
    /// Set when the switch stops: the acceptor takes no more connections, and closing
    /// connections no longer counts as ranks leaving.
    stopping: AtomicBool,
    lanes: Lanes,
    /// This switch's upper switch, if it serves a rack of a tree.
    upper: Option<UpperSwitch>,
    /// Each open session's membership in its upper switch's session.
    memberships: Mutex<HashMap<SessionId, Membership>>,
    /// The plane itself, for the threads that watch upper switches.
    me: Weak<ControlPlane>,
}

/// The longest the acceptor waits after `accept` fails before it tries again (out of
/// descriptors, say: retrying at once would spin).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// How often a repeated event of the acceptor is logged at most.
const LOG_INTERVAL: Duration = Duration::from_secs(10);
/// The longest a registration waits for the end of its rank's last connection, closed by
/// its client, to be handled: that connection's thread has only to be scheduled, and a
/// registration refused meanwhile fails its whole run. A client of this version waits
/// for the switch to close the connection after its leave, so its next process finds no
/// holder; the wait remains for a client killed or crashed (the kernel closes its
/// connection, with no leave, as the next process may already register) and for clients
/// of earlier versions, which close right after their leave.
const HOLDER_END_WAIT: Duration = Duration::from_secs(5);

impl ControlPlane {
    pub fn new(
        lanes: Lanes,
        data_endpoints: Vec<Endpoint>,
        limits: ControlLimits,
        upper: Option<UpperSwitch>,
    ) -> Arc<ControlPlane> {
        let mut registry = Registry::new(data_endpoints, limits);
        if let Some(upper) = &upper {
            registry = registry.serving_rack(upper.rack);
        }
        Arc::new_cyclic(|me| ControlPlane {
            shared: Mutex::new(Shared { registry, connections: HashMap::new() }),
            deadlines: Condvar::new(),
            handled: Condvar::new(),
            stopping: AtomicBool::new(false),
            lanes,
            upper,
            memberships: Mutex::new(HashMap::new()),
            me: me.clone(),
        })
    }

    /// Accepts connections until [`ControlPlane::stop_accepting`] and one more
    /// connection (which only wakes it); one thread per connection.
    pub fn serve(self: &Arc<Self>, listener: TcpListener) {
        let mut backoff = Duration::ZERO;
        let mut failures = Throttled::default();
        let mut refusals = Throttled::default();
        loop {
            let accepted = listener.accept();
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            match accepted {
                Ok((stream, _)) => {
                    backoff = Duration::ZERO;
                    if !self.start_connection(stream) {
                        let max = self.lock().registry.limits().max_connections;
                        refusals.note(|count| {
                            tracing::warn!(count, max, "control connections refused: too many")
                        });
                    }
                }
                Err(error) => {
                    // Out of descriptors, most likely: the sessions already running go
                    // on; new connections wait, and the log gets a line now and then.
                    failures.note(|count| {
                        tracing::warn!(%error, count, "accepting control connections fails; backing off")
                    });
                    backoff = (backoff * 2).clamp(Duration::from_millis(10), MAX_ACCEPT_BACKOFF);
                    std::thread::sleep(backoff);
                }
            }
        }
    }

    /// Starts a thread for a new connection; false if the connection was refused (too
    /// many), which it is told before it is closed.
    fn start_connection(self: &Arc<Self>, stream: TcpStream) -> bool {
        // Gone already (reset by its client): nothing to serve, and nothing refused.
        let Ok(peer) = stream.peer_addr() else { return true };
        // A host that crashes sends no FIN: keepalive probes find out within a minute.
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(20))
            .with_interval(Duration::from_secs(10))
            .with_retries(3);
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
        let stream = Arc::new(stream);
        let mut shared = self.lock();
        let id = shared.registry.handle_connect(Instant::now(), peer.ip());
        shared.connections.insert(id, (Arc::clone(&stream), None));
        let mut io = self.perform(&mut shared);
        let live = shared.registry.is_live(id);
        if live {
            let plane = Arc::clone(self);
            let reader = Arc::clone(&stream);
            let thread =
                std::thread::Builder::new().name(id.to_string()).spawn(move || plane.read(id, reader));
            match thread {
                // Recorded under the lock that the thread's own removal of its entry,
                // when it ends, waits for: it cannot come first and leave a stale entry.
                Ok(thread) => {
                    shared.connections.insert(id, (stream, Some(thread)));
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot start a thread for a control connection");
                    shared.registry.handle_closed(id);
                    shared.connections.remove(&id);
                    io.extend(self.perform(&mut shared));
                }
            }
        } else {
            shared.connections.remove(&id);
        }
        drop(shared);
        self.deadlines.notify_one();
        self.deliver(io);
        live
    }

    /// Sessions open and assembling, and live control connections, at this moment.
    pub fn census(&self) -> Census {
        let shared = self.lock();
        let (open, assembling) = shared.registry.sessions();
        Census { open, assembling, connections: shared.registry.live_connections() }
    }

    /// Makes [`ControlPlane::serve`] return at its next connection.
    pub fn stop_accepting(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Closes every connection and waits for its thread, and ends the timer thread; call
    /// after the acceptor has stopped, so that none starts meanwhile. Workers see their
    /// connection close, as when the switch process exits.
    pub fn close_connections(&self) {
        self.stopping.store(true, Ordering::Release);
        let connections: Vec<_> = self.lock().connections.drain().map(|(_, entry)| entry).collect();
        self.deadlines.notify_all();
        self.handled.notify_all();
        // Ends the threads watching upper switches.
        for (_, membership) in self.memberships().drain() {
            let _ = membership.stream.shutdown(Shutdown::Both);
        }
        for (stream, thread) in connections {
            // Ends the thread's blocking read.
            let _ = stream.shutdown(Shutdown::Both);
            if let Some(thread) = thread {
                let _ = thread.join();
            }
        }
    }

    /// Closes the connections whose deadline passes, until the switch stops.
    pub fn drive_timers(&self) {
        let mut shared = self.lock();
        while !self.stopping.load(Ordering::Acquire) {
            let now = Instant::now();
            shared = match shared.registry.poll_timeout() {
                Some(deadline) if deadline <= now => {
                    shared.registry.handle_timeout(now);
                    let io = self.perform(&mut shared);
                    drop(shared);
                    self.deliver(io);
                    self.lock()
                }
                Some(deadline) => self.wait(&self.deadlines, shared, Some(deadline - now)),
                None => self.wait(&self.deadlines, shared, None),
            };
        }
    }

    /// Closes in every lane the sessions one lane closed, and tells their ranks why.
    pub fn handle_events(&self, events: crossbeam_channel::Receiver<Event>) {
        for event in events {
            let (id, end) = match event {
                Event::Expired(id) => {
                    self.lanes.close(id);
                    (id, SessionEnd::Expired)
                }
                Event::Orphaned { id, departed, counters, lost } => {
                    let counters = self.lanes.close_orphaned(id, counters);
                    tracing::info!(session = %session(id), rank = departed, ?counters, ?lost, "session closed: a round needs a rank that left");
                    match lost {
                        Some(why) => (id, SessionEnd::ConnectionLost { rank: departed, why }),
                        None => (id, SessionEnd::Orphaned { departed }),
                    }
                }
            };
            self.leave_upper(id, false);
            self.feed(|registry| registry.handle_session_ended(id, end));
        }
    }

    fn memberships(&self) -> MutexGuard<'_, HashMap<SessionId, Membership>> {
        self.memberships.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panicking connection thread must not take the whole control plane with it.
        self.shared.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn wait<'a>(
        &self,
        condvar: &Condvar,
        shared: MutexGuard<'a, Shared>,
        timeout: Option<Duration>,
    ) -> MutexGuard<'a, Shared> {
        match timeout {
            Some(timeout) => condvar
                .wait_timeout(shared, timeout)
                .map_or_else(|poisoned| poisoned.into_inner().0, |(shared, _)| shared),
            None => condvar.wait(shared).unwrap_or_else(|poisoned| poisoned.into_inner()),
        }
    }

    /// Feeds the registry one event under the lock, carries out what it calls for, and
    /// lets the timer thread see the deadlines it may have set.
    fn feed(&self, event: impl FnOnce(&mut Registry)) {
        let mut shared = self.lock();
        event(&mut shared.registry);
        let io = self.perform(&mut shared);
        drop(shared);
        self.deadlines.notify_one();
        self.handled.notify_all();
        self.deliver(io);
    }

    /// Waits, for at most [`HOLDER_END_WAIT`], until no connection whose client has closed
    /// it holds `rank` of session `name`. A rank's next process can register before the
    /// thread of its previous connection has read that connection's leave and end (a
    /// loaded host schedules it late), and would be refused for a rank that is gone. A
    /// holder whose client has not closed it is not waited for: the registration is
    /// refused as the duplicate it is.
    fn await_holder_end(&self, name: &str, rank: u16) {
        let deadline = Instant::now() + HOLDER_END_WAIT;
        let mut shared = self.lock();
        while let Some(holder) = shared.registry.holder(name, rank) {
            // No stream once its thread has ended: only the data path's answer to its
            // leave is still to come.
            let gone = shared.connections.get(&holder).is_none_or(|(stream, _)| closed_by_client(stream));
            let now = Instant::now();
            if !gone || now >= deadline || self.stopping.load(Ordering::Acquire) {
                return;
            }
            tracing::debug!(%holder, %name, rank, "registration waits for the end of its rank's last connection");
            shared = self.wait(&self.handled, shared, Some(deadline - now));
        }
    }

    /// Reads a connection's messages into the registry until it is closed, by its client
    /// or by the registry.
    fn read(&self, connection: ConnectionId, stream: Stream) {
        loop {
            match ControlMessage::read_from(&mut &*stream) {
                Ok((request_id, message)) => {
                    if let ControlMessage::Register { name, rank, .. } = &message {
                        self.await_holder_end(name, *rank);
                    }
                    self.feed(|registry| {
                        let registers = matches!(message, ControlMessage::Register { .. });
                        registry.handle_message(Instant::now(), connection, request_id, message);
                        if let Some(Assembly { name, rank, joined, world_size }) =
                            registry.assembly(connection).filter(|_| registers)
                        {
                            tracing::info!(%name, rank, joined, world = world_size, "worker registered");
                        }
                    })
                }
                Err(error) => {
                    match error.get_ref().and_then(|e| e.downcast_ref::<WireError>()) {
                        Some(wire) => self.feed(|registry| registry.handle_undecodable(connection, wire)),
                        None if error.kind() != io::ErrorKind::UnexpectedEof => {
                            tracing::debug!(%connection, %error, "control connection failed")
                        }
                        None => {}
                    }
                    break;
                }
            }
            if !self.lock().registry.is_live(connection) {
                break;
            }
        }
        let mut shared = self.lock();
        // A stopping switch ends every session with itself: no rank left, and the other
        // ranks' connections are closing anyway.
        let io = if self.stopping.load(Ordering::Acquire) {
            Vec::new()
        } else {
            shared.registry.handle_closed(connection);
            self.perform(&mut shared)
        };
        shared.connections.remove(&connection);
        drop(shared);
        self.handled.notify_all();
        self.deliver(io);
        let _ = stream.shutdown(Shutdown::Both);
    }

    /// Carries out the registry's actions: the data path's now, feeding its answers back;
    /// the sockets' returned, to be done once the lock is released.
    fn perform(&self, shared: &mut Shared) -> Vec<Io> {
        let mut io = Vec::new();
        while let Some(action) = shared.registry.poll_action() {
            match action {
                Action::Send { connection, request_id, message } => {
                    let Some((stream, thread)) = shared.connections.get(&connection) else { continue };
                    // One refused as it arrives has no thread yet: the acceptor's throttled
                    // line counts those, which a flood could repeat thousands of times.
                    // Bytes that are no request at all are for debugging: a flood of them
                    // must not fill the log either.
                    if let (ControlMessage::Reject { code, message }, Some(_)) = (&message, thread) {
                        let peer = stream.peer_addr().ok();
                        if *code == RejectCode::Malformed {
                            tracing::debug!(%connection, ?peer, ?code, %message, "control request refused");
                        } else {
                            tracing::info!(%connection, ?peer, ?code, %message, "control request refused");
                        }
                    }
                    io.push(Io::Send(Arc::clone(stream), request_id, message));
                }
                Action::Close(connection) => {
                    if let Some((stream, _)) = shared.connections.get(&connection) {
                        io.push(Io::Close(Arc::clone(stream)));
                    }
                }
                // The upper switch's answer may take until its other racks register:
                // asked after the lock.
                Action::OpenSession { request, name, spec, workers, group } if self.upper.is_some() => {
                    io.push(Io::OpenInTree { request, name, spec, workers, group })
                }
                Action::OpenSession { request, name, spec, workers, .. } => {
                    let opened = self.open(request, &name, spec, workers, None);
                    shared.registry.handle_opened(request, opened);
                }
                // The data path is asked once the lock is released, as the sockets are
                // written: a data path busy for a while must not hold up registrations.
                Action::CloseSession { id, name, why } => io.push(Io::CloseSession { id, name, why }),
                Action::Depart { connection, id, rank } => io.push(Io::Depart { connection, id, rank }),
            }
        }
        io
    }

    /// Opens a session in the data path under a fresh token.
    fn open(
        &self,
        request: OpenRequest,
        name: &str,
        spec: SessionSpec,
        workers: Vec<Registered>,
        upstream: Option<UpstreamPath>,
    ) -> Result<Opened, OpenError> {
        // The token is the session's credential: unguessable, so only a CSPRNG will do.
        let token = rand::rngs::OsRng.next_u64();
        let opened = self.lanes.open(spec, token, workers, upstream).map(|id| Opened { id, token });
        match &opened {
            Ok(Opened { id, .. }) => {
                tracing::info!(%name, session = %session(*id), workers = spec.workers, "session open")
            }
            Err(error) => tracing::warn!(%name, ?request, %error, "session could not open"),
        }
        opened
    }

    /// Opens a rack's session at the upper switch, then in the data path, and keeps the
    /// upper switch's connection for the session's life.
    fn open_in_tree(
        &self,
        request: OpenRequest,
        name: &str,
        spec: SessionSpec,
        workers: Vec<Registered>,
        group: Group,
    ) -> Result<Opened, OpenError> {
        let Some(upper) = &self.upper else { return Err(OpenError::Unanswered) };
        let (stream, path) = tree::join(upper, name, spec, group).map_err(|why| {
            tracing::warn!(%name, %why, "the upper switch did not open the session");
            OpenError::Upstream(why)
        })?;
        let (upper_session, rank) = (path.upstream.session, path.upstream.rank);
        // Closing `stream` on failure tells the upper switch this rack left.
        let opened = self.open(request, name, spec, workers, Some(path))?;
        tracing::info!(%name, session = %session(opened.id), upper = %session(SessionId(upper_session)), "session open at the upper switch");
        let membership = Membership { stream: Arc::new(stream), session: upper_session, rank };
        self.memberships().insert(opened.id, membership);
        Ok(opened)
    }

    /// Watches the upper switch's connection of rack session `id` on a thread of its own,
    /// once the registry knows the session is open: what the upper switch says meanwhile
    /// waits in the socket.
    fn watch_upper(&self, id: SessionId) {
        let stream = self.memberships().get(&id).map(|membership| Arc::clone(&membership.stream));
        let (Some(stream), Some(upper), Some(plane)) = (stream, self.upper.clone(), self.me.upgrade()) else {
            return;
        };
        let watcher = std::thread::Builder::new().name(format!("upper-{}", session(id))).spawn(move || {
            let why = tree::watch(&stream, &upper);
            plane.upper_ended(id, why);
        });
        if let Err(error) = watcher {
            self.upper_ended(id, format!("cannot start a thread to watch the upper switch: {error}"));
        }
    }

    /// The upper switch's session of a rack's session `id` ended: so does the rack's, and
    /// its ranks are told why. Nothing if the rack's session ended first.
    fn upper_ended(&self, id: SessionId, why: String) {
        if self.stopping.load(Ordering::Acquire) || self.memberships().remove(&id).is_none() {
            return;
        }
        let counters = self.lanes.close(id);
        tracing::info!(session = %session(id), %why, ?counters, "session closed: its upper switch's ended");
        self.feed(|registry| registry.handle_session_ended(id, SessionEnd::Upstream(why)));
    }

    /// Closes a rack's session's connection to its upper switch, which tells the upper
    /// switch the rack left: after its last job (`leave`), or mid-job, which ends the
    /// upper session for every rack.
    fn leave_upper(&self, id: SessionId, leave: bool) {
        let Some(membership) = self.memberships().remove(&id) else { return };
        if leave {
            let message = ControlMessage::Leave { session: membership.session, rank: membership.rank };
            send(&membership.stream, 0, &message);
        }
        let _ = membership.stream.shutdown(Shutdown::Both);
    }

    /// Does what [`ControlPlane::perform`] left for after the lock, in the registry's
    /// order: writes and closings that never wait, and the data path's commands, whose
    /// answers go back to the registry.
    fn deliver(&self, io: Vec<Io>) {
        for io in io {
            match io {
                Io::Send(stream, request_id, message) => send(&stream, request_id, &message),
                Io::Close(stream) => {
                    let _ = stream.shutdown(Shutdown::Both);
                }
                Io::CloseSession { id, name, why } => {
                    let counters = self.lanes.close(id);
                    tracing::info!(%name, session = %session(id), ?counters, "session closed: {why}");
                    self.leave_upper(id, why == Closure::AllLeft);
                }
                Io::OpenInTree { request, name, spec, workers, group } => {
                    let opened = self.open_in_tree(request, &name, spec, workers, group);
                    let id = opened.as_ref().ok().map(|opened| opened.id);
                    self.feed(|registry| registry.handle_opened(request, opened));
                    if let Some(id) = id {
                        self.watch_upper(id);
                    }
                }
                Io::Depart { connection, id, rank } => {
                    let departure = self.lanes.depart(id, rank);
                    tracing::debug!(%connection, session = %session(id), rank, ?departure, "rank left");
                    self.feed(|registry| registry.handle_departure(connection, departure));
                }
            }
        }
    }
}

/// A session's id as the log shows it.
fn session(id: SessionId) -> String {
    format!("{:#010x}", id.0)
}

/// Events that a flood could repeat thousands of times a second, logged once per
/// [`LOG_INTERVAL`] with how many there were.
#[derive(Default)]
struct Throttled {
    count: u64,
    last_logged: Option<Instant>,
}

impl Throttled {
    fn note(&mut self, log: impl FnOnce(u64)) {
        self.count += 1;
        if self.last_logged.is_none_or(|at| at.elapsed() >= LOG_INTERVAL) {
            log(self.count);
            self.count = 0;
            self.last_logged = Some(Instant::now());
        }
    }
}

/// Writes one message without waiting. A control message is small next to a socket's
/// send buffer, so a socket that cannot take it whole belongs to a client that stopped
/// reading: it is shut down, which ends its connection, rather than waited for.
fn send(stream: &TcpStream, request_id: u32, message: &ControlMessage) {
    let mut bytes = vec![0u8; message.buffer_len()];
    if message.emit(request_id, &mut bytes).is_err() {
        return;
    }
    match write_now(stream, &bytes) {
        Delivery::Sent => return,
        // The client left first, as a rank that finished does: nothing to report.
        Delivery::Gone(error) => {
            tracing::debug!(peer = ?stream.peer_addr().ok(), %error, "control connection closed by its client")
        }
        Delivery::Stalled => {
            tracing::info!(peer = ?stream.peer_addr().ok(), "control connection closed: its client does not read")
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Whether `stream`'s client has closed it (sent its end, or reset it), even if what it
/// sent before is still unread.
fn closed_by_client(stream: &TcpStream) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let ended = PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR;
    let mut polled = [PollFd::new(stream, ended)];
    // A zero timeout: only what the socket already knows.
    let now = Timespec { tv_sec: 0, tv_nsec: 0 };
    poll(&mut polled, Some(&now)).is_ok() && polled[0].revents().intersects(ended)
}

/// What became of a message written without waiting.
#[derive(Debug)]
enum Delivery {
    Sent,
    /// The client had closed the connection.
    Gone(std::io::Error),
    /// The socket could not take the whole message: its client does not read.
    Stalled,
}

fn write_now(stream: &TcpStream, bytes: &[u8]) -> Delivery {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, NotConnected};
    match socket2::SockRef::from(stream).send_with_flags(bytes, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
        Ok(n) if n == bytes.len() => Delivery::Sent,
        Err(error)
            if matches!(error.kind(), BrokenPipe | ConnectionReset | ConnectionAborted | NotConnected) =>
        {
            Delivery::Gone(error)
        }
        _ => Delivery::Stalled,
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::time::Duration;

    use super::*;

    /// A connected pair on loopback: (the switch's end, the client's end).
    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (listener.accept().unwrap().0, client)
    }

    #[test]
    fn a_client_that_left_is_gone_not_stalled() {
        let (switch_end, client) = pair();
        // Closed with a reset, as a process that exits with unread data closes.
        socket2::SockRef::from(&client).set_linger(Some(Duration::ZERO)).unwrap();
        drop(client);
        std::thread::sleep(Duration::from_millis(50));
        assert!(matches!(write_now(&switch_end, b"notice"), Delivery::Gone(_)));
    }

    #[test]
    fn a_client_that_does_not_read_stalls_once_its_buffers_are_full() {
        let (switch_end, _client) = pair();
        let message = [0u8; 4096];
        let mut sent = 0;
        let last = loop {
            match write_now(&switch_end, &message) {
                Delivery::Sent if sent < 100_000 => sent += 1,
                other => break other,
            }
        };
        assert!(matches!(last, Delivery::Stalled), "{last:?} after {sent} messages");
        assert!(sent > 0);
    }
}
