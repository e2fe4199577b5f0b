//! The control plane: workers register over TCP; when every rank of a session has
//! registered, the session opens in the engine and every rank gets an `accept`.
//!
//! Each worker keeps its connection open for the life of the session. When one closes
//! (a worker exits or is killed) or leaves, the session is closed at once, its slots are
//! freed, and the remaining ranks are told, so their jobs fail fast instead of timing
//! out, and a new set of workers can register under the same name right away.
//!
//! The plane keeps every connection's stream and thread, so that a switch stopped in
//! process closes them all and joins their threads instead of leaving them behind.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use netagg_aggregator::{SessionId, SessionSpec};
use netagg_wire::{ControlMessage, Endpoint, RejectCode, ValueEncoding, WireError};
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

struct Member {
    /// The connection this registration came on; a departure acts only on its own.
    connection: u64,
    stream: TcpStream,
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
    members: BTreeMap<u16, (u64, TcpStream)>,
}

#[derive(Default)]
struct Registry {
    pending: HashMap<String, Pending>,
    open: HashMap<String, Open>,
}

pub struct ControlPlane {
    registry: Mutex<Registry>,
    next_connection: AtomicU64,
    /// Each live connection's stream and thread, by connection number.
    connections: Mutex<HashMap<u64, (TcpStream, JoinHandle<()>)>>,
    /// Set when the switch stops: the acceptor takes no more connections, and closing
    /// connections no longer counts as ranks leaving.
    stopping: AtomicBool,
    commands: Sender<Command>,
    /// The data path's endpoint, announced in every accept: registrations must name
    /// endpoints of its kind.
    data_endpoint: Endpoint,
}

type Rejection = (RejectCode, String);

/// How long a new connection may take to register.
const REGISTER_WAIT: Duration = Duration::from_secs(60);

impl ControlPlane {
    pub fn new(commands: Sender<Command>, data_endpoint: Endpoint) -> Arc<ControlPlane> {
        Arc::new(ControlPlane {
            registry: Mutex::default(),
            next_connection: AtomicU64::new(0),
            connections: Mutex::default(),
            stopping: AtomicBool::new(false),
            commands,
            data_endpoint,
        })
    }

    /// Accepts connections until [`ControlPlane::stop_accepting`] and one more
    /// connection (which only wakes it); one thread per connection.
    pub fn serve(self: &Arc<Self>, listener: TcpListener) {
        for stream in listener.incoming() {
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            match stream {
                Ok(stream) => self.start_connection(stream),
                Err(error) => tracing::warn!(%error, "accepting a control connection failed"),
            }
        }
    }

