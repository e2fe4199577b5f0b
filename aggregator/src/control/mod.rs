//! The control plane's core: registration, the barrier, limits and departures, without
//! I/O.
//!
//! Workers register over a control connection; when every rank of a session has
//! registered with the same shape, the session opens in the data path and every rank gets
//! an `accept`. Each worker keeps its connection for the life of the session. When one
//! closes (a worker exits or is killed) or leaves while a round waits for it, the session
//! closes at once and the remaining ranks are told, so their jobs fail fast instead of
//! timing out, and a new set of workers can register under the same name right away. A
//! rank that leaves after its last job, with no round waiting for it, ends nothing: the
//! others may still be recovering the last results lost on their way, which the data path
//! retains. That session closes when every rank has left, when a round needs one that has
//! (the data path reports it), or when a new session assembles under its name.
//!
//! Connections, and sessions open or assembling, are bounded; a connection must register
//! within the registration timeout, and its session must assemble within the same time
//! after that, or it is refused and closed.
//!
//! [`Registry`] holds all of this as a deterministic state machine, as
//! [`Engine`](crate::Engine) holds the data path: its caller (the switch's TCP shell, a
//! test, a fuzzer) feeds it what happened, with the time, through `handle_*`, and takes
//! what to do from [`Registry::poll_action`] ([`Action`]s: messages to send on a
//! connection, connections to close, sessions to open or close in the data path) and the
//! next deadline from [`Registry::poll_timeout`]. Connections are [`ConnectionId`]s it
//! hands out; it never sees a stream.
//!
//! What the data path answers (a session opened or refused, a rank's departure) comes
//! back as an event of its own, [`Registry::handle_opened`] and
//! [`Registry::handle_departure`], rather than as a return value: a caller may ask a data
//! path in another thread, or several switches that each hold a part of the session (a
//! shard, a level of an aggregation tree), and answer once they all have. Until then the
//! session is opening: its ranks wait without a deadline, a registration under its name
//! is refused, and a rank whose connection closes meanwhile closes it as soon as it
//! opens.

mod registration;
#[cfg(test)]
mod tests;
pub mod upward;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::IpAddr;
use std::ops::Range;
use std::time::{Duration, Instant};

use netagg_wire::control::rack_ranks;
use netagg_wire::{ControlMessage, Endpoint, RejectCode, SlotSplit, ValueEncoding, WireError};

use crate::engine::{Departure, SessionError, SessionId, SessionSpec};
use registration::{Registration, Shape};

/// A control connection, as the [`Registry`] that numbered it knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(u64);

impl std::fmt::Display for ConnectionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "control-{}", self.0)
    }
}

/// A request to open a session in the data path, answered by [`Registry::handle_opened`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpenRequest(u64);

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
    pub data_networks: Vec<ipnet::IpNet>,
    /// The longest datagram the data port carries, if it has a limit (a DPDK port's
    /// MTU): sessions whose packets would be longer are refused.
    pub max_datagram: Option<usize>,
}

/// A lower switch's place in an aggregation tree: rack `index` of `count`. It serves the
/// ranks of each session's world that [`rack_ranks`] gives its rack, and takes part in the
/// upper switch's session as its rank `index` of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rack {
    pub index: u16,
    pub count: u16,
}

/// A worker as it registered: where its control connection came from, and the endpoint
/// of each of its threads, which the data path resolves to reach them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    pub peer: IpAddr,
    pub endpoints: Vec<Endpoint>,
}

/// A session the data path opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    pub id: SessionId,
    /// The session's secret, which the caller drew from a CSPRNG and gave the data path.
    pub token: u64,
}

/// Why the data path could not open a session; its ranks are told this.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// The engine refused it: a limit.
    #[error("{0}")]
    Session(#[from] SessionError),
    /// The data port cannot reach a worker's endpoint.
    #[error("{0}")]
    Endpoint(String),
    /// Nothing answered the request.
    #[error("the data path is not running")]
    Unanswered,
    /// A lower switch's upper switch refused its rack, or could not be reached.
    #[error("{0}")]
    Upstream(String),
}

