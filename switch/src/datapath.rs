//! The data path: threads ("lanes") that each own an engine and a [`DataPort`].
//!
//! A switch runs one lane or several (`switch.threads`). Every lane's engine holds every
//! session, under the same id, and sums the slots the lane owns ([`SlotSplit::Ranges`]
//! over the lanes' endpoints, announced at registration): workers send each slot's
//! packets to its lane, so lanes share no state on the per-packet path.
//! [`crate::lanes::Lanes`] opens, closes and parts sessions in all of them.
//!
//! A lane hands each datagram its port receives to the engine, which writes each result
//! straight into the batch it leaves in ([`Outbox`]), and gives the batches to the port
//! once the receive call returns (the UDP port: one sendmmsg call for them all). The
//! control plane talks to it through a channel of [`Command`]s, which it drains between
//! receive calls; the receive timeout bounds how long that can wait, and keeps an idle
//! switch asleep instead of spinning.

use std::io;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use netagg_aggregator::control::{OpenError, Registered};
use netagg_aggregator::engine::SessionError;
use netagg_aggregator::engine::{EngineCounters, SessionCounters};
use netagg_aggregator::engine::{UplinkCounters, Upstream, UPSTREAM_RANK};
use netagg_aggregator::faults::FaultCounters;
use netagg_aggregator::{
    Departure, Engine, EngineLimits, Recipient, SessionId, SessionSpec, Transmit, Verdict,
};
use netagg_udp::outbox::Lent;
use netagg_udp::Outbox;
use netagg_wire::packet::HEADER_LEN;
use netagg_wire::{packet, Endpoint, Packet, SlotSplit};
use rustc_hash::FxHashMap;

use crate::port::{ConnectionEnd, DataPort, ThreadLink};

/// How long the data thread sleeps in `recv` before it looks at commands and timers.
const IDLE_WAKEUP: Duration = Duration::from_millis(20);

/// Where each worker thread of a session listens, in the port's addresses.
#[derive(Debug)]
struct Peers<A> {
    /// Per rank: the address of each of its threads.
    workers: Vec<Vec<A>>,
    /// Slots of one worker thread: slot `s` belongs to thread `s / slots_per_thread`.
    slots_per_thread: u16,
    /// The session's slots this lane owns: packets for others are misdirected.
    owned: Range<u16>,
    /// A lower switch's upper switch: the address of each of its data endpoints, which
    /// own the session's slots as `SlotSplit::Ranges` says; empty without one.
    upstream: Vec<A>,
    slots: u16,
}

impl<A: Copy> Peers<A> {
    /// Every worker thread's address; on failure, the port forgets those it resolved.
    fn resolve<P: DataPort<Address = A>>(
        port: &mut P,
        workers: &[Registered],
        spec: &SessionSpec,
        slots_per_thread: u16,
        owned: Range<u16>,
    ) -> Result<Peers<A>, String> {
        let slots_per_thread = slots_per_thread.max(1);
        let link = ThreadLink {
            datagram_len: packet::datagram_len(usize::from(spec.packet_elements)),
            window: usize::from(slots_per_thread),
        };
        let mut resolved: Vec<Vec<A>> = Vec::with_capacity(workers.len());
        for (rank, worker) in workers.iter().enumerate() {
            let mut threads = Vec::with_capacity(worker.endpoints.len());
            for endpoint in &worker.endpoints {
                match port.resolve(endpoint, worker.peer, link) {
                    Ok(address) => threads.push(address),
                    Err(message) => {
                        resolved.iter().flatten().chain(&threads).for_each(|&address| port.forget(address));
                        return Err(format!("rank {rank}: {message}"));
                    }
                }
            }
            resolved.push(threads);
        }
        Ok(Peers { workers: resolved, slots_per_thread, owned, upstream: Vec::new(), slots: spec.slots })
    }

    fn address(&self, rank: u16, slot: u16) -> Option<A> {
        match self.workers.get(rank as usize) {
            Some(threads) => threads.get(usize::from(self.thread(slot))).copied(),
            // No worker has the upper switch's rank.
            None if rank == UPSTREAM_RANK => self.upstream_owner(slot).map(|(_, address)| address),
            None => None,
        }
    }

    /// The upper switch's data endpoint that owns `slot`: its index and address.
    fn upstream_owner(&self, slot: u16) -> Option<(usize, A)> {
        let owner = SlotSplit::Ranges.owner(slot, self.slots, self.upstream.len());
        Some((owner, *self.upstream.get(owner)?))
    }