    fn start_connection(self: &Arc<Self>, stream: TcpStream) {
        let connection = self.next_connection.fetch_add(1, Ordering::Relaxed);
        let Ok(handle) = stream.try_clone() else { return };
        let plane = Arc::clone(self);
        // Held until the thread is recorded: the thread's own removal of its entry, when
        // it ends, waits for this lock, so it cannot come first and leave a stale entry.
        let mut connections = self.lock_connections();
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
            // Ends the thread's blocking read or write.
            let _ = stream.shutdown(Shutdown::Both);
            let _ = thread.join();
        }
    }

    /// Tells the ranks of sessions the data path expired, and forgets those sessions.
    pub fn handle_events(self: &Arc<Self>, events: crossbeam_channel::Receiver<Event>) {
        for Event::Expired(id) in events {
            let mut registry = self.lock();
            let Some(name) =
                registry.open.iter().find(|(_, open)| open.id == id).map(|(name, _)| name.clone())
            else {
                continue;
            };
            if let Some(open) = registry.open.remove(&name) {
                let message = format!("session '{name}' expired: no packets for the idle timeout");
                for (_, mut stream) in open.members.into_values() {
                    let _ = send(
                        &mut stream,
                        0,
                        &ControlMessage::Reject {
                            code: RejectCode::UnknownSession,
                            message: message.clone(),
                        },
                    );
                }
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        // A panicking connection thread must not take the whole control plane with it.
        self.registry.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock_connections(&self) -> MutexGuard<'_, HashMap<u64, (TcpStream, JoinHandle<()>)>> {
        self.connections.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn connection(&self, connection: u64, mut stream: TcpStream) {
        let peer = match stream.peer_addr() {
            Ok(peer) => peer,
            Err(_) => return,
        };
        // A host that crashes sends no FIN: keepalive probes find out within a minute.
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(20))
            .with_interval(Duration::from_secs(10))
            .with_retries(3);
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
        // A connection that never registers must not hold its thread forever.
        let _ = stream.set_read_timeout(Some(REGISTER_WAIT));
        let mut membership: Option<(String, u16)> = None;
        loop {
            let (request_id, message) = match ControlMessage::read_from(&mut stream) {
                Ok(message) => message,
                Err(error) if error.kind() == io::ErrorKind::InvalidData => {
                    let wire = error.get_ref().and_then(|e| e.downcast_ref::<WireError>());
                    let code = match wire {
                        Some(WireError::Version { .. }) => RejectCode::Version,
                        Some(WireError::UnknownEndpoint(_)) => RejectCode::Transport,
                        _ => RejectCode::Malformed,
                    };
                    let _ =
                        send(&mut stream, 0, &ControlMessage::Reject { code, message: error.to_string() });
                    break;
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
                    let member = match stream.try_clone() {
                        Ok(clone) => Member { connection, stream: clone, request_id, registered },
                        Err(_) => break,
                    };
                    match self.register(&name, rank, shape, member) {
                        Ok(()) => {
                            // Registered: the connection now lives as long as the session.
                            let _ = stream.set_read_timeout(None);
                            membership = Some((name, rank));
                        }
                        Err((code, message)) => {
                            tracing::info!(%peer, %name, rank, %message, "registration rejected");
                            let _ = send(&mut stream, request_id, &ControlMessage::Reject { code, message });
                        }
                    }
                }
                ControlMessage::Leave { .. } => break,
                _ => {
                    let message = "expected one register, then nothing until leave".to_string();
                    let _ = send(
                        &mut stream,
                        request_id,
                        &ControlMessage::Reject { code: RejectCode::Malformed, message },
                    );
                    break;
                }
            }
        }
        if let Some((name, rank)) = membership {
            self.depart(&name, rank, connection);
        }
    }

    fn register(&self, name: &str, rank: u16, shape: Shape, member: Member) -> Result<(), Rejection> {
        if rank >= shape.world_size {
            return Err((
                RejectCode::RankOutOfRange,
                format!("rank {rank} is not below the world size {}", shape.world_size),
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
        let mut registry = self.lock();
        if registry.open.contains_key(name) {
            return Err((
                RejectCode::DuplicateRank,
                format!("session '{name}' is already running with all its ranks"),
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
            return Ok(());
        }
        let Some(pending) = registry.pending.remove(name) else { return Ok(()) };
        self.open(&mut registry, name, pending);
        Ok(())
    }

    /// Opens a session whose every rank has registered, and answers them all.
    fn open(&self, registry: &mut Registry, name: &str, pending: Pending) {
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
        let mut streams = BTreeMap::new();
        for (rank, mut member) in pending.members {
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
            let _ = send(&mut member.stream, member.request_id, &message);
            streams.insert(rank, (member.connection, member.stream));
        }
        match outcome {
            Ok(id) => {
                tracing::info!(%name, session = format_args!("{:#010x}", id.0), workers = shape.world_size, "session open");
                registry.open.insert(name.to_string(), Open { id, members: streams });
            }
            Err((_, message)) => tracing::warn!(%name, %message, "session could not open"),
        }
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
        let ours = registry
            .open
            .get(name)
            .is_some_and(|o| o.members.get(&rank).is_some_and(|(c, _)| *c == connection));
        if !ours {
            return;
        }
        let Some(open) = registry.open.remove(name) else { return };
        let (reply, result) = crossbeam_channel::bounded(1);
        let counters = self
            .commands
            .send(Command::Close { id: open.id, reply })
            .ok()
            .and_then(|()| result.recv_timeout(Duration::from_secs(5)).ok())
            .flatten();
        tracing::info!(%name, rank, ?counters, "session closed: a rank left");
        let message = format!("rank {rank} left session '{name}'; the session is closed");
        for (other, (_, mut stream)) in open.members {
            if other != rank {
                let _ = send(
                    &mut stream,
                    0,
                    &ControlMessage::Reject { code: RejectCode::UnknownSession, message: message.clone() },
                );
            }
        }
    }
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

fn send(stream: &mut TcpStream, request_id: u32, message: &ControlMessage) -> io::Result<()> {
    message.write_to(request_id, stream)
}
