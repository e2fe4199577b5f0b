//! The control plane: workers register over TCP; when every rank of a session has
//! registered, the session opens in the engine and every rank gets an `accept`.
//!
//! Each worker keeps its connection open for the life of the session. When one closes
//! (a worker exits or is killed) or leaves while a round waits for it, the session is
//! closed at once, its slots are freed, and the remaining ranks are told, so their jobs
//! fail fast instead of timing out, and a new set of workers can register under the
//! same name right away. A rank that leaves after its last job, with no round waiting
//! for it, ends nothing: the others may still be recovering the last results lost on
//! their way, which the switch retains. The session closes when every rank has left, or
//! as soon as a round needs one that has (the data path says so).
//!
//! No client can stall another. The registry's lock is never held while a socket is
//! written: what to send is decided under the lock and sent after it. Every write is
//! non-blocking: a control message is a few hundred bytes, and a client whose socket
//! cannot take one has stopped reading, so it is disconnected rather than waited for.
//! Connections, and sessions open or assembling, are bounded; a connection must
//! register within the registration timeout, and its session must assemble within the
//! same time after that, or it is refused and closed.
//!
//! One thread per connection, each blocked in a read: connections are few and live as
//! long as their sessions, the caps bound the threads, and the code of a connection
//! stays sequential. What made threads costly (blocking writes under the lock, no caps)
//! is gone; an event loop would buy nothing more here.
//!
//! The plane keeps every connection's stream and thread, so that a switch stopped in
//! process closes them all and joins their threads instead of leaving them behind.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use netagg_aggregator::engine::SessionCounters;
use netagg_aggregator::{Departure, SessionId, SessionSpec};
use netagg_config::IpNet;
use netagg_wire::{packet, ControlMessage, Endpoint, RejectCode, ValueEncoding, WireError};
use rand::RngCore;

use crate::datapath::{Command, Event, OpenError, Registered};

/// What every rank of a session must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Shape {
    world_size: u16,
    packet_elements: u16,
    slots: u16,
    depth: u8,
    encoding: ValueEncoding,
    sparse_blocks: bool,
    threads: usize,
}

/// A connection's stream, shared by its thread, the plane's list of connections and the
/// registry: one descriptor per connection.
type Stream = Arc<TcpStream>;

struct Member {
    /// The connection this registration came on; a departure acts only on its own.
    connection: u64,
    stream: Stream,
    request_id: u32,
    /// Where the data path reaches this worker's threads.
    registered: Registered,
}

struct Pending {
    shape: Shape,
    /// The rank whose registration fixed the shape, for mismatch messages.
    first_rank: u16,
    members: BTreeMap<u16, Member>,
}

struct Open {
    id: SessionId,
    /// Per rank: its connection's number and stream.
    members: BTreeMap<u16, (u64, Stream)>,
    /// Ranks that left after their last job while the others still recover theirs: their
    /// connections' closing ends nothing.
    departed: BTreeSet<u16>,
}

#[derive(Default)]
struct Registry {
    pending: HashMap<String, Pending>,
    open: HashMap<String, Open>,
}

/// What the control plane allows, from the `[switch]` settings.
#[derive(Debug, Clone)]
pub struct ControlLimits {
    /// Control connections at once; more are refused as they arrive.
    pub max_connections: usize,
    /// Sessions open or assembling at once.
    pub max_sessions: u16,
    /// Workers in one session.
    pub max_workers: u16,
    /// How long a connection may take to register, and its session to assemble after.
    pub register_timeout: Duration,
    /// Where a data endpoint may be other than at its registration's address.
    pub data_networks: Vec<IpNet>,
    /// The longest datagram the data port carries, if it has a limit (a DPDK port's
    /// MTU): sessions whose packets would be longer are refused.
    pub max_datagram: Option<usize>,
}

/// Refuses an endpoint elsewhere than at `peer`, the address its registration came from,
/// unless it is inside `data_networks`: a switch that sent results wherever a
/// registration pointed would let anyone aim every result of a session at a third
/// party.
fn check_address(endpoint: &Endpoint, peer: IpAddr, data_networks: &[IpNet]) -> Result<(), String> {
    // Every kind of endpoint names where results go: a new kind must say how it is checked.
    let ip = match endpoint {
        Endpoint::Udp(_) => endpoint.address(peer).ip().to_canonical(),
        // Results go back over the connection the endpoint's tag opens, wherever it comes
        // from: no one else receives them.
        Endpoint::Rdma { .. } => return Ok(()),
    };
    if ip == peer.to_canonical() || data_networks.iter().any(|network| network.contains(&ip)) {
        return Ok(());
    }
    Err(format!(
        "its endpoint {endpoint} is not at {peer}, where it registered from: a worker receives at the \
         address it registers from, unless switch.data_networks holds its address"
    ))
}