    /// The worker thread that owns `slot`, in every rank.
    fn thread(&self, slot: u16) -> u16 {
        slot / self.slots_per_thread
    }

    /// The addresses of worker thread `thread` of every rank, or of `rank`'s alone.
    fn group(&self, thread: u16, rank: Option<u16>) -> Vec<A> {
        let ranks = match rank {
            None => 0..self.workers.len(),
            Some(rank) => usize::from(rank)..usize::from(rank) + 1,
        };
        let ranks = self.workers.get(ranks).unwrap_or_default();
        ranks.iter().filter_map(|threads| threads.get(usize::from(thread)).copied()).collect()
    }

    fn all(&self) -> impl Iterator<Item = A> + '_ {
        self.workers.iter().flatten().chain(&self.upstream).copied()
    }

    /// The rank and thread index of the worker thread at `address`.
    fn worker_thread(&self, address: A) -> Option<(u16, usize)>
    where
        A: PartialEq,
    {
        self.workers.iter().enumerate().find_map(|(rank, threads)| {
            Some((rank as u16, threads.iter().position(|&thread| thread == address)?))
        })
    }
}

/// Who a group of results goes to: a session's worker thread `thread`, of every rank
/// (`rank` none) or of one (or the upper switch's endpoint `thread`, as
/// [`UPSTREAM_RANK`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct GroupKey {
    session: SessionId,
    thread: u16,
    rank: Option<u16>,
}

/// Requests from the control plane.
pub enum Command {
    /// Opens a session under `id`, or under an id of the engine's choosing (the first
    /// lane's, which the others then take).
    Open {
        id: Option<SessionId>,
        spec: SessionSpec,
        token: u64,
        /// Per rank, in rank order.
        workers: Vec<Registered>,
        /// A lower switch's upper switch, which the session's rounds complete at.
        upstream: Option<UpstreamPath>,
        reply: Sender<Result<SessionId, OpenError>>,
    },
    Close {
        id: SessionId,
        reply: Sender<Option<SessionCounters>>,
    },
    /// A rank left after its last job ([`Engine::depart`]); `None` if the session is
    /// gone.
    Depart {
        id: SessionId,
        rank: u16,
        reply: Sender<Option<Departure>>,
    },
    Counters {
        reply: Sender<Counters>,
    },
    Shutdown,
}

/// Where a lower switch's session reaches its upper switch, from the upper switch's
/// accept.
#[derive(Debug, Clone)]
pub struct UpstreamPath {
    pub upstream: Upstream,
    /// The upper switch's data endpoints, each owning its range of the slots.
    pub endpoints: Vec<Endpoint>,
    /// The upper switch's address, which an unspecified IP in an endpoint stands for.
    pub peer: std::net::IpAddr,
}

/// A snapshot of the data path's counters.
pub struct Counters {
    pub engine: EngineCounters,
    pub sessions: Vec<(SessionId, SessionCounters)>,
    /// What this switch's sessions, open or closed, exchanged with upper switches.
    pub uplink: UplinkCounters,
    /// What fault injection did to datagrams received and sent, if it is on.
    pub faults: Option<(FaultCounters, FaultCounters)>,
}

/// What the data path tells the control plane on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The session received nothing for the idle timeout and was closed.
    Expired(SessionId),
    /// A round needed a rank that had left, so the session could not go on and was
    /// closed (with its counters). `lost` says why the rank left if a connection to one
    /// of its threads failed, rather than the rank leaving after its last job.
    Orphaned { id: SessionId, departed: u16, counters: Option<SessionCounters>, lost: Option<String> },
}

/// The latest activity of each open session on any lane, shared by the lanes so that a
/// session busy on one does not expire, idle, on another.
pub type Activity = Arc<Mutex<FxHashMap<SessionId, Instant>>>;

/// Which lane a data path is, of how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lane {
    pub index: usize,
    pub count: usize,
}

pub struct DataPath<P: DataPort> {
    port: P,
    board: Switchboard<P::Address>,
    commands: Receiver<Command>,
    events: Sender<Event>,
    lane: Lane,
    activity: Activity,
    /// Why each rank whose connection failed left its session, until the session ends.
    lost: FxHashMap<(SessionId, u16), String>,
}

/// Everything but the port, so that datagrams are handled while the port still holds
/// them.
struct Switchboard<A> {
    engine: Engine,
    peers: FxHashMap<SessionId, Peers<A>>,
    results: Outbox<GroupKey, A>,
}