impl OpenError {
    fn code(&self) -> RejectCode {
        match self {
            OpenError::Session(_) | OpenError::Unanswered | OpenError::Upstream(_) => RejectCode::Limit,
            OpenError::Endpoint(_) => RejectCode::Transport,
        }
    }
}

/// Why the data path closed a session on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEnd {
    /// No packets came for its idle timeout.
    Expired,
    /// A round needed `departed`, which had left.
    Orphaned { departed: u16 },
    /// A connection of the data path to a thread of `rank` failed (RDMA's: the peer
    /// gone, a completion failed), as `why` says, while a round needed the rank, or
    /// later, when one did: the rank can contribute no more, though its control
    /// connection may stay open.
    ConnectionLost { rank: u16, why: String },
    /// A lower switch's upper session ended (a rank of another rack left, or the upper
    /// switch is gone), as the message says.
    Upstream(String),
}

/// Why the control plane closes a session in the data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closure {
    /// The rank's connection closed, or it left while a round waited for it.
    RankLeft(u16),
    /// Every rank has left after its last job.
    AllLeft,
    /// A new session assembled under its name after some of its ranks had left.
    Superseded,
}

impl std::fmt::Display for Closure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Closure::RankLeft(rank) => write!(f, "rank {rank} left"),
            Closure::AllLeft => write!(f, "every rank left"),
            Closure::Superseded => write!(f, "a new one assembled under its name"),
        }
    }
}

/// What the caller of a [`Registry`] must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write `message` on `connection` without waiting: a client that cannot take a
    /// message of a few hundred bytes has stopped reading, and is disconnected instead.
    Send { connection: ConnectionId, request_id: u32, message: ControlMessage },
    /// Close `connection` after what was sent on it, and report it with
    /// [`Registry::handle_closed`] once it is gone; until then it counts against the
    /// limit and what it says is ignored.
    Close(ConnectionId),
    /// Open a session of `spec` in the data path for `workers` (in rank order) under a
    /// token drawn from a CSPRNG, and answer with [`Registry::handle_opened`]. A lower
    /// switch of a tree ([`Registry::serving_rack`]) first registers with its upper switch
    /// as `group` says.
    OpenSession {
        request: OpenRequest,
        name: String,
        spec: SessionSpec,
        workers: Vec<Registered>,
        group: Group,
    },
    /// Close session `id` in the data path; `name` and `why` are for the log.
    CloseSession { id: SessionId, name: String, why: Closure },
    /// Tell the data path that `rank` (as it numbers the session's workers, from 0) leaves
    /// session `id` ([`Engine::depart`]), and answer
    /// with [`Registry::handle_departure`].
    ///
    /// [`Engine::depart`]: crate::Engine::depart
    Depart { connection: ConnectionId, id: SessionId, rank: u16 },
}

/// A session's workers as a part of the whole it belongs to: the data path numbers them
/// from 0, and a lower switch registers upward with the shape they agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    /// The rank its worker 0 registered as; 0 unless the switch serves a rack.
    pub first_rank: u16,
    /// The world size its ranks registered with.
    pub world_size: u16,
    pub encoding: ValueEncoding,
    pub sparse_blocks: bool,
}

/// A registration in a session that is assembling, for the shell's log
/// ([`Registry::assembly`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assembly<'a> {
    pub name: &'a str,
    pub rank: u16,
    /// Ranks registered so far, this one included.
    pub joined: usize,
    pub world_size: u16,
}

/// A refusal of a request: its code and what to tell the worker.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Refusal {
    code: RejectCode,
    message: String,
}

impl Refusal {
    fn new(code: RejectCode, message: String) -> Refusal {
        Refusal { code, message }
    }
}

