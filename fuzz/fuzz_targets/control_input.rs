//! A sequence of connections, control messages, closings, waits and data path answers
//! through the control plane's registry: no panic, and its actions keep the plane's
//! promises. A connection is closed at most once and hears nothing after; a session
//! opens only with every rank registered, in rank order, and is accepted by all of them
//! or by none; the data path is asked to close only sessions it opened, once; sessions
//! open or assembling stay within the limit; no deadline is left overdue.
//!
//! The data path's answers are steps of their own, so they may come late, after the
//! connections they concern have closed, or never.

#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use netagg_aggregator::control::{
    Action, ConnectionId, ControlLimits, OpenError, OpenRequest, Opened, Registry, SessionEnd,
};
use netagg_aggregator::{Departure, SessionError, SessionId};
use netagg_wire::{ControlMessage, Endpoint, ValueEncoding, WireError};

const LIMITS: ControlLimits = ControlLimits {
    max_connections: 6,
    max_sessions: 2,
    max_workers: 3,
    register_timeout: Duration::from_secs(1),
    data_networks: Vec::new(),
    max_datagram: None,
};

/// Few names, so that registrations meet in the same session.
const NAMES: [&str; 3] = ["a", "b", "c"];

#[derive(Debug, Arbitrary)]
enum Step {
    /// A connection from host `n % 4`.
    Connect(u8),
    Register(Registration),
    Leave(u8),
    /// A message a worker never sends.
    Accept(u8),
    Undecodable(u8),
    /// A live or closing connection is gone.
    Closed(u8),
    /// Lets time pass, in 100 ms units, and fires the timeouts due.
    Wait(u8),
    /// The data path answers the oldest open request (or another).
    Opened {
        which: u8,
        outcome: OpenOutcome,
    },
    /// The data path answers a leave.
    Departed {
        which: u8,
        departure: Option<DepartureKind>,
    },
    /// The data path closes an open session on its own.
    Ended {
        which: u8,
        orphaned_by: Option<u8>,
    },
}

#[derive(Debug, Arbitrary)]
struct Registration {
    connection: u8,
    request_id: u8,
    rank: u8,
    world_size: u8,
    name: u8,
    /// Registers slots 2 unless set, so that most ranks agree.
    other_slots: Option<u8>,
    threads: u8,
    /// An endpoint at another host than the connection's.
    elsewhere: bool,
    rdma: bool,
}

#[derive(Debug, Arbitrary)]
enum OpenOutcome {
    Ok,
    Limit,
    Endpoint,
    Unanswered,
}

#[derive(Debug, Arbitrary)]
enum DepartureKind {
    Lingers,
    Needed,
    AllGone,
}

#[derive(Debug)]
struct Connection {
    peer: u8,
    /// Its [`Action::Close`] was given.
    closed: bool,
}

struct Harness {
    registry: Registry,
    now: Instant,
    /// Connections the registry counts, by the order they came in.
    connections: BTreeMap<ConnectionId, Connection>,
    /// Connections reported gone: they must hear nothing more.
    gone: BTreeSet<ConnectionId>,
    /// Open requests not answered yet, with the session's size.
    opening: Vec<(OpenRequest, u16)>,
    /// Leaves not answered yet.
    leaving: Vec<ConnectionId>,
    /// Sessions open in the data path.
    open: BTreeSet<SessionId>,
    next_session: u32,
}

impl Harness {
    fn new() -> Harness {
        let data = Endpoint::Udp("10.0.0.100:48864".parse().expect("an address"));
        Harness {
            registry: Registry::new(vec![data], LIMITS),
            now: Instant::now(),
            connections: BTreeMap::new(),
            gone: BTreeSet::new(),
            opening: Vec::new(),
            leaving: Vec::new(),
            open: BTreeSet::new(),
            next_session: 1,
        }
    }

    fn connection(&self, index: u8) -> Option<ConnectionId> {
        let ids: Vec<_> = self.connections.keys().copied().collect();
        (!ids.is_empty()).then(|| ids[index as usize % ids.len()])
    }