impl<P: DataPort> DataPath<P> {
    pub fn new(
        port: P,
        limits: EngineLimits,
        lane: Lane,
        commands: Receiver<Command>,
        events: Sender<Event>,
        activity: Activity,
    ) -> DataPath<P> {
        let board = Switchboard {
            engine: Engine::new(limits),
            peers: FxHashMap::default(),
            // A session's broadcasts carry numbers in the order they are written, and a
            // worker takes a number three later ones overtook for lost: they leave in that
            // order. Answers to one rank are not numbered and may be reordered.
            results: Outbox::keeping_order(port.batch_segments(), |group| group.rank.is_none()),
        };
        DataPath { port, board, commands, events, lane, activity, lost: FxHashMap::default() }
    }

    /// Runs until a [`Command::Shutdown`] arrives or the command channel closes.
    pub fn run(mut self) -> io::Result<()> {
        let mut next_timer_check = Instant::now();
        loop {
            if !self.drain_commands() {
                return Ok(());
            }
            let board = &mut self.board;
            // One clock read per batch: its datagrams arrived together.
            let mut arrived = None;
            self.port.recv(IDLE_WAKEUP, &mut |source, datagram| {
                board.handle(*arrived.get_or_insert_with(Instant::now), source, datagram)
            })?;
            if let Some(now) = arrived {
                self.board.poll_upstream(now);
                self.board.poll_notices();
            }
            self.send_results();
            for (address, end) in self.port.take_failed() {
                self.connection_ended(address, end);
            }
            if self.board.engine.has_orphaned() {
                for (id, departed) in self.board.engine.take_orphaned() {
                    self.close_orphaned(id, departed);
                }
            }
            let now = Instant::now();
            if now >= next_timer_check {
                self.board.poll_upstream(now);
                self.send_results();
                self.share_activity();
                for id in self.board.engine.handle_timeout(now) {
                    self.forget(id);
                    tracing::info!(session = format_args!("{:#010x}", id.0), "session expired: idle");
                    let _ = self.events.send(Event::Expired(id));
                }
                next_timer_check = now + IDLE_WAKEUP;
            }
        }
    }

    /// Hands the port every result queued, and has it send them.
    fn send_results(&mut self) {
        self.port.send_batches(self.board.results.batches());
        self.board.results.clear();
        self.port.flush();
    }

    /// Applies pending commands; false when the data path must stop.
    fn drain_commands(&mut self) -> bool {
        loop {
            let command = match self.commands.try_recv() {
                Ok(command) => command,
                Err(crossbeam_channel::TryRecvError::Empty) => return true,
                Err(crossbeam_channel::TryRecvError::Disconnected) => return false,
            };
            match command {
                Command::Open { id, spec, token, workers, upstream, reply } => {
                    let _ = reply.send(self.open(id, spec, token, &workers, upstream));
                }
                Command::Close { id, reply } => {
                    self.forget(id);
                    let _ = reply.send(self.board.engine.close_session(id).ok());
                }
                Command::Depart { id, rank, reply } => {
                    let _ = reply.send(self.board.engine.depart(id, rank).ok());
                }
                Command::Counters { reply } => {
                    let engine = &self.board.engine;
                    let sessions =
                        engine.sessions().filter_map(|id| Some((id, engine.session(id)?.1))).collect();
                    let uplink = engine.uplink_totals();
                    let faults = self.port.fault_counters();
                    let _ = reply.send(Counters { engine: *engine.counters(), sessions, uplink, faults });
                }
                Command::Shutdown => return false,
            }
        }
    }

    /// Publishes each session's latest activity on this lane, and takes the latest of
    /// any lane as its own.
    fn share_activity(&mut self) {
        let engine = &mut self.board.engine;
        let sessions: Vec<SessionId> = engine.sessions().collect();
        let mut latest = self.activity.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Only sessions every lane has opened are listed (by `Lanes`); the others wait.
        for id in sessions {
            let (Some(shared), Some(own)) = (latest.get_mut(&id), engine.last_activity(id)) else { continue };
            *shared = (*shared).max(own);
            engine.note_activity(id, *shared);
        }
    }