struct Connection {
    peer: IpAddr,
    /// The session and rank it registered as, once it has.
    membership: Option<Membership>,
    /// When it must have registered, or its session assembled; none once the session
    /// opens (or starts opening).
    deadline: Option<Instant>,
    stage: Stage,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Membership {
    name: String,
    rank: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Live,
    /// It said it leaves; the data path's answer decides what its closing ends.
    Leaving,
    /// [`Action::Close`] was given; it is forgotten once [`Registry::handle_closed`].
    Closing,
}

struct Member {
    /// The connection this registration came on; a departure acts only on its own.
    connection: ConnectionId,
    request_id: u32,
    registered: Registered,
}

/// A session whose ranks are registering, or whose opening the data path was asked for.
struct Assembling {
    shape: Shape,
    /// The rank whose registration fixed the shape, for mismatch messages.
    first_rank: u16,
    members: BTreeMap<u16, Member>,
    /// Set once every rank has registered.
    opening: Option<OpenRequest>,
    /// The first rank whose connection closed while the session was opening.
    departed: Option<u16>,
}

struct OpenSession {
    id: SessionId,
    /// The rank of the data path's worker 0 ([`Group::first_rank`]).
    first_rank: u16,
    members: BTreeMap<u16, ConnectionId>,
    /// Ranks that left after their last job while the others still recover theirs: their
    /// connections' closing ends nothing.
    departed: BTreeSet<u16>,
}

/// A rank's leave, waiting for the data path's [`Departure`].
struct Leave {
    name: String,
    id: SessionId,
    rank: u16,
}

/// The control plane's state: connections, sessions assembling and open, and the actions
/// they call for. See the [module docs](self).
pub struct Registry {
    limits: ControlLimits,
    /// The rack this switch serves, if it is a lower switch of a tree.
    rack: Option<Rack>,
    /// The data path's endpoints, announced in every accept with the slots each owns
    /// ([`SlotSplit::Ranges`]): registrations must name endpoints of their kind.
    data_endpoints: Vec<Endpoint>,
    connections: BTreeMap<ConnectionId, Connection>,
    assembling: HashMap<String, Assembling>,
    open: HashMap<String, OpenSession>,
    leaving: HashMap<ConnectionId, Leave>,
    next_connection: u64,
    next_request: u64,
    actions: VecDeque<Action>,
}

impl Registry {
    /// A registry for a data path reached at `data_endpoints`, all of one transport.
    ///
    /// # Panics
    ///
    /// If `data_endpoints` is empty: a data path is reached somewhere.
    pub fn new(data_endpoints: Vec<Endpoint>, limits: ControlLimits) -> Registry {
        assert!(!data_endpoints.is_empty(), "a registry needs the data path's endpoints");
        Registry {
            limits,
            rack: None,
            data_endpoints,
            connections: BTreeMap::new(),
            assembling: HashMap::new(),
            open: HashMap::new(),
            leaving: HashMap::new(),
            next_connection: 0,
            next_request: 0,
            actions: VecDeque::new(),
        }
    }

    /// This registry as a lower switch's of an aggregation tree, serving `rack`.
    pub fn serving_rack(mut self, rack: Rack) -> Registry {
        self.rack = Some(rack);
        self
    }

    pub fn limits(&self) -> &ControlLimits {
        &self.limits
    }

    /// The next thing to do, in the order the events called for them.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When [`Registry::handle_timeout`] must next be called: the earliest deadline of a
    /// connection to register or of a session to assemble.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.connections.values().filter_map(|connection| connection.deadline).min()
    }

    /// Whether `connection` is live: counted, and neither closing nor refused. Its shell
    /// stops reading it once it is not.
    pub fn is_live(&self, connection: ConnectionId) -> bool {
        self.connections.get(&connection).is_some_and(|c| c.stage != Stage::Closing)
    }