    fn step(&mut self, step: Step) {
        match step {
            Step::Connect(host) => {
                let id = self.registry.handle_connect(self.now, host_ip(host % 4));
                // A refused connection is closed at once and never counted.
                if self.registry.is_live(id) {
                    self.connections.insert(id, Connection { peer: host % 4, closed: false });
                }
                self.check_actions(Some(id));
            }
            Step::Register(r) => {
                let Some(id) = self.connection(r.connection) else { return };
                let peer = self.connections[&id].peer;
                let host = if r.elsewhere { peer + 1 } else { peer };
                let address = SocketAddr::new(host_ip(host), 5000);
                let endpoint =
                    if r.rdma { Endpoint::Rdma { address, tag: 1 } } else { Endpoint::Udp(address) };
                let message = ControlMessage::Register {
                    rank: u16::from(r.rank % 4),
                    world_size: u16::from(r.world_size % 5),
                    packet_elements: 4,
                    slots: r.other_slots.map_or(2, u16::from),
                    depth: 2,
                    encoding: ValueEncoding::Native,
                    sparse_blocks: false,
                    name: NAMES[r.name as usize % NAMES.len()].into(),
                    endpoints: vec![endpoint; 1 + r.threads as usize % 2],
                };
                self.registry.handle_message(self.now, id, u32::from(r.request_id), message);
                self.check_actions(None);
            }
            Step::Leave(index) | Step::Accept(index) | Step::Undecodable(index) => {
                let Some(id) = self.connection(index) else { return };
                match step {
                    Step::Leave(_) => {
                        let message = ControlMessage::Leave { session: 0, rank: 0 };
                        self.registry.handle_message(self.now, id, 1, message);
                    }
                    Step::Accept(_) => {
                        let message = ControlMessage::Reject {
                            code: netagg_wire::RejectCode::Limit,
                            message: "?".into(),
                        };
                        self.registry.handle_message(self.now, id, 1, message);
                    }
                    _ => self.registry.handle_undecodable(id, &WireError::Version { found: 9, supported: 5 }),
                }
                self.check_actions(None);
            }
            Step::Closed(index) => {
                let Some(id) = self.connection(index) else { return };
                self.connections.remove(&id);
                self.gone.insert(id);
                self.registry.handle_closed(id);
                self.check_actions(None);
            }
            Step::Wait(ticks) => {
                self.now += Duration::from_millis(100 * u64::from(ticks));
                self.registry.handle_timeout(self.now);
                assert!(
                    self.registry.poll_timeout().is_none_or(|at| at > self.now),
                    "a deadline left overdue"
                );
                self.check_actions(None);
            }
            Step::Opened { which, outcome } => {
                if self.opening.is_empty() {
                    return;
                }
                let (request, workers) = self.opening.remove(which as usize % self.opening.len());
                let result = match outcome {
                    OpenOutcome::Ok => {
                        let id = SessionId(self.next_session);
                        self.next_session += 1;
                        self.open.insert(id);
                        Ok(Opened { id, token: u64::from(id.0) })
                    }
                    OpenOutcome::Limit => {
                        Err(OpenError::Session(SessionError::TooManySessions { open: 2, max: 2 }))
                    }
                    OpenOutcome::Endpoint => Err(OpenError::Endpoint("unreachable".into())),
                    OpenOutcome::Unanswered => Err(OpenError::Unanswered),
                };
                let accepted = result.is_ok();
                self.registry.handle_opened(request, result);
                let accepts = self.check_actions(None);
                assert!(
                    accepts == 0 || (accepted && accepts == usize::from(workers)),
                    "{accepts} of {workers} ranks accepted"
                );
            }
            Step::Departed { which, departure } => {
                if self.leaving.is_empty() {
                    return;
                }
                let connection = self.leaving.remove(which as usize % self.leaving.len());
                let departure = departure.map(|kind| match kind {
                    DepartureKind::Lingers => Departure::Lingers,
                    DepartureKind::Needed => Departure::Needed,
                    DepartureKind::AllGone => Departure::AllGone,
                });
                self.registry.handle_departure(connection, departure);
                self.check_actions(None);
            }
            Step::Ended { which, orphaned_by } => {
                let Some(&id) = self.open.iter().nth(which as usize % self.open.len().max(1)) else { return };
                self.open.remove(&id);
                let end = orphaned_by.map_or(SessionEnd::Expired, |rank| SessionEnd::Orphaned {
                    departed: u16::from(rank % 4),
                });
                self.registry.handle_session_ended(id, end);
                self.check_actions(None);
            }
        }
        let (open, assembling) = self.registry.sessions();
        assert!(
            open + assembling <= usize::from(LIMITS.max_sessions),
            "{open} open, {assembling} assembling"
        );
        assert!(self.connections.len() <= LIMITS.max_connections);
    }

    /// Checks the actions of one event, and carries out none but recording them; how many
    /// accepts there were. `refused` is a connection that may be closed without being
    /// counted.
    fn check_actions(&mut self, refused: Option<ConnectionId>) -> usize {
        let mut accepts = 0;
        while let Some(action) = self.registry.poll_action() {
            match action {
                Action::Send { connection, message, .. } => {
                    assert!(
                        !self.gone.contains(&connection),
                        "sent {message:?} on {connection}, which is gone"
                    );
                    match self.connections.get(&connection) {
                        Some(state) => {
                            assert!(!state.closed, "sent {message:?} on {connection} after closing it")
                        }
                        None => {
                            assert_eq!(Some(connection), refused, "sent {message:?} on unknown {connection}")
                        }
                    }
                    if matches!(message, ControlMessage::Accept { .. }) {
                        accepts += 1;
                    }
                }
                Action::Close(connection) => {
                    assert!(!self.gone.contains(&connection), "closed {connection}, which is gone");
                    match self.connections.get_mut(&connection) {
                        Some(state) => {
                            assert!(!state.closed, "closed {connection} twice");
                            state.closed = true;
                        }
                        None => assert_eq!(Some(connection), refused, "closed unknown {connection}"),
                    }
                }
                Action::OpenSession { request, spec, workers, .. } => {
                    assert_eq!(workers.len(), usize::from(spec.workers), "a session opens with every rank");
                    self.opening.push((request, spec.workers));
                }
                Action::CloseSession { id, .. } => {
                    assert!(self.open.remove(&id), "closed {id:?}, which the data path does not hold");
                }
                Action::Depart { connection, .. } => {
                    assert!(!self.leaving.contains(&connection), "{connection} leaves twice");
                    self.leaving.push(connection);
                }
            }
        }
        accepts
    }
}

fn host_ip(host: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, host + 1))
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let mut harness = Harness::new();
    while !u.is_empty() {
        let Ok(step) = Step::arbitrary(&mut u) else {
            break;
        };
        harness.step(step);
    }
});