    fn open(
        &mut self,
        id: Option<SessionId>,
        spec: SessionSpec,
        token: u64,
        workers: &[Registered],
        upstream: Option<UpstreamPath>,
    ) -> Result<SessionId, OpenError> {
        let threads = workers.first().map_or(1, |worker| worker.endpoints.len().max(1));
        let owned = SlotSplit::Ranges.owned(self.lane.index, spec.slots, self.lane.count);
        let mut peers = Peers::resolve(&mut self.port, workers, &spec, spec.slots / threads as u16, owned)
            .map_err(OpenError::Endpoint)?;
        if let Some(path) = &upstream {
            let link = ThreadLink {
                datagram_len: packet::datagram_len(usize::from(spec.packet_elements)),
                window: usize::from(spec.slots),
            };
            for endpoint in &path.endpoints {
                match self.port.resolve(endpoint, path.peer, link) {
                    Ok(address) => peers.upstream.push(address),
                    Err(message) => {
                        peers.all().for_each(|address| self.port.forget(address));
                        return Err(OpenError::Upstream(format!("the upper switch's {endpoint}: {message}")));
                    }
                }
            }
        }
        let now = Instant::now();
        let opened = match id {
            None => self.board.engine.open_session(now, spec, token),
            Some(id) => match self.board.engine.open_session_as(now, id, spec, token) {
                // The first lane chose the id, so it has closed the session there: one
                // whose closing has not reached this lane yet, which it can only hasten.
                Err(SessionError::Taken { open, .. }) => {
                    self.forget(SessionId(open));
                    let _ = self.board.engine.close_session(SessionId(open));
                    self.board.engine.open_session_as(now, id, spec, token)
                }
                other => other,
            },
        };
        let attached = opened.and_then(|id| match upstream {
            Some(path) => {
                self.board.engine.attach_upstream(id, path.upstream).map(|()| id).inspect_err(|_| {
                    let _ = self.board.engine.close_session(id);
                })
            }
            None => Ok(id),
        });
        match attached {
            Ok(id) => {
                // Each rank's thread of one index sees only its slots' broadcasts.
                self.board.engine.number_per_thread(id, spec.slots / threads as u16);
                self.board.peers.insert(id, peers);
                Ok(id)
            }
            Err(error) => {
                peers.all().for_each(|address| self.port.forget(address));
                Err(OpenError::Session(error))
            }
        }
    }

    /// A worker thread's connection ended as `end` says: its rank can contribute no
    /// more, and counts as departed. A session with a round waiting for the rank closes
    /// now; otherwise the first round that needs it closes the session (while the others
    /// may still recover results lost on their way, if the rank had finished its last
    /// job). A connection that failed closes it with its cause, and so does a failure
    /// that leaves no rank; a worker that disconnected has left, as its Leave (which may
    /// come after) says, and the Leaves (or the control connections' closing) close the
    /// session once all have left. An upper switch's connection has no rank: it is logged.
    fn connection_ended(&mut self, address: P::Address, end: ConnectionEnd) {
        let found = self
            .board
            .peers
            .iter()
            .find(|(_, peers)| peers.all().any(|known| known == address))
            .map(|(&id, peers)| (id, peers.worker_thread(address)));
        let Some((id, worker)) = found else { return };
        let session = format_args!("{:#010x}", id.0);
        let Some((rank, thread)) = worker else {
            tracing::warn!(session, ?end, "the connection to the upper switch ended");
            return;
        };
        let why = match end {
            ConnectionEnd::Disconnected => {
                tracing::debug!(session, rank, thread, "a worker thread disconnected");
                None
            }
            ConnectionEnd::Failed(why) => {
                tracing::info!(session, rank, thread, %why, "a worker thread's connection failed");
                Some(why)
            }
        };
        let Ok(departure) = self.board.engine.depart(id, rank) else { return };
        let failed = why.is_some();
        if let Some(why) = why {
            // The first of a rank's threads to fail says why; the others likely followed it.
            self.lost.entry((id, rank)).or_insert_with(|| format!("worker thread {thread}: {why}"));
        }
        match departure {
            Departure::Needed => self.close_orphaned(id, rank),
            Departure::AllGone if failed => self.close_orphaned(id, rank),
            Departure::AllGone | Departure::Lingers => {}
        }
    }

    /// Closes session `id`, which cannot go on without `departed`, and tells the control
    /// plane.
    fn close_orphaned(&mut self, id: SessionId, departed: u16) {
        let lost = self.lost.remove(&(id, departed));
        self.forget(id);
        let counters = self.board.engine.close_session(id).ok();
        let _ = self.events.send(Event::Orphaned { id, departed, counters, lost });
    }