/// Messages to send once the registry's lock is released.
type Outgoing = Vec<(Stream, u32, ControlMessage)>;

pub struct ControlPlane {
    registry: Mutex<Registry>,
    next_connection: AtomicU64,
    /// Each live connection's stream and thread, by connection number.
    connections: Mutex<HashMap<u64, (Stream, JoinHandle<()>)>>,
    /// Set when the switch stops: the acceptor takes no more connections, and closing
    /// connections no longer counts as ranks leaving.
    stopping: AtomicBool,
    commands: Sender<Command>,
    /// The data path's endpoint, announced in every accept: registrations must name
    /// endpoints of its kind.
    data_endpoint: Endpoint,
    limits: ControlLimits,
}

type Rejection = (RejectCode, String);

/// The longest the acceptor waits after `accept` fails before it tries again (out of
/// descriptors, say: retrying at once would spin).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// How often a repeated event of the acceptor is logged at most.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

impl ControlPlane {
    pub fn new(
        commands: Sender<Command>,
        data_endpoint: Endpoint,
        limits: ControlLimits,
    ) -> Arc<ControlPlane> {
        Arc::new(ControlPlane {
            registry: Mutex::default(),
            next_connection: AtomicU64::new(0),
            connections: Mutex::default(),
            stopping: AtomicBool::new(false),
            commands,
            data_endpoint,
            limits,
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
                        let max = self.limits.max_connections;
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
        let stream = Arc::new(stream);
        // Held until the thread is recorded: the thread's own removal of its entry, when
        // it ends, waits for this lock, so it cannot come first and leave a stale entry.
        let mut connections = self.lock_connections();
        if connections.len() >= self.limits.max_connections {
            drop(connections);
            let message = format!(
                "the switch serves at most {} control connections at once; try again later",
                self.limits.max_connections
            );
            send(&stream, 0, &ControlMessage::Reject { code: RejectCode::Limit, message });
            return false;
        }
        let connection = self.next_connection.fetch_add(1, Ordering::Relaxed);
        let plane = Arc::clone(self);
        let handle = Arc::clone(&stream);
        let thread = std::thread::Builder::new().name(format!("control-{connection}")).spawn(move || {
            plane.connection(connection, stream);
            plane.lock_connections().remove(&connection);
        });
        match thread {
            Ok(thread) => {
                connections.insert(connection, (handle, thread));
            }
            Err(error) => tracing::warn!(%error, "cannot start a thread for a control connection"),
        }
        true
    }

    /// Makes [`ControlPlane::serve`] return at its next connection.
    pub fn stop_accepting(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Closes every connection and waits for its thread; call after the acceptor has
    /// stopped, so that none starts meanwhile. Workers see their connection close, as
    /// when the switch process exits.
    pub fn close_connections(&self) {
        self.stopping.store(true, Ordering::Release);
        let connections: Vec<_> = self.lock_connections().drain().map(|(_, entry)| entry).collect();
        for (stream, thread) in connections {
            // Ends the thread's blocking read.
            let _ = stream.shutdown(Shutdown::Both);
            let _ = thread.join();
        }
    }

    /// Tells the ranks of sessions the data path closed why, and forgets those sessions.
    pub fn handle_events(self: &Arc<Self>, events: crossbeam_channel::Receiver<Event>) {
        for event in events {
            let id = match event {
                Event::Expired(id) | Event::Orphaned { id, .. } => id,
            };
            let open = {
                let mut registry = self.lock();
                let name = registry.open.iter().find(|(_, open)| open.id == id).map(|(name, _)| name.clone());
                name.and_then(|name| Some((registry.open.remove(&name)?, name)))
            };
            let Some((open, name)) = open else { continue };
            let message = match event {
                Event::Expired(_) => format!("session '{name}' expired: no packets for the idle timeout"),
                Event::Orphaned { departed, counters, .. } => {
                    tracing::info!(%name, rank = departed, ?counters, "session closed: a round needs a rank that left");
                    departed_message(departed, &name)
                }
            };
            tell_remaining(open, &message);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        // A panicking connection thread must not take the whole control plane with it.
        self.registry.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock_connections(&self) -> MutexGuard<'_, HashMap<u64, (Stream, JoinHandle<()>)>> {
        self.connections.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn connection(&self, connection: u64, stream: Stream) {
        let peer = match stream.peer_addr() {
            Ok(peer) => peer,
            Err(_) => return,
        };
        // A host that crashes sends no FIN: keepalive probes find out within a minute.
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(20))
            .with_interval(Duration::from_secs(10))
            .with_retries(3);
        let _ = socket2::SockRef::from(&*stream).set_tcp_keepalive(&keepalive);
        // A connection that never registers must not hold its thread forever.
        let _ = stream.set_read_timeout(Some(self.limits.register_timeout));
        // Set once this connection's registration is in: its session and rank, and when
        // the session must have assembled.
        let mut membership: Option<(String, u16, Instant)> = None;
        loop {
            let (request_id, message) = match ControlMessage::read_from(&mut &*stream) {
                Ok(message) => message,
                Err(error) if error.kind() == io::ErrorKind::InvalidData => {
                    let wire = error.get_ref().and_then(|e| e.downcast_ref::<WireError>());
                    let code = match wire {
                        Some(WireError::Version { .. }) => RejectCode::Version,
                        Some(WireError::UnknownEndpoint(_)) => RejectCode::Transport,
                        _ => RejectCode::Malformed,
                    };
                    send(&stream, 0, &ControlMessage::Reject { code, message: error.to_string() });
                    break;
                }
                Err(error) if matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    let Some((name, rank, deadline)) = &membership else {
                        let waited = self.limits.register_timeout;
                        let message = format!("no registration within {waited:?} of connecting");
                        send(&stream, 0, &ControlMessage::Reject { code: RejectCode::Malformed, message });
                        break;
                    };
                    match self.assembly(name, *rank, connection, *deadline) {
                        // Open: the connection now lives as long as the session.
                        Assembly::Open => {
                            let _ = stream.set_read_timeout(None);
                        }
                        Assembly::Waiting(left) => {
                            let _ = stream.set_read_timeout(Some(left));
                        }
                        Assembly::Withdrawn(message) => {
                            tracing::info!(%peer, %name, rank, %message, "registration withdrawn");
                            send(&stream, 0, &ControlMessage::Reject { code: RejectCode::Limit, message });
                            // Withdrawn already: nothing is left to depart from.
                            membership = None;
                            break;
                        }
                    }
                    continue;
                }
                Err(error) => {
                    if error.kind() != io::ErrorKind::UnexpectedEof {
                        tracing::debug!(%peer, %error, "control connection failed");
                    }
                    break;
                }
            };
            match message {
                ControlMessage::Register {
                    rank,
                    world_size,
                    packet_elements,
                    slots,
                    depth,
                    encoding,
                    sparse_blocks,
                    name,
                    endpoints,
                } if membership.is_none() => {
                    let shape = Shape {
                        world_size,
                        packet_elements,
                        slots,
                        depth,
                        encoding,
                        sparse_blocks,
                        threads: endpoints.len(),
                    };
                    let registered = Registered { peer: peer.ip(), endpoints };
                    let member = Member { connection, stream: Arc::clone(&stream), request_id, registered };
                    match self.register(&name, rank, shape, member) {
                        Ok(outgoing) => {
                            // The session must assemble within the timeout from now on;
                            // once open, the connection lives as long as the session.
                            let deadline = Instant::now() + self.limits.register_timeout;
                            membership = Some((name, rank, deadline));
                            deliver(outgoing);
                        }
                        Err((code, message)) => {
                            tracing::info!(%peer, %name, rank, %message, "registration rejected");
                            send(&stream, request_id, &ControlMessage::Reject { code, message });
                            // Closed after the reject: a client cannot pile up replies
                            // it never reads.
                            break;
                        }
                    }
                }
                ControlMessage::Leave { .. } => {
                    if let Some((name, rank, _)) = &membership {
                        self.leave(name, *rank, connection);
                    }
                    break;
                }
                _ => {
                    let message = "expected one register, then nothing until leave".to_string();
                    send(
                        &stream,
                        request_id,
                        &ControlMessage::Reject { code: RejectCode::Malformed, message },
                    );
                    break;
                }
            }
        }
        if let Some((name, rank, _)) = membership {
            self.depart(&name, rank, connection);
        }
        let _ = stream.shutdown(Shutdown::Both);
    }

    fn register(&self, name: &str, rank: u16, shape: Shape, member: Member) -> Result<Outgoing, Rejection> {
        if rank >= shape.world_size {
            return Err((
                RejectCode::RankOutOfRange,
                format!("rank {rank} is not below the world size {}", shape.world_size),
            ));
        }
        if shape.world_size > self.limits.max_workers {
            return Err((
                RejectCode::Limit,
                format!(
                    "a world of {} workers is above this switch's limit of {}",
                    shape.world_size, self.limits.max_workers
                ),
            ));
        }
        let datagram = packet::datagram_len(usize::from(shape.packet_elements));
        if let Some(max) = self.limits.max_datagram.filter(|&max| datagram > max) {
            return Err((
                RejectCode::Limit,
                format!(
                    "packets of {} elements make {datagram}-byte datagrams; this switch's data path carries \
                     at most {max} bytes (its MTU): the largest packet_numel that fits is {}",
                    shape.packet_elements,
                    packet::elements_within(max)
                ),
            ));
        }
        if shape.slots as usize % shape.threads != 0 || (shape.slots as usize) < shape.threads {
            return Err((
                RejectCode::Malformed,
                format!("{} slots do not divide among {} threads", shape.slots, shape.threads),
            ));
        }
        let served = self.data_endpoint.kind();
        if let Some(other) = member.registered.endpoints.iter().find(|e| e.kind() != served) {
            return Err((
                RejectCode::Transport,
                format!(
                    "this switch's data path speaks {served}; rank {rank} registered a {} endpoint",
                    other.kind()
                ),
            ));
        }
        for endpoint in &member.registered.endpoints {
            check_address(endpoint, member.registered.peer, &self.limits.data_networks)
                .map_err(|message| (RejectCode::Transport, format!("rank {rank}: {message}")))?;
        }
        let mut registry = self.lock();
        // A session some rank has left after its last job is ending: the same program's
        // next context (or its restart) may assemble under its name beside it.
        if registry.open.get(name).is_some_and(|open| open.departed.is_empty()) {
            return Err((
                RejectCode::DuplicateRank,
                format!("session '{name}' is already running with all its ranks"),
            ));
        }
        let sessions = registry.open.len() + registry.pending.len();
        if !registry.pending.contains_key(name) && sessions >= self.limits.max_sessions as usize {
            return Err((
                RejectCode::Limit,
                format!(
                    "{sessions} sessions are open or assembling, the limit is {}",
                    self.limits.max_sessions
                ),
            ));
        }
        let pending = registry.pending.entry(name.to_string()).or_insert_with(|| Pending {
            shape: shape.clone(),
            first_rank: rank,
            members: BTreeMap::new(),
        });
        if pending.members.contains_key(&rank) {
            return Err((
                RejectCode::DuplicateRank,
                format!("rank {rank} is already registered in session '{name}'"),
            ));
        }
        let differences = describe_differences(&pending.shape, &shape);
        if !differences.is_empty() {
            let first = pending.first_rank;
            return Err((
                RejectCode::Mismatch,
                format!("rank {rank} differs from rank {first}: {differences}"),
            ));
        }
        pending.members.insert(rank, member);
        tracing::info!(%name, rank, joined = pending.members.len(), world = shape.world_size, "worker registered");
        if pending.members.len() < shape.world_size as usize {
            return Ok(Vec::new());
        }
        let Some(pending) = registry.pending.remove(name) else { return Ok(Vec::new()) };
        // The session it supersedes, whose ranks have not all left: closed, and those
        // ranks told (they were still recovering results, or are a program's stale half).
        let superseded = registry.open.remove(name);
        let mut outgoing = self.open(&mut registry, name, pending);
        if let Some(old) = superseded {
            let counters = self.close_in_data_path(old.id);
            let Some(&departed) = old.departed.iter().next() else { return Ok(outgoing) };
            tracing::info!(%name, rank = departed, ?counters, "session closed: a new one assembled under its name");
            outgoing.extend(notices(old, &departed_message(departed, name)));
        }
        Ok(outgoing)
    }

    /// Opens a session whose every rank has registered; returns the answers to them all.
    fn open(&self, registry: &mut Registry, name: &str, pending: Pending) -> Outgoing {
        let shape = &pending.shape;
        let spec = SessionSpec {
            workers: shape.world_size,
            slots: shape.slots,
            packet_elements: shape.packet_elements,
            depth: shape.depth,
        };
        let workers = pending.members.values().map(|m| m.registered.clone()).collect();
        // The token is the session's credential: unguessable, so only a CSPRNG will do.
        let token = rand::rngs::OsRng.next_u64();
        let (reply, result) = crossbeam_channel::bounded(1);
        // The data path answers between two receive calls, within milliseconds: waiting
        // for it under the lock keeps a session's opening atomic for the other
        // connections, and involves no socket.
        let opened = self
            .commands
            .send(Command::Open { spec, token, workers, reply })
            .ok()
            .and_then(|()| result.recv_timeout(Duration::from_secs(5)).ok());
        let outcome = match opened {
            Some(Ok(id)) => Ok(id),
            Some(Err(OpenError::Session(error))) => Err((RejectCode::Limit, error.to_string())),
            Some(Err(OpenError::Endpoint(message))) => Err((RejectCode::Transport, message)),
            None => Err((RejectCode::Limit, "the data path is not running".to_string())),
        };
        let mut outgoing = Vec::new();
        let mut streams = BTreeMap::new();
        for (rank, member) in pending.members {
            let message = match &outcome {
                Ok(id) => ControlMessage::Accept {
                    session: id.0,
                    rank,
                    world_size: shape.world_size,
                    packet_elements: shape.packet_elements,
                    slots: shape.slots,
                    depth: shape.depth,
                    token,
                    data: self.data_endpoint,
                },
                Err((code, message)) => ControlMessage::Reject { code: *code, message: message.clone() },
            };
            outgoing.push((Arc::clone(&member.stream), member.request_id, message));
            streams.insert(rank, (member.connection, member.stream));
        }
        match outcome {
            Ok(id) => {
                tracing::info!(%name, session = format_args!("{:#010x}", id.0), workers = shape.world_size, "session open");
                registry
                    .open
                    .insert(name.to_string(), Open { id, members: streams, departed: BTreeSet::new() });
            }
            Err((_, message)) => tracing::warn!(%name, %message, "session could not open"),
        }
        outgoing
    }

    /// Whether the session `connection` registered in as `rank` has opened, may still
    /// assemble, or is overdue at `deadline` (the registration is then withdrawn).
    fn assembly(&self, name: &str, rank: u16, connection: u64, deadline: Instant) -> Assembly {
        let mut registry = self.lock();
        let Some(pending) = registry.pending.get_mut(name) else { return Assembly::Open };
        if pending.members.get(&rank).is_none_or(|m| m.connection != connection) {
            return Assembly::Open;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if !left.is_zero() {
            return Assembly::Waiting(left);
        }
        let (joined, world) = (pending.members.len(), pending.shape.world_size);
        pending.members.remove(&rank);
        if pending.members.is_empty() {
            registry.pending.remove(name);
        }
        Assembly::Withdrawn(format!(
            "session '{name}' did not assemble within {:?}: {joined} of {world} ranks registered",
            self.limits.register_timeout
        ))
    }

    /// A rank left or its connection closed: a pending registration is withdrawn; an
    /// open session closes and its other ranks are told why. Only the session that
    /// `connection` registered in is touched: a later one of the same name is not its.
    fn depart(&self, name: &str, rank: u16, connection: u64) {
        // A stopping switch ends every session with itself: no rank left, and the other
        // ranks' connections are closing anyway.
        if self.stopping.load(Ordering::Acquire) {
            return;
        }
        let open = {
            let mut registry = self.lock();
            if let Some(pending) = registry.pending.get_mut(name) {
                if pending.members.get(&rank).is_some_and(|m| m.connection == connection) {
                    pending.members.remove(&rank);
                    if pending.members.is_empty() {
                        registry.pending.remove(name);
                    }
                }
                return;
            }
            // A rank that left after its last job ended nothing by closing.
            let ours = registry.open.get(name).is_some_and(|o| {
                o.members.get(&rank).is_some_and(|(c, _)| *c == connection) && !o.departed.contains(&rank)
            });
            if !ours {
                return;
            }
            let Some(open) = registry.open.remove(name) else { return };
            open
        };
        let counters = self.close_in_data_path(open.id);
        tracing::info!(%name, rank, ?counters, "session closed: a rank left");
        let mut open = open;
        open.departed.insert(rank);
        tell_remaining(open, &departed_message(rank, name));
    }

    /// A rank said it leaves, its jobs done. If no round waits for it, the session stays
    /// open for the others, who may still be recovering the last results lost on the
    /// way to them, until they leave too (or a round needs the rank: the data path then
    /// closes the session, [`Event::Orphaned`]). Otherwise its connection's closing
    /// closes the session, as any rank's that leaves mid-job.
    fn leave(&self, name: &str, rank: u16, connection: u64) {
        let id = {
            let registry = self.lock();
            match registry.open.get(name) {
                Some(open) if open.members.get(&rank).is_some_and(|(c, _)| *c == connection) => open.id,
                _ => return,
            }
        };
        let (reply, departure) = crossbeam_channel::bounded(1);
        let departure = self
            .commands
            .send(Command::Depart { id, rank, reply })
            .ok()
            .and_then(|()| departure.recv_timeout(Duration::from_secs(5)).ok())
            .flatten();
        match departure {
            Some(Departure::Lingers) => {
                if let Some(open) = self.lock().open.get_mut(name).filter(|open| open.id == id) {
                    open.departed.insert(rank);
                }
                tracing::debug!(%name, rank, "rank left after its last job; the session serves the others");
            }
            Some(Departure::AllGone) => {
                let closed = {
                    let mut registry = self.lock();
                    let ours = registry.open.get(name).is_some_and(|open| open.id == id);
                    if ours {
                        registry.open.remove(name)
                    } else {
                        None
                    }
                };
                if closed.is_some() {
                    let counters = self.close_in_data_path(id);
                    tracing::info!(%name, ?counters, "session closed: every rank left");
                }
            }
            // Needed mid-job, or the session is gone: the connection's closing decides.
            Some(Departure::Needed) | None => {}
        }
    }

    /// Closes a session in the data path; its final counters, if it was open there.
    fn close_in_data_path(&self, id: SessionId) -> Option<SessionCounters> {
        let (reply, result) = crossbeam_channel::bounded(1);
        self.commands
            .send(Command::Close { id, reply })
            .ok()
            .and_then(|()| result.recv_timeout(Duration::from_secs(5)).ok())
            .flatten()
    }
}

/// Why a session closed when a rank left.
fn departed_message(rank: u16, name: &str) -> String {
    format!("rank {rank} left session '{name}'; the session is closed")
}

/// Tells the ranks of a closed session that have not left why it closed.
fn tell_remaining(open: Open, message: &str) {
    deliver(notices(open, message));
}

/// What tells the ranks of a closed session that have not left why it closed.
fn notices(open: Open, message: &str) -> Outgoing {
    let remaining = open.members.into_iter().filter(|(rank, _)| !open.departed.contains(rank));
    let reject = ControlMessage::Reject { code: RejectCode::UnknownSession, message: message.to_string() };
    remaining.map(|(_, (_, stream))| (stream, 0, reject.clone())).collect()
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

/// Where a pending registration's session stands, for its connection's thread.
enum Assembly {
    /// Opened (or gone): the connection waits for nothing any more.
    Open,
    /// Still assembling, for at most this long.
    Waiting(Duration),
    /// Overdue: withdrawn, with the message that says so.
    Withdrawn(String),
}

fn describe_differences(expected: &Shape, got: &Shape) -> String {
    let mut differences = Vec::new();
    let mut compare = |what: &str, a: String, b: String| {
        if a != b {
            differences.push(format!("{what} {b} instead of {a}"));
        }
    };
    compare("world size", expected.world_size.to_string(), got.world_size.to_string());
    compare("packet elements", expected.packet_elements.to_string(), got.packet_elements.to_string());
    compare("slots", expected.slots.to_string(), got.slots.to_string());
    compare("depth", expected.depth.to_string(), got.depth.to_string());
    compare("encoding", format!("{:?}", expected.encoding), format!("{:?}", got.encoding));
    let sparse =
        |shape: &Shape| if shape.sparse_blocks { "sparse = auto" } else { "sparse = off" }.to_string();
    compare("blocks", sparse(expected), sparse(got));
    compare("worker threads", expected.threads.to_string(), got.threads.to_string());
    differences.join(", ")
}

/// Sends what the lock's holder decided to send, now that the lock is released.
fn deliver(outgoing: Outgoing) {
    for (stream, request_id, message) in outgoing {
        send(&stream, request_id, &message);
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