    /// Where `connection`'s registration stands while its session assembles: its
    /// session's name, its rank, and how many of the session's ranks have registered.
    pub fn assembly(&self, connection: ConnectionId) -> Option<Assembly<'_>> {
        let Membership { name, rank } = self.connections.get(&connection)?.membership.as_ref()?;
        let session = self.assembling.get(name).filter(|s| s.members.contains_key(rank))?;
        let joined = session.members.len();
        Some(Assembly { name, rank: *rank, joined, world_size: session.shape.world_size })
    }

    /// The connection holding `rank` of session `name`, which a registration of that rank
    /// would be refused for ([`RejectCode::DuplicateRank`]): its registration in the
    /// session assembling under the name, or its membership of the open one while no rank
    /// has left it.
    ///
    /// A rank's next process can register before its previous connection's end (a leave,
    /// a close) has been read: a shell that finds the holder closed by its client lets its
    /// end be handled first, so that the registration is not refused for a rank that is
    /// gone.
    pub fn holder(&self, name: &str, rank: u16) -> Option<ConnectionId> {
        if let Some(member) = self.assembling.get(name).and_then(|session| session.members.get(&rank)) {
            return Some(member.connection);
        }
        let open = self.open.get(name).filter(|open| open.departed.is_empty())?;
        open.members.get(&rank).copied()
    }
    /// Sessions open, and assembling or opening.
    pub fn sessions(&self) -> (usize, usize) {
        (self.open.len(), self.assembling.len())
    }

    /// Control connections counted against `max_connections` and not yet closing.
    pub fn live_connections(&self) -> usize {
        self.connections.values().filter(|connection| connection.stage != Stage::Closing).count()
    }

    /// A connection came from `peer`. Over the limit, it is refused with a reason and
    /// closed at once (and never counted: no [`Registry::handle_closed`] is needed).
    pub fn handle_connect(&mut self, now: Instant, peer: IpAddr) -> ConnectionId {
        let id = ConnectionId(self.next_connection);
        self.next_connection += 1;
        let max = self.limits.max_connections;
        if self.connections.len() >= max {
            let message =
                format!("the switch serves at most {max} control connections at once; try again later");
            let message = ControlMessage::Reject { code: RejectCode::Limit, message };
            self.actions.push_back(Action::Send { connection: id, request_id: 0, message });
            self.actions.push_back(Action::Close(id));
            return id;
        }
        let deadline = Some(now + self.limits.register_timeout);
        self.connections.insert(id, Connection { peer, membership: None, deadline, stage: Stage::Live });
        id
    }

    /// A message arrived on `connection`: one register, then nothing until leave.
    pub fn handle_message(
        &mut self,
        now: Instant,
        connection: ConnectionId,
        request_id: u32,
        message: ControlMessage,
    ) {
        let Some(state) = self.connections.get(&connection) else { return };
        if state.stage != Stage::Live {
            return;
        }
        let has_registered = state.membership.is_some();
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
            } if !has_registered => {
                let threads = endpoints.len();
                let shape =
                    Shape { world_size, packet_elements, slots, depth, encoding, sparse_blocks, threads };
                let registered = Registered { peer: state.peer, endpoints };
                self.register(now, connection, request_id, Registration { name, rank, shape, registered });
            }
            ControlMessage::Leave { .. } => self.leave(connection),
            _ => {
                let message = "expected one register, then nothing until leave".to_string();
                self.refuse(connection, request_id, Refusal::new(RejectCode::Malformed, message));
            }
        }
    }

    /// Bytes on `connection` that are no control message: it is told why and closed.
    pub fn handle_undecodable(&mut self, connection: ConnectionId, error: &WireError) {
        if !self.connections.get(&connection).is_some_and(|c| c.stage == Stage::Live) {
            return;
        }
        let code = match error {
            WireError::Version { .. } => RejectCode::Version,
            WireError::UnknownEndpoint(_) => RejectCode::Transport,
            _ => RejectCode::Malformed,
        };
        self.refuse(connection, 0, Refusal::new(code, error.to_string()));
    }

    /// `connection` is gone: closed by its client, or after [`Action::Close`]. Its
    /// registration is withdrawn, or the session it is a rank of closes.
    pub fn handle_closed(&mut self, connection: ConnectionId) {
        let Some(state) = self.connections.remove(&connection) else { return };
        // A closing connection departed when it was closed; a leaving one departs once
        // the data path says what its leaving means.
        if state.stage != Stage::Live {
            return;
        }
        if let Some(Membership { name, rank }) = state.membership {
            self.depart(&name, rank, connection);
        }
    }

    /// The data path's answer to [`Action::OpenSession`].
    pub fn handle_opened(&mut self, request: OpenRequest, result: Result<Opened, OpenError>) {
        let Some(name) =
            self.assembling.iter().find(|(_, s)| s.opening == Some(request)).map(|(n, _)| n.clone())
        else {
            return;
        };
        let Some(session) = self.assembling.remove(&name) else { return };
        // The session it supersedes, whose ranks have not all left: closed, and those
        // ranks told (they were still recovering results, or are a program's stale half).
        let superseded = self.open.remove(&name);
        match (result, session.departed) {
            (Ok(opened), None) => self.accept(&name, session, opened),
            (Ok(opened), Some(departed)) => {
                self.actions.push_back(Action::CloseSession {
                    id: opened.id,
                    name: name.clone(),
                    why: Closure::RankLeft(departed),
                });
                let refusal = Refusal::new(RejectCode::UnknownSession, departed_message(departed, &name));
                for member in session.members.values() {
                    self.reject(member.connection, member.request_id, refusal.clone());
                }
            }
            (Err(error), _) => {
                let refusal = Refusal::new(error.code(), error.to_string());
                for member in session.members.values() {
                    self.reject(member.connection, member.request_id, refusal.clone());
                }
            }
        }
        if let Some(old) = superseded {
            self.actions.push_back(Action::CloseSession {
                id: old.id,
                name: name.clone(),
                why: Closure::Superseded,
            });
            if let Some(&departed) = old.departed.first() {
                self.tell_remaining(&old, &departed_message(departed, &name));
            }
        }
    }

    /// The data path's answer to [`Action::Depart`]: `None` if the session was gone.
    /// Then the leaving connection is closed.
    pub fn handle_departure(&mut self, connection: ConnectionId, departure: Option<Departure>) {
        let Some(Leave { name, id, rank }) = self.leaving.remove(&connection) else { return };
        let ours = self.open.get(&name).is_some_and(|open| open.id == id);
        match departure {
            Some(Departure::Lingers) if ours => {
                if let Some(open) = self.open.get_mut(&name) {
                    open.departed.insert(rank);
                }
            }
            Some(Departure::AllGone) if ours => {
                self.open.remove(&name);
                self.actions.push_back(Action::CloseSession {
                    id,
                    name: name.clone(),
                    why: Closure::AllLeft,
                });
            }
            // Needed mid-job, or the session is gone: the connection's closing decides.
            _ => {}
        }
        match self.connections.get_mut(&connection) {
            Some(state) => {
                state.stage = Stage::Live;
                self.close(connection);
            }
            // Its client closed it while the data path answered.
            None => self.depart(&name, rank, connection),
        }
    }

    /// The data path closed session `id` on its own: its ranks that have not left are
    /// told why.
    pub fn handle_session_ended(&mut self, id: SessionId, end: SessionEnd) {
        let Some(name) = self.open.iter().find(|(_, open)| open.id == id).map(|(name, _)| name.clone())
        else {
            return;
        };
        let Some(open) = self.open.remove(&name) else { return };
        let message = match end {
            SessionEnd::Expired => format!("session '{name}' expired: no packets for the idle timeout"),
            SessionEnd::Orphaned { departed } => departed_message(departed + open.first_rank, &name),
            SessionEnd::Upstream(why) => format!("session '{name}' is closed: {why}"),
            SessionEnd::ConnectionLost { rank, why } => format!(
                "session '{name}' is closed: rank {}'s data connection to the switch failed, {why}",
                rank + open.first_rank
            ),
        };
        self.tell_remaining(&open, &message);
    }

    /// Refuses and closes the connections whose deadline has passed: those that have not
    /// registered, and the ranks of sessions that have not assembled.
    pub fn handle_timeout(&mut self, now: Instant) {
        let overdue: Vec<ConnectionId> = self
            .connections
            .iter()
            .filter(|(_, connection)| connection.deadline.is_some_and(|deadline| deadline <= now))
            .map(|(&id, _)| id)
            .collect();
        let waited = self.limits.register_timeout;
        for connection in overdue {
            let Some(state) = self.connections.get_mut(&connection) else { continue };
            let refusal = match state.membership.take() {
                None => Refusal::new(
                    RejectCode::Malformed,
                    format!("no registration within {waited:?} of connecting"),
                ),
                Some(Membership { name, rank }) => {
                    let (joined, world) = self.withdraw(&name, rank, connection);
                    Refusal::new(
                        RejectCode::Limit,
                        format!(
                            "session '{name}' did not assemble within {waited:?}: {joined} of {world} ranks registered"
                        ),
                    )
                }
            };
            self.refuse(connection, 0, refusal);
        }
    }

    fn register(
        &mut self,
        now: Instant,
        connection: ConnectionId,
        request_id: u32,
        registration: Registration,
    ) {
        if let Err(refusal) = self.admit(&registration) {
            self.refuse(connection, request_id, refusal);
            return;
        }
        let Registration { name, rank, shape, registered } = registration;
        let rack = self.rack;
        let session = self.assembling.entry(name.clone()).or_insert_with(|| Assembling {
            shape,
            first_rank: rank,
            members: BTreeMap::new(),
            opening: None,
            departed: None,
        });
        session.members.insert(rank, Member { connection, request_id, registered });
        let complete = session.members.len() == served(rack, session.shape.world_size).len();
        if let Some(state) = self.connections.get_mut(&connection) {
            state.membership = Some(Membership { name: name.clone(), rank });
            // The session must assemble within the timeout from now on; once open, the
            // connection lives as long as the session.
            state.deadline = Some(now + self.limits.register_timeout);
        }
        if complete {
            self.start_opening(name);
        }
    }

    /// Refuses a registration that its session, or this switch, cannot take.
    fn admit(&self, registration: &Registration) -> Result<(), Refusal> {
        // Not empty: `new` checked.
        registration.check(&self.limits, &self.data_endpoints[0])?;
        let Registration { name, rank, shape, .. } = registration;
        let (name, rank) = (name.as_str(), *rank);
        let served = served(self.rack, shape.world_size);
        if let Some(Rack { index, count }) = self.rack.filter(|_| !served.contains(&rank)) {
            let world = shape.world_size;
            let held = if served.is_empty() {
                "none".to_string()
            } else {
                format!("{} to {}", served.start, served.end - 1)
            };
            return Err(Refusal::new(
                RejectCode::RankOutOfRange,
                format!(
                    "rank {rank} is not in rack {index} of {count}, which this switch serves and which holds \
                     ranks {held} of a world of {world}: register at its rack's switch"
                ),
            ));
        }
        // A session some rank has left after its last job is ending: the same program's
        // next context (or its restart) may assemble under its name beside it.
        let running = self.open.get(name).is_some_and(|open| open.departed.is_empty())
            || self.assembling.get(name).is_some_and(|session| session.opening.is_some());
        if running {
            return Err(Refusal::new(
                RejectCode::DuplicateRank,
                format!("session '{name}' is already running with all its ranks"),
            ));
        }
        let Some(session) = self.assembling.get(name) else {
            let sessions = self.open.len() + self.assembling.len();
            if sessions >= usize::from(self.limits.max_sessions) {
                return Err(Refusal::new(
                    RejectCode::Limit,
                    format!(
                        "{sessions} sessions are open or assembling, the limit is {}",
                        self.limits.max_sessions
                    ),
                ));
            }
            return Ok(());
        };
        if session.members.contains_key(&rank) {
            return Err(Refusal::new(
                RejectCode::DuplicateRank,
                format!("rank {rank} is already registered in session '{name}'"),
            ));
        }
        let differences = session.shape.differences(shape);
        if !differences.is_empty() {
            let first = session.first_rank;
            return Err(Refusal::new(
                RejectCode::Mismatch,
                format!("rank {rank} differs from rank {first}: {differences}"),
            ));
        }
        Ok(())
    }

    /// Every rank of `name` has registered: asks the data path to open it.
    fn start_opening(&mut self, name: String) {
        let request = OpenRequest(self.next_request);
        self.next_request += 1;
        let rack = self.rack;
        let Some(session) = self.assembling.get_mut(&name) else { return };
        session.opening = Some(request);
        for member in session.members.values() {
            if let Some(state) = self.connections.get_mut(&member.connection) {
                state.deadline = None;
            }
        }
        let shape = &session.shape;
        let served = served(rack, shape.world_size);
        let spec = SessionSpec {
            workers: served.len() as u16,
            slots: shape.slots,
            packet_elements: shape.packet_elements,
            depth: shape.depth,
        };
        let group = Group {
            first_rank: served.start,
            world_size: shape.world_size,
            encoding: shape.encoding,
            sparse_blocks: shape.sparse_blocks,
        };
        let workers = session.members.values().map(|member| member.registered.clone()).collect();
        self.actions.push_back(Action::OpenSession { request, name, spec, workers, group });
    }

    /// Answers every rank of a session the data path opened, and keeps it as open.
    fn accept(&mut self, name: &str, session: Assembling, opened: Opened) {
        let shape = &session.shape;
        let mut members = BTreeMap::new();
        for (&rank, member) in &session.members {
            let message = ControlMessage::Accept {
                session: opened.id.0,
                rank,
                world_size: shape.world_size,
                packet_elements: shape.packet_elements,
                slots: shape.slots,
                depth: shape.depth,
                token: opened.token,
                data: self.data_endpoints.clone(),
                split: SlotSplit::Ranges,
            };
            self.send(member.connection, member.request_id, message);
            members.insert(rank, member.connection);
        }
        let first_rank = served(self.rack, shape.world_size).start;
        self.open.insert(
            name.to_string(),
            OpenSession { id: opened.id, first_rank, members, departed: BTreeSet::new() },
        );
    }

    /// A rank says it leaves, its jobs done. If no round waits for it, the session stays
    /// open for the others, who may still be recovering the last results lost on the way
    /// to them, until they leave too (or a round needs the rank: the data path then
    /// closes the session, [`SessionEnd::Orphaned`]). Otherwise its connection's closing
    /// closes the session, as any rank's that leaves mid-job. The data path decides which
    /// ([`Action::Depart`]).
    fn leave(&mut self, connection: ConnectionId) {
        let Some(state) = self.connections.get_mut(&connection) else { return };
        let open = state.membership.as_ref().and_then(|Membership { name, rank }| {
            let open = self.open.get(name)?;
            (open.members.get(rank) == Some(&connection))
                .then(|| (name.clone(), open.id, *rank, open.first_rank))
        });
        let Some((name, id, rank, first_rank)) = open else {
            self.close(connection);
            return;
        };
        state.stage = Stage::Leaving;
        self.leaving.insert(connection, Leave { name, id, rank });
        // The data path numbers the session's workers from 0.
        self.actions.push_back(Action::Depart { connection, id, rank: rank - first_rank });
    }

    /// A rank's connection closed (or is closed): a registration is withdrawn; an open
    /// session closes and its other ranks are told why. Only the session that
    /// `connection` registered in is touched: a later one of the same name is not its.
    fn depart(&mut self, name: &str, rank: u16, connection: ConnectionId) {
        if self
            .assembling
            .get(name)
            .is_some_and(|s| s.members.get(&rank).is_some_and(|m| m.connection == connection))
        {
            self.withdraw(name, rank, connection);
            return;
        }
        // A rank that left after its last job ended nothing by closing.
        let ours = self.open.get(name).is_some_and(|open| {
            open.members.get(&rank) == Some(&connection) && !open.departed.contains(&rank)
        });
        if !ours {
            return;
        }
        let Some(mut open) = self.open.remove(name) else { return };
        open.departed.insert(rank);
        self.actions.push_back(Action::CloseSession {
            id: open.id,
            name: name.to_string(),
            why: Closure::RankLeft(rank),
        });
        self.tell_remaining(&open, &departed_message(rank, name));
    }

    /// Takes `rank`'s registration on `connection` out of the assembling session `name`;
    /// how many ranks had registered, and of how many.
    fn withdraw(&mut self, name: &str, rank: u16, connection: ConnectionId) -> (usize, u16) {
        let Some(session) = self.assembling.get_mut(name) else { return (0, 0) };
        let joined = (session.members.len(), session.shape.world_size);
        if session.members.get(&rank).is_none_or(|member| member.connection != connection) {
            return joined;
        }
        session.members.remove(&rank);
        if session.opening.is_some() {
            // The data path's answer closes it again, and tells the others.
            session.departed.get_or_insert(rank);
        } else if session.members.is_empty() {
            self.assembling.remove(name);
        }
        joined
    }

    /// Tells the ranks of a closed session that have not left why it closed.
    fn tell_remaining(&mut self, open: &OpenSession, message: &str) {
        let refusal = Refusal::new(RejectCode::UnknownSession, message.to_string());
        for (rank, &connection) in &open.members {
            if !open.departed.contains(rank) {
                self.reject(connection, 0, refusal.clone());
            }
        }
    }

    /// Refuses a request on `connection` and closes it: a client cannot pile up replies
    /// it never reads.
    fn refuse(&mut self, connection: ConnectionId, request_id: u32, refusal: Refusal) {
        self.reject(connection, request_id, refusal);
        self.close(connection);
    }

    /// Closes `connection`; what it had registered departs.
    fn close(&mut self, connection: ConnectionId) {
        let Some(state) = self.connections.get_mut(&connection) else { return };
        if state.stage != Stage::Live {
            return;
        }
        state.stage = Stage::Closing;
        state.deadline = None;
        let membership = state.membership.take();
        self.actions.push_back(Action::Close(connection));
        if let Some(Membership { name, rank }) = membership {
            self.depart(&name, rank, connection);
        }
    }

    fn reject(&mut self, connection: ConnectionId, request_id: u32, refusal: Refusal) {
        let Refusal { code, message } = refusal;
        self.send(connection, request_id, ControlMessage::Reject { code, message });
    }

    /// Sends on a connection that is still there to read it.
    fn send(&mut self, connection: ConnectionId, request_id: u32, message: ControlMessage) {
        if !self.connections.get(&connection).is_some_and(|c| c.stage != Stage::Closing) {
            return;
        }
        self.actions.push_back(Action::Send { connection, request_id, message });
    }
}

/// The ranks of a world of `world_size` that register at a switch serving `rack`: all of
/// them, or the rack's.
fn served(rack: Option<Rack>, world_size: u16) -> Range<u16> {
    rack.map_or(0..world_size, |rack| rack_ranks(rack.index, rack.count, world_size))
}

/// Why a session closed when a rank left.
fn departed_message(rank: u16, name: &str) -> String {
    format!("rank {rank} left session '{name}'; the session is closed")
}