    /// Drops a closed session's addresses and whatever the port keeps for them.
    fn forget(&mut self, id: SessionId) {
        self.lost.retain(|&(session, _), _| session != id);
        self.board.results.retain(|group| group.session != id);
        if let Some(peers) = self.board.peers.remove(&id) {
            peers.all().for_each(|address| self.port.forget(address));
        }
    }
}

impl<A: Copy + Eq + std::hash::Hash> Switchboard<A> {
    fn handle(&mut self, now: Instant, source: A, datagram: &[u8]) {
        let Switchboard { engine, peers, results } = self;
        // A rank's packets for a slot come from the address of its thread owning the
        // slot, to the lane owning it: anything else is forged or misdirected, whatever
        // it says.
        let from_its_rank = |session, rank, slot| {
            peers
                .get(&session)
                .filter(|p: &&Peers<A>| p.owned.contains(&slot))
                .and_then(|p| p.address(rank, slot))
                == Some(source)
        };
        // Most results of a datagram are its slot's broadcast: the engine writes into that
        // group's batch. Bytes too short to name a session get scratch space.
        let header = (datagram.len() >= HEADER_LEN).then(|| Packet::new_unchecked(datagram));
        let session_peers =
            header.as_ref().and_then(|packet| Some((packet, peers.get(&SessionId(packet.session()))?)));
        let predicted = session_peers.map(|(packet, session_peers)| {
            let group = GroupKey {
                session: SessionId(packet.session()),
                thread: session_peers.thread(packet.slot()),
                rank: None,
            };
            (group, session_peers)
        });
        let (lent, out) = results.room(predicted.map(|(group, _)| group), || {
            predicted.map_or_else(Vec::new, |(group, session_peers)| session_peers.group(group.thread, None))
        });
        let transmit = match engine.handle_datagram_from(now, datagram, out, from_its_rank) {
            Verdict::Send(transmit) => transmit,
            Verdict::Consumed => return,
            Verdict::Dropped(reason) => {
                tracing::trace!(%reason, "datagram dropped");
                return;
            }
        };
        let Some(session_peers) = peers.get(&transmit.session) else { return };
        let slot = Packet::new_unchecked(&out[..transmit.len]).slot();
        commit(results, lent, session_peers, transmit, slot);
    }

    /// Batches the notices of lost contributions that waited behind a batch's results.
    fn poll_notices(&mut self) {
        self.drain(Engine::poll_notice);
    }

    /// Sends a lower switch's sessions' packets that their timers call for up to their
    /// upper switches.
    fn poll_upstream(&mut self, now: Instant) {
        self.drain(|engine, out| engine.poll_upstream(now, out));
    }

    /// Batches every packet `poll` has the engine write, until it has none.
    fn drain(&mut self, mut poll: impl FnMut(&mut Engine, &mut [u8]) -> Option<Transmit>) {
        let Switchboard { engine, peers, results } = self;
        loop {
            let (lent, out) = results.room(None, Vec::new);
            let Some(transmit) = poll(engine, out) else { return };
            let slot = Packet::new_unchecked(&out[..transmit.len]).slot();
            if let Some(session_peers) = peers.get(&transmit.session) {
                commit(results, lent, session_peers, transmit, slot);
            }
        }
    }
}

/// Keeps a packet the engine wrote for `slot` of a session in the batch of its recipients:
/// a worker thread of every rank or of one, or the upper switch's endpoint owning the slot.
fn commit<A: Copy + Eq + std::hash::Hash>(
    results: &mut Outbox<GroupKey, A>,
    lent: Lent<GroupKey>,
    session_peers: &Peers<A>,
    transmit: Transmit,
    slot: u16,
) {
    let (thread, rank) = match transmit.recipient {
        Recipient::All => (session_peers.thread(slot), None),
        Recipient::Worker(rank) => (session_peers.thread(slot), Some(rank)),
        Recipient::Upstream => match session_peers.upstream_owner(slot) {
            Some((owner, _)) => (owner as u16, Some(UPSTREAM_RANK)),
            None => return,
        },
    };
    let group = GroupKey { session: transmit.session, thread, rank };
    results.commit(lent, transmit.len, group, || match transmit.recipient {
        Recipient::Upstream => session_peers.upstream.get(usize::from(thread)).copied().into_iter().collect(),
        _ => session_peers.group(thread, rank),
    });
}
