//! The aggregation engine: sessions of slots that sum the workers' packets, without I/O.
//!
//! A datagram and the current time go in ([`Engine::handle_datagram`]); a [`Verdict`]
//! comes out, naming the packet to send (written into a buffer the caller lends) and its
//! recipients. Idle sessions expire through [`Engine::poll_timeout`] and
//! [`Engine::handle_timeout`]. `docs/protocol.md` explains the protocol this implements.
//!
//! # Slots, rounds and sets
//! Each use of a slot is a *round*, numbered per slot from 0 (wrapping). A slot owns
//! `depth` *sets*; depth 2 is SwitchML's pair of a working copy and a shadow copy. A set
//! passes through:
//! - *free*: the open round's first contribution takes the slot's free set of lowest
//!   index, so a dense stream, which frees each set one round after using it, keeps
//!   alternating between two sets that stay in cache however deep the slot is;
//! - *aggregating*: the first contribution writes the payload, each new one adds to it,
//!   and a duplicate changes nothing; exponents are max-reduced;
//! - *complete*: the last expected contribution makes the result, sent to every worker.
//!   A duplicate from a contributor gets the result back, to that worker alone. The set
//!   keeps the result until every worker has acknowledged it (the *unacked* bitmap,
//!   SwitchML's cross-clear generalised), and is free again then. A slot with no free
//!   set holds `depth` results some worker lacks: its open round waits (*stalled*).
//!
//! Rounds make stale packets harmless: a packet of a round that is neither open nor
//! retained is dropped, where SwitchML's single set bit would let a late duplicate of an
//! earlier job count as a contribution to a later one.
//!
//! # Dense and sparse rounds
//! A *start* round expects every worker. Dense rounds are all start rounds. In a sparse
//! stream each contribution also names the sender's next non-zero block; when a round
//! completes, the stream moves to the smallest of those, and only the workers that named
//! it are expected in the next round. A stream whose next block is [`END_OF_STREAM`]
//! ends, and the slot's next round is a start round again.

use std::time::{Duration, Instant};

use netagg_wire::packet::{BROADCAST_RANK, ELEMENT_LEN, END_OF_STREAM, HEADER_LEN, MAX_ELEMENTS};
use netagg_wire::{ElementType, Flags, MessageType, Packet, PacketRepr, WireError};

use crate::round::is_after;
use crate::sum;
use crate::workers::WorkerSet;

/// Limits of one engine; every session is checked against them when it opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineLimits {
    /// Sessions open at once (at most 65535).
    pub max_sessions: u16,
    /// Workers in one session.
    pub max_workers: u16,
    /// Slots in one session.
    pub max_slots: u16,
    /// Rounds a slot may retain; a power of two, at most [`MAX_DEPTH`].
    pub max_depth: u8,
    /// Elements in one packet.
    pub max_packet_elements: u16,
    /// Bytes of state all sessions together may hold.
    pub max_bytes: usize,
    /// Bytes of state one session may hold, so that one tenant cannot take the budget.
    pub max_session_bytes: usize,
    /// A session that receives nothing for this long is closed (`Duration::MAX`: never).
    pub session_idle_timeout: Duration,
}

impl Default for EngineLimits {
    fn default() -> Self {
        EngineLimits {
            max_sessions: 64,
            max_workers: 1024,
            max_slots: 8192,
            max_depth: MAX_DEPTH,
            max_packet_elements: MAX_ELEMENTS as u16,
            max_bytes: 1 << 30,
            max_session_bytes: 1 << 30,
            session_idle_timeout: Duration::from_secs(60),
        }
    }
}

/// The most sets a slot may keep: workers track received rounds in a 64-bit
/// window.
pub const MAX_DEPTH: u8 = 64;

/// What a session is made of, agreed by its workers at registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionSpec {
    pub workers: u16,
    pub slots: u16,
    pub packet_elements: u16,
    /// Rounds each slot retains: 2 for dense jobs, more lets silent workers of sparse
    /// streams acknowledge in batches.
    pub depth: u8,
}

impl SessionSpec {
    /// Bytes of engine state a session of this shape holds.
    pub fn state_bytes(&self) -> usize {
        let bitmap = WorkerSet::heap_bytes(self.workers);
        let set = core::mem::size_of::<Set>() + 2 * bitmap + self.packet_elements as usize * 4;
        let slot = core::mem::size_of::<Slot>() + bitmap + self.workers as usize * 4;
        self.slots as usize * (slot + self.depth as usize * set)
    }
}

/// Why a session could not open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error("{open} sessions are open, the limit is {max}")]
    TooManySessions { open: usize, max: u16 },
    #[error("{requested} workers requested, a session holds 1 to {max}")]
    Workers { requested: u16, max: u16 },
    #[error("{requested} slots requested, a session holds 1 to {max}")]
    Slots { requested: u16, max: u16 },
    #[error("depth {requested} requested, it must be a power of two from 2 to {max}")]
    Depth { requested: u8, max: u8 },
    #[error("{requested} elements per packet requested, the limit is 1 to {max}")]
    PacketElements { requested: u16, max: u16 },
    #[error("the session needs {needed} bytes, {available} of the engine's budget are free")]
    Memory { needed: usize, available: usize },
    #[error("the session needs {needed} bytes, one session may hold at most {max}")]
    SessionMemory { needed: usize, max: usize },
    #[error("no open session has id {0:#010x}")]
    Unknown(u32),
    #[error("rank {rank} is not below the session's {workers} workers")]
    Rank { rank: u16, workers: u16 },
}

/// Handle of an open session; also the `session` field of its packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u32);

impl SessionId {
    fn index(self) -> usize {
        (self.0 & 0xFFFF) as usize
    }
}

/// What to do after a datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Taken into the state; nothing to send.
    Consumed,
    /// Send the first `len` bytes of the output buffer.
    Send(Transmit),
    /// Not taken into any round. A packet dropped after passing its session's token,
    /// rank, slot and source checks still keeps the session alive, and its `ack round`
    /// still counts.
    Dropped(DropReason),
}

/// A packet the engine wrote into the caller's output buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    pub session: SessionId,
    pub recipient: Recipient,
    pub len: usize,
}

/// Who a result goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipient {
    /// Every worker of the session.
    All,
    /// One worker, by rank.
    Worker(u16),
}

/// Why a datagram was dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DropReason {
    #[error("malformed packet: {0}")]
    Malformed(#[from] WireError),
    #[error("no open session has this id")]
    UnknownSession,
    #[error("the token is not the session's")]
    WrongToken,
    #[error("the packet did not come from the address its rank registered")]
    WrongSource,
    #[error("results and pending notices are for workers, not for the switch")]
    NotForSwitch,
    #[error("rank is not below the session's worker count")]
    RankOutOfRange,
    #[error("slot is not below the session's slot count")]
    SlotOutOfRange,
    #[error("more elements than the session's packet size")]
    TooManyElements,
    #[error("round is older than any the slot retains")]
    Stale,
    #[error("round is ahead of the slot's open round")]
    TooEarly,
    #[error("worker is not expected to contribute to this round")]
    NotExpected,
    #[error("contribution disagrees with the round on its {0}")]
    Mismatch(&'static str),
    #[error("every set of the slot retains a result some worker has not acknowledged")]
    Stalled,
    #[error("output buffer cannot hold a result of this session")]
    OutputTooSmall,
    #[error("the round needs rank {0}, which has left the session")]
    Departed(u16),
}

/// What a rank's leaving means for its session ([`Engine::depart`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Departure {
    /// Every round the rank contributes to is complete: the session stays open, so that
    /// the other ranks can still recover the results they lost, until they leave too or
    /// a round needs the rank (then [`Engine::take_orphaned`] names the session).
    Lingers,
    /// A round in progress waits for the rank's contribution: the session cannot
    /// complete it and must close.
    Needed,
    /// Every rank has left: the session may close.
    AllGone,
}

counters! {
    /// Counters of one session.
    pub struct SessionCounters {
        /// Datagrams that named this session.
        pub packets_in: u64,
        /// Contributions taken into a sum.
        pub contributions: u64,
        /// Rounds completed, each sent to every worker.
        pub results_broadcast: u64,
        /// Results sent again to one worker (after a duplicate or a request).
        pub results_resent: u64,
        /// Duplicate contributions (to complete or aggregating rounds); each is answered,
        /// with the result or with a pending notice.
        pub duplicates: u64,
        /// Packets of rounds no longer retained.
        pub stale: u64,
        /// Contributions dropped because every set of their slot retained a result some
        /// worker had not acknowledged.
        pub stalled: u64,
        /// Requests for a round that has not completed, answered with a pending notice.
        pub not_ready: u64,
        /// Packets that break the protocol (wrong rank, slot, round, size or fields).
        pub rejected: u64,
        /// Packets naming the session without its token, or from an address other than
        /// their rank's: forged or misdirected, and never let near the sums.
        pub forged: u64,
    }
}

counters! {
    /// Counters of the whole engine.
    pub struct EngineCounters {
        pub datagrams: u64,
        pub malformed: u64,
        pub unknown_session: u64,
        pub sessions_opened: u64,
        pub sessions_closed: u64,
        pub sessions_expired: u64,
    }
}

/// The aggregation engine.
#[derive(Debug)]
pub struct Engine {
    limits: EngineLimits,
    sessions: Vec<Option<Session>>,
    /// Generation of each session index, so a reused index gets a new id.
    generations: Vec<u16>,
    bytes_in_use: usize,
    counters: EngineCounters,
    /// Sessions that received a contribution to a round a departed rank must complete,
    /// with that rank, each once, until taken.
    orphaned: Vec<(SessionId, u16)>,
}

impl Engine {
    pub fn new(limits: EngineLimits) -> Engine {
        Engine {
            limits,
            sessions: Vec::new(),
            generations: Vec::new(),
            bytes_in_use: 0,
            counters: EngineCounters::default(),
            orphaned: Vec::new(),
        }
    }

    pub fn limits(&self) -> &EngineLimits {
        &self.limits
    }

    pub fn counters(&self) -> &EngineCounters {
        &self.counters
    }

    /// Opens a session, checking it against every limit before allocating anything.
    /// `token` is the secret its packets must carry; the caller draws it from a CSPRNG
    /// (the engine reads no randomness of its own) and hands it to the workers.
    pub fn open_session(
        &mut self,
        now: Instant,
        spec: SessionSpec,
        token: u64,
    ) -> Result<SessionId, SessionError> {
        let limits = &self.limits;
        if spec.workers == 0 || spec.workers > limits.max_workers {
            return Err(SessionError::Workers { requested: spec.workers, max: limits.max_workers });
        }
        if spec.slots == 0 || spec.slots > limits.max_slots {
            return Err(SessionError::Slots { requested: spec.slots, max: limits.max_slots });
        }
        let max_depth = limits.max_depth.min(MAX_DEPTH);
        if spec.depth < 2 || !spec.depth.is_power_of_two() || spec.depth > max_depth {
            return Err(SessionError::Depth { requested: spec.depth, max: max_depth });
        }
        let max_elements = limits.max_packet_elements.min(MAX_ELEMENTS as u16);
        if spec.packet_elements == 0 || spec.packet_elements > max_elements {
            return Err(SessionError::PacketElements { requested: spec.packet_elements, max: max_elements });
        }
        let open = self.sessions.iter().filter(|s| s.is_some()).count();
        if open >= limits.max_sessions as usize {
            return Err(SessionError::TooManySessions { open, max: limits.max_sessions });
        }
        let needed = spec.state_bytes();
        if needed > limits.max_session_bytes {
            return Err(SessionError::SessionMemory { needed, max: limits.max_session_bytes });
        }
        let available = limits.max_bytes.saturating_sub(self.bytes_in_use);
        if needed > available {
            return Err(SessionError::Memory { needed, available });
        }
        let index = match self.sessions.iter().position(Option::is_none) {
            Some(index) => index,
            None => {
                self.sessions.push(None);
                self.generations.push(0);
                self.sessions.len() - 1
            }
        };
        // Generations start at 1 so that no session ever has id 0.
        let generation = self.generations[index].wrapping_add(1).max(1);
        self.generations[index] = generation;
        let id = SessionId((generation as u32) << 16 | index as u32);
        self.sessions[index] = Some(Session::new(id, spec, token, now));
        self.bytes_in_use += needed;
        self.counters.sessions_opened += 1;
        Ok(id)
    }

    /// Closes a session, freeing its slots; returns its final counters.
    pub fn close_session(&mut self, id: SessionId) -> Result<SessionCounters, SessionError> {
        let session = self.take_session(id).ok_or(SessionError::Unknown(id.0))?;
        self.counters.sessions_closed += 1;
        Ok(session.counters)
    }

    /// Records that `rank` left the session after its last job. Its results stay
    /// retained for the others; a round that would need its contribution later is
    /// dropped, and the session named by [`Engine::take_orphaned`].
    pub fn depart(&mut self, id: SessionId, rank: u16) -> Result<Departure, SessionError> {
        let session = self.session_mut(id).ok_or(SessionError::Unknown(id.0))?;
        if rank >= session.spec.workers {
            return Err(SessionError::Rank { rank, workers: session.spec.workers });
        }
        if (0..session.spec.slots).any(|slot| session.waits_for(slot, rank)) {
            return Ok(Departure::Needed);
        }
        session.departed.insert(rank);
        Ok(if session.departed.len() == session.spec.workers as usize {
            Departure::AllGone
        } else {
            Departure::Lingers
        })
    }

    /// Sessions that a round needing a departed rank has made unable to progress since
    /// the last call, with that rank: the caller closes them and tells their ranks.
    pub fn take_orphaned(&mut self) -> Vec<(SessionId, u16)> {
        std::mem::take(&mut self.orphaned)
    }

    /// Whether [`Engine::take_orphaned`] has anything: cheap, for a loop that asks after
    /// every batch.
    pub fn has_orphaned(&self) -> bool {
        !self.orphaned.is_empty()
    }

    fn take_session(&mut self, id: SessionId) -> Option<Session> {
        let entry = self.sessions.get_mut(id.index())?;
        if entry.as_ref().is_none_or(|s| s.id != id) {
            return None;
        }
        let session = entry.take()?;
        self.bytes_in_use -= session.spec.state_bytes();
        Some(session)
    }

    fn session_mut(&mut self, id: SessionId) -> Option<&mut Session> {
        self.sessions.get_mut(id.index())?.as_mut().filter(|s| s.id == id)
    }

    /// The shape and counters of an open session.
    pub fn session(&self, id: SessionId) -> Option<(SessionSpec, SessionCounters)> {
        let session = self.sessions.get(id.index())?.as_ref().filter(|s| s.id == id)?;
        Some((session.spec, session.counters))
    }

    /// Ids of the open sessions.
    pub fn sessions(&self) -> impl Iterator<Item = SessionId> + '_ {
        self.sessions.iter().flatten().map(|s| s.id)
    }

    /// Bytes of state the open sessions hold.
    pub fn bytes_in_use(&self) -> usize {
        self.bytes_in_use
    }

    /// Takes one datagram from a worker. A result to send is written into `out`, which
    /// must hold a header and a full packet of the session (a [`MAX_DATAGRAM_LEN`]-byte
    /// buffer always does).
    ///
    /// [`MAX_DATAGRAM_LEN`]: netagg_wire::MAX_DATAGRAM_LEN
    pub fn handle_datagram(&mut self, now: Instant, datagram: &[u8], out: &mut [u8]) -> Verdict {
        self.handle_datagram_from(now, datagram, out, |_, _, _| true)
    }

    /// [`Engine::handle_datagram`] for a shell that knows where datagrams come from:
    /// `from_its_rank(session, rank, slot)` says whether the datagram came from the
    /// address that rank's thread for that slot registered. It is asked only once the
    /// packet is well formed and carries its session's token.
    pub fn handle_datagram_from(
        &mut self,
        now: Instant,
        datagram: &[u8],
        out: &mut [u8],
        from_its_rank: impl FnOnce(SessionId, u16, u16) -> bool,
    ) -> Verdict {
        self.counters.datagrams += 1;
        let packet = match Packet::new_checked(datagram) {
            Ok(packet) => packet,
            Err(error) => {
                self.counters.malformed += 1;
                return Verdict::Dropped(DropReason::Malformed(error));
            }
        };
        let repr = PacketRepr::parse(&packet);
        let Some(session) = self.session_mut(SessionId(repr.session)) else {
            self.counters.unknown_session += 1;
            return Verdict::Dropped(DropReason::UnknownSession);
        };
        let verdict = session.handle(now, &repr, packet.payload(), out, from_its_rank);
        if let Verdict::Dropped(DropReason::Departed(rank)) = verdict {
            let id = SessionId(repr.session);
            if !self.orphaned.iter().any(|(orphaned, _)| *orphaned == id) {
                self.orphaned.push((id, rank));
            }
        }
        verdict
    }

    /// When [`Engine::handle_timeout`] next has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let idle = self.limits.session_idle_timeout;
        self.sessions.iter().flatten().filter_map(|s| s.last_activity.checked_add(idle)).min()
    }

    /// Closes every session idle for the configured timeout; returns their ids.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<SessionId> {
        let idle = self.limits.session_idle_timeout;
        let expired: Vec<SessionId> = self
            .sessions
            .iter()
            .flatten()
            .filter(|s| now.saturating_duration_since(s.last_activity) >= idle)
            .map(|s| s.id)
            .collect();
        for &id in &expired {
            self.take_session(id);
            self.counters.sessions_expired += 1;
        }
        expired
    }
}

#[derive(Debug)]
struct Session {
    id: SessionId,
    spec: SessionSpec,
    token: u64,
    last_activity: Instant,
    counters: SessionCounters,
    slots: Vec<Slot>,
    /// `slots × depth` sets; slot `s` owns `s * depth .. (s + 1) * depth`.
    sets: Vec<Set>,
    /// The sets' payloads, `payload_len` bytes each in the order of `sets`: one
    /// allocation, whose pages a set touches only once a round uses it.
    payloads: Box<[u8]>,
    payload_len: usize,
    /// Ranks that left after their last job ([`Engine::depart`]).
    departed: WorkerSet,
}

#[derive(Debug)]
struct Slot {
    /// The round now aggregating; every earlier round has completed.
    open_round: u32,
    /// In a sparse stream, the block the open round aggregates; `None` for a start round,
    /// which every worker contributes to.
    continuation: Option<u32>,
    /// Workers expected in a continuation round.
    expected: WorkerSet,
    /// Each worker's latest *next block* in this slot's sparse stream.
    next_blocks: Box<[u32]>,
    /// The set (of the slot's own, counted from 0) aggregating the open round, once its
    /// first contribution arrived.
    open_set: Option<u8>,
    /// Bit `i`: the slot's set `i` holds a complete round's result that some worker has
    /// not acknowledged. Every other set but `open_set` is free.
    retained: u64,
}

#[derive(Debug)]
struct Set {
    /// The round the set aggregates or retains; meaningless while the set is free.
    round: u32,
    contributed: WorkerSet,
    /// Workers that may still need this set's result; the set is reused only when empty.
    unacked: WorkerSet,
    contributions: u16,
    /// What every contribution to the round must agree on; the first one sets it.
    job: u32,
    packet_id: u32,
    block: u32,
    element_type: ElementType,
    sparse: bool,
    /// Elements of the sum; 0 until a contribution with a payload arrives.
    element_count: u16,
    exponent: i8,
    next_block: u32,
    /// The rank whose contribution completed the round; `None` while it aggregates.
    completed_by: Option<u16>,
}

impl Session {
    fn new(id: SessionId, spec: SessionSpec, token: u64, now: Instant) -> Session {
        let slots = (0..spec.slots)
            .map(|_| Slot {
                open_round: 0,
                continuation: None,
                expected: WorkerSet::new(spec.workers),
                next_blocks: vec![END_OF_STREAM; spec.workers as usize].into_boxed_slice(),
                open_set: None,
                retained: 0,
            })
            .collect();
        let payload_len = spec.packet_elements as usize * ELEMENT_LEN;
        let set_count = spec.slots as usize * spec.depth as usize;
        let sets = (0..set_count)
            .map(|_| Set {
                round: 0,
                contributed: WorkerSet::new(spec.workers),
                unacked: WorkerSet::new(spec.workers),
                contributions: 0,
                job: 0,
                packet_id: 0,
                block: 0,
                element_type: ElementType::Int32,
                sparse: false,
                element_count: 0,
                exponent: i8::MIN,
                next_block: END_OF_STREAM,
                completed_by: None,
            })
            .collect();
        Session {
            id,
            spec,
            token,
            last_activity: now,
            counters: SessionCounters::default(),
            slots,
            sets,
            payloads: vec![0; set_count * payload_len].into_boxed_slice(),
            payload_len,
            departed: WorkerSet::new(spec.workers),
        }
    }

    /// Whether the open round of `slot`, begun or not, cannot complete without
    /// `rank`'s contribution: it expects the rank (a start round expects every rank, a
    /// sparse continuation those whose streams have its block) and has not had it.
    fn round_needs(&self, slot: u16, rank: u16) -> bool {
        let state = &self.slots[slot as usize];
        let expects = state.continuation.is_none() || state.expected.contains(rank);
        expects && !self.contributed(slot, rank)
    }

    /// Whether `rank` has contributed to the open round of `slot`.
    fn contributed(&self, slot: u16, rank: u16) -> bool {
        let open_set = self.slots[slot as usize].open_set;
        open_set.is_some_and(|set| self.sets[self.set_index(slot, set as u32)].contributed.contains(rank))
    }

    /// Whether the open round of `slot` is under way (a contribution is in, or a sparse
    /// stream has scheduled it) and waits for `rank`.
    fn waits_for(&self, slot: u16, rank: u16) -> bool {
        let state = &self.slots[slot as usize];
        let under_way = state.continuation.is_some() || state.open_set.is_some();
        under_way && self.round_needs(slot, rank)
    }

    /// A rank that has left and that the open round of `slot` needs, if any.
    fn departed_needed(&self, slot: u16) -> Option<u16> {
        if self.departed.is_empty() {
            return None;
        }
        self.departed.iter().find(|&rank| self.round_needs(slot, rank))
    }

    /// The index in `sets` of the slot's own set `set`.
    fn set_index(&self, slot: u16, set: u32) -> usize {
        slot as usize * self.spec.depth as usize + set as usize
    }

    /// The index in `sets` of the set retaining complete round `round` of `slot`.
    fn retained_set(&self, slot: u16, round: u32) -> Option<usize> {
        let mut retained = self.slots[slot as usize].retained;
        while retained != 0 {
            let index = self.set_index(slot, retained.trailing_zeros());
            if self.sets[index].round == round {
                return Some(index);
            }
            retained &= retained - 1;
        }
        None
    }

    fn reject(&mut self, reason: DropReason) -> Verdict {
        self.counters.rejected += 1;
        Verdict::Dropped(reason)
    }

    fn handle(
        &mut self,
        now: Instant,
        repr: &PacketRepr,
        payload: &[u8],
        out: &mut [u8],
        from_its_rank: impl FnOnce(SessionId, u16, u16) -> bool,
    ) -> Verdict {
        self.counters.packets_in += 1;
        // Before anything else: a forged packet must not even keep the session alive.
        if repr.token != self.token {
            self.counters.forged += 1;
            return Verdict::Dropped(DropReason::WrongToken);
        }
        if out.len() < HEADER_LEN + self.spec.packet_elements as usize * ELEMENT_LEN {
            return Verdict::Dropped(DropReason::OutputTooSmall);
        }
        if repr.rank >= self.spec.workers {
            return self.reject(DropReason::RankOutOfRange);
        }
        if repr.slot >= self.spec.slots {
            return self.reject(DropReason::SlotOutOfRange);
        }
        if !from_its_rank(self.id, repr.rank, repr.slot) {
            self.counters.forged += 1;
            return Verdict::Dropped(DropReason::WrongSource);
        }
        self.last_activity = now;
        match repr.message_type {
            MessageType::Result | MessageType::Pending => self.reject(DropReason::NotForSwitch),
            MessageType::Ack => {
                self.apply_ack(repr.slot, repr.rank, repr.ack_round);
                if !repr.flags.contains(Flags::WANT_RESULT) {
                    return Verdict::Consumed;
                }
                // A probe for a round under way that a departed rank must complete: the
                // session cannot go on, and the prober must hear so, not wait.
                if repr.round == self.slots[repr.slot as usize].open_round {
                    let departed = self.departed.iter().find(|&rank| self.waits_for(repr.slot, rank));
                    if let Some(rank) = departed {
                        return self.reject(DropReason::Departed(rank));
                    }
                }
                self.resend_result(repr, false, out)
            }
            MessageType::Data => {
                self.apply_ack(repr.slot, repr.rank, repr.ack_round);
                self.contribute(repr, payload, out)
            }
        }
    }

    /// Records that `rank` holds every result of `slot` up to round `ack` (the cross-clear),
    /// freeing the sets every worker now holds.
    fn apply_ack(&mut self, slot: u16, rank: u16, ack: u32) {
        let first = slot as usize * self.spec.depth as usize;
        let retained = &mut self.slots[slot as usize].retained;
        let mut unvisited = *retained;
        while unvisited != 0 {
            let bit = unvisited & unvisited.wrapping_neg();
            unvisited &= unvisited - 1;
            let set = &mut self.sets[first + bit.trailing_zeros() as usize];
            if !is_after(set.round, ack) {
                set.unacked.remove(rank);
                if set.unacked.is_empty() {
                    *retained &= !bit;
                }
            }
        }
    }

    /// Answers a worker asking for the result of `repr`'s round, or contributing to it
    /// again: with the result if the slot retains it (to contributors only, if
    /// `only_contributors`), or with a pending notice if the round is still aggregating.
    fn resend_result(&mut self, repr: &PacketRepr, only_contributors: bool, out: &mut [u8]) -> Verdict {
        let (slot, round, rank) = (repr.slot, repr.round, repr.rank);
        let Some(index) = self.retained_set(slot, round) else {
            if round == self.slots[slot as usize].open_round {
                self.counters.not_ready += 1;
                return self.emit_pending(repr, out);
            }
            if is_after(round, self.slots[slot as usize].open_round) {
                return self.reject(DropReason::TooEarly);
            }
            self.counters.stale += 1;
            return Verdict::Dropped(DropReason::Stale);
        };
        if only_contributors && !self.sets[index].contributed.contains(rank) {
            return self.reject(DropReason::NotExpected);
        }
        self.counters.results_resent += 1;
        self.emit_result(index, slot, Recipient::Worker(rank), out)
    }

    fn contribute(&mut self, repr: &PacketRepr, payload: &[u8], out: &mut [u8]) -> Verdict {
        let slot_index = repr.slot as usize;
        let open_round = self.slots[slot_index].open_round;
        if repr.round != open_round {
            if is_after(repr.round, open_round) {
                return self.reject(DropReason::TooEarly);
            }
            let verdict = self.resend_result(repr, true, out);
            if matches!(verdict, Verdict::Send(_)) {
                self.counters.duplicates += 1;
            }
            return verdict;
        }
        if let Err(reason) = self.check_contribution(repr) {
            return self.reject(reason);
        }
        if let Some(rank) = self.departed_needed(repr.slot) {
            return self.reject(DropReason::Departed(rank));
        }

        let own_set = match self.slots[slot_index].open_set {
            Some(own_set) => {
                let set = &self.sets[self.set_index(repr.slot, own_set as u32)];
                if set.contributed.contains(repr.rank) {
                    self.counters.duplicates += 1;
                    return self.emit_pending(repr, out);
                }
                if let Err(field) = set.agrees_with(repr) {
                    return self.reject(DropReason::Mismatch(field));
                }
                own_set
            }
            None => {
                let depth_mask = u64::MAX >> (64 - self.spec.depth as u32);
                let free = !self.slots[slot_index].retained & depth_mask;
                if free == 0 {
                    self.counters.stalled += 1;
                    return Verdict::Dropped(DropReason::Stalled);
                }
                let own_set = free.trailing_zeros() as u8;
                self.slots[slot_index].open_set = Some(own_set);
                let index = self.set_index(repr.slot, own_set as u32);
                self.sets[index].start(repr);
                own_set
            }
        };

        let index = self.set_index(repr.slot, own_set as u32);
        let set = &mut self.sets[index];
        set.contributed.insert(repr.rank);
        set.contributions += 1;
        set.exponent = set.exponent.max(repr.exponent);
        if repr.element_count > 0 {
            let sum = &mut self.payloads[index * self.payload_len..][..payload.len()];
            if set.element_count == 0 {
                set.element_count = repr.element_count;
                sum.copy_from_slice(payload);
            } else {
                sum::add_assign(set.element_type, sum, payload);
            }
        }
        self.counters.contributions += 1;

        let slot = &mut self.slots[slot_index];
        if set.sparse {
            slot.next_blocks[repr.rank as usize] = repr.next_block;
        }
        let expected = match slot.continuation {
            Some(_) => slot.expected.len(),
            None => self.spec.workers as usize,
        };
        if (set.contributions as usize) < expected {
            return Verdict::Consumed;
        }

        // The last expected contribution: the round completes.
        set.completed_by = Some(repr.rank);
        set.unacked.fill(self.spec.workers);
        slot.open_set = None;
        slot.retained |= 1 << own_set;
        slot.open_round = repr.round.wrapping_add(1);
        slot.continuation = None;
        set.next_block = END_OF_STREAM;
        if set.sparse {
            let next = slot.next_blocks.iter().copied().min().unwrap_or(END_OF_STREAM);
            set.next_block = next;
            if next != END_OF_STREAM {
                slot.continuation = Some(next);
                slot.expected.clear();
                for (rank, &block) in slot.next_blocks.iter().enumerate() {
                    if block == next {
                        slot.expected.insert(rank as u16);
                    }
                }
            }
        }
        self.counters.results_broadcast += 1;
        self.emit_result(index, repr.slot, Recipient::All, out)
    }

    /// Checks a contribution to the open round against the slot, before any state changes.
    fn check_contribution(&self, repr: &PacketRepr) -> Result<(), DropReason> {
        if repr.element_count > self.spec.packet_elements {
            return Err(DropReason::TooManyElements);
        }
        let sparse = repr.flags.contains(Flags::SPARSE);
        if sparse && repr.next_block <= repr.block {
            return Err(DropReason::Mismatch("next block (it must follow the block)"));
        }
        let slot = &self.slots[repr.slot as usize];
        if let Some(block) = slot.continuation {
            if !sparse {
                return Err(DropReason::Mismatch("mode (the slot streams a sparse tensor)"));
            }
            if repr.block != block {
                return Err(DropReason::Mismatch("block"));
            }
            if !slot.expected.contains(repr.rank) {
                return Err(DropReason::NotExpected);
            }
        }
        Ok(())
    }

    /// Tells the sender of `repr` that its round is still aggregating, and whether its
    /// own contribution is in: so that a worker waiting for a late peer stops resending.
    /// The notice also maps which of the next 64 slots' rounds wait for this worker, so
    /// that one probe finds the contributions it lost anywhere in its window.
    fn emit_pending(&self, repr: &PacketRepr, out: &mut [u8]) -> Verdict {
        let last = (repr.slot as u32 + 64).min(self.spec.slots as u32) as u16;
        let lacking =
            (repr.slot..last).rev().fold(0u64, |map, slot| map << 1 | self.waits_for(slot, repr.rank) as u64);
        let mut notice = PacketRepr {
            flags: if self.contributed(repr.slot, repr.rank) { Flags::CONTRIBUTED } else { Flags::NONE },
            job: repr.job,
            rank: repr.rank,
            slot: repr.slot,
            round: repr.round,
            ..PacketRepr::new(MessageType::Pending, repr.element_type, self.id.0, self.token, 0)
        };
        notice.set_lacking(lacking);
        // `handle` checked that `out` holds a full packet, so a header too.
        match notice.emit(out) {
            Ok(_) => Verdict::Send(Transmit {
                session: self.id,
                recipient: Recipient::Worker(repr.rank),
                len: HEADER_LEN,
            }),
            Err(_) => Verdict::Dropped(DropReason::OutputTooSmall),
        }
    }

    fn emit_result(&mut self, index: usize, slot: u16, recipient: Recipient, out: &mut [u8]) -> Verdict {
        let set = &self.sets[index];
        let mut repr = PacketRepr {
            message_type: MessageType::Result,
            element_type: set.element_type,
            flags: if set.sparse { Flags::SPARSE } else { Flags::NONE },
            session: self.id.0,
            job: set.job,
            packet_id: set.packet_id,
            rank: match recipient {
                Recipient::All => BROADCAST_RANK,
                Recipient::Worker(rank) => rank,
            },
            element_count: set.element_count,
            slot,
            exponent: set.exponent,
            round: set.round,
            block: set.block,
            next_block: set.next_block,
            ack_round: 0,
            token: self.token,
        };
        repr.set_completed_by(set.completed_by);
        let len = repr.buffer_len();
        // `handle` checked that `out` holds a full packet of the session.
        match repr.emit(out) {
            Ok(mut packet) => {
                let payload = &self.payloads[index * self.payload_len..][..len - HEADER_LEN];
                packet.payload_mut().copy_from_slice(payload);
                Verdict::Send(Transmit { session: self.id, recipient, len })
            }
            Err(_) => Verdict::Dropped(DropReason::OutputTooSmall),
        }
    }
}

impl Set {
    /// Resets the set for a new round; the first contribution writes rather than adds.
    fn start(&mut self, repr: &PacketRepr) {
        self.round = repr.round;
        self.contributed.clear();
        self.unacked.clear();
        self.contributions = 0;
        self.job = repr.job;
        self.packet_id = repr.packet_id;
        self.block = repr.block;
        self.element_type = repr.element_type;
        self.sparse = repr.flags.contains(Flags::SPARSE);
        self.element_count = 0;
        self.exponent = i8::MIN;
        self.next_block = END_OF_STREAM;
        self.completed_by = None;
    }

    /// Checks that a further contribution describes the same round as the first.
    fn agrees_with(&self, repr: &PacketRepr) -> Result<(), &'static str> {
        if repr.job != self.job {
            return Err("job");
        }
        if repr.packet_id != self.packet_id {
            return Err("packet id");
        }
        if repr.block != self.block {
            return Err("block");
        }
        if repr.element_type != self.element_type {
            return Err("element type");
        }
        if repr.flags.contains(Flags::SPARSE) != self.sparse {
            return Err("mode");
        }
        if repr.element_count != 0 && self.element_count != 0 && repr.element_count != self.element_count {
            return Err("element count");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contribution(session: SessionId, rank: u16, round: u32, ack_round: u32) -> Vec<u8> {
        let repr = PacketRepr {
            rank,
            round,
            ack_round,
            ..PacketRepr::new(MessageType::Data, ElementType::Int32, session.0, 7, 1)
        };
        let mut buffer = vec![0; repr.buffer_len()];
        repr.emit(&mut buffer).unwrap().payload_mut().copy_from_slice(&(round as i32).to_le_bytes());
        buffer
    }

    /// An engine with one session of 2 workers and one slot of `depth` sets, the time,
    /// and a buffer for results.
    fn one_slot(depth: u8) -> (Engine, SessionId, Instant, Vec<u8>) {
        let mut engine = Engine::new(EngineLimits::default());
        let now = Instant::now();
        let spec = SessionSpec { workers: 2, slots: 1, packet_elements: 4, depth };
        let session = engine.open_session(now, spec, 7).unwrap();
        (engine, session, now, vec![0; MAX_ELEMENTS * ELEMENT_LEN + HEADER_LEN])
    }

    /// The slot's sets that hold a round (aggregating or retained), by index.
    fn sets_in_use(engine: &mut Engine, session: SessionId) -> Vec<u32> {
        let slot = &engine.session_mut(session).unwrap().slots[0];
        let retained = (0..64).filter(|i| slot.retained & (1 << i) != 0);
        retained.chain(slot.open_set.map(u32::from)).collect()
    }

    #[test]
    fn a_dense_stream_alternates_between_two_sets_however_deep_the_slot() {
        let (mut engine, session, now, mut out) = one_slot(8);
        let mut used = Vec::new();
        for round in 0..20u32 {
            // Each contribution acknowledges the round before, as a dense worker's does.
            for rank in 0..2 {
                let packet = contribution(session, rank, round, round.wrapping_sub(1));
                let verdict = engine.handle_datagram(now, &packet, &mut out);
                assert_eq!(matches!(verdict, Verdict::Send(_)), rank == 1, "round {round}");
                used.extend(sets_in_use(&mut engine, session));
            }
        }
        used.sort();
        used.dedup();
        assert_eq!(used, [0, 1]);
    }

    #[test]
    fn a_round_waits_while_every_set_retains_a_result_someone_lacks() {
        let (mut engine, session, now, mut out) = one_slot(4);
        // Rank 1 never acknowledges: four rounds fill the four sets.
        for round in 0..4u32 {
            engine.handle_datagram(now, &contribution(session, 0, round, round.wrapping_sub(1)), &mut out);
            engine.handle_datagram(now, &contribution(session, 1, round, u32::MAX), &mut out);
        }
        assert_eq!(sets_in_use(&mut engine, session), [0, 1, 2, 3]);
        let stalled = engine.handle_datagram(now, &contribution(session, 0, 4, 3), &mut out);
        assert_eq!(stalled, Verdict::Dropped(DropReason::Stalled));
        // Rank 1 acknowledges rounds 0 and 1: sets 0 and 1 free, and round 4 takes set 0.
        engine.handle_datagram(now, &contribution(session, 1, 4, 1), &mut out);
        assert_eq!(sets_in_use(&mut engine, session), [2, 3, 0]);
    }

    #[test]
    fn a_rank_that_left_after_its_last_round_leaves_its_results_to_the_others() {
        let (mut engine, session, now, mut out) = one_slot(4);
        // Rounds 0 and 1 complete; rank 1 holds both results and leaves; rank 0 lost
        // round 1's result.
        for round in 0..2u32 {
            engine.handle_datagram(now, &contribution(session, 0, round, round.wrapping_sub(1)), &mut out);
            engine.handle_datagram(now, &contribution(session, 1, round, round.wrapping_sub(1)), &mut out);
        }
        assert_eq!(engine.depart(session, 1), Ok(Departure::Lingers));
        // Rank 0's retransmission still gets the result back.
        let resent = engine.handle_datagram(now, &contribution(session, 0, 1, 0), &mut out);
        assert!(
            matches!(resent, Verdict::Send(Transmit { recipient: Recipient::Worker(0), .. })),
            "{resent:?}"
        );
        assert!(!engine.has_orphaned());
        // A new round would need rank 1: dropped, and the session named once.
        for _ in 0..2 {
            let verdict = engine.handle_datagram(now, &contribution(session, 0, 2, 1), &mut out);
            assert_eq!(verdict, Verdict::Dropped(DropReason::Departed(1)));
        }
        assert_eq!(engine.take_orphaned(), [(session, 1)]);
        assert!(!engine.has_orphaned());
        assert_eq!(engine.depart(session, 0), Ok(Departure::AllGone));
    }

    #[test]
    fn a_rank_that_leaves_while_a_round_waits_for_it_is_needed() {
        let (mut engine, session, now, mut out) = one_slot(4);
        engine.handle_datagram(now, &contribution(session, 0, 0, u32::MAX), &mut out);
        assert_eq!(engine.depart(session, 1), Ok(Departure::Needed));
        // Rank 0 has contributed to the open round: its leaving would not be.
        assert_eq!(engine.depart(session, 0), Ok(Departure::Lingers));
        assert_eq!(engine.depart(SessionId(99), 0), Err(SessionError::Unknown(99)));
        assert_eq!(engine.depart(session, 2), Err(SessionError::Rank { rank: 2, workers: 2 }));
    }

    /// A header-only probe asking for a round's result (`WANT_RESULT`).
    fn probe(session: SessionId, rank: u16, round: u32) -> Vec<u8> {
        let repr = PacketRepr {
            rank,
            round,
            ack_round: round.wrapping_sub(1),
            flags: Flags::WANT_RESULT,
            ..PacketRepr::new(MessageType::Ack, ElementType::Int32, session.0, 7, 0)
        };
        let mut buffer = vec![0; repr.buffer_len()];
        repr.emit(&mut buffer).unwrap();
        buffer
    }

    #[test]
    fn a_probe_for_a_round_a_departed_rank_must_complete_orphans_the_session() {
        // Rank 1 sends block 0 of its sparse stream, saying block 5 comes next, and
        // stops mid-job: no round waits for it yet, so its leaving lingers.
        let (mut engine, session, now, mut out) = one_slot(4);
        engine.handle_datagram(now, &sparse(session, 1, 0, 0, 5), &mut out);
        assert_eq!(engine.depart(session, 1), Ok(Departure::Lingers));
        // Rank 0's block 0 completes the round, whose continuation (block 5) only
        // rank 1 has: rank 0 then waits for it, and its probe learns the session is over.
        let completed = engine.handle_datagram(now, &sparse(session, 0, 0, 0, END_OF_STREAM), &mut out);
        assert!(matches!(completed, Verdict::Send(_)), "{completed:?}");
        assert!(!engine.has_orphaned());
        let probed = engine.handle_datagram(now, &probe(session, 0, 1), &mut out);
        assert_eq!(probed, Verdict::Dropped(DropReason::Departed(1)));
        assert_eq!(engine.take_orphaned(), [(session, 1)]);
    }

    /// A sparse contribution to `block` of slot 0, whose stream goes on at `next`.
    fn sparse(session: SessionId, rank: u16, round: u32, block: u32, next: u32) -> Vec<u8> {
        let repr = PacketRepr {
            rank,
            round,
            ack_round: round.wrapping_sub(1),
            flags: Flags::SPARSE,
            block,
            next_block: next,
            ..PacketRepr::new(MessageType::Data, ElementType::Int32, session.0, 7, 1)
        };
        let mut buffer = vec![0; repr.buffer_len()];
        repr.emit(&mut buffer).unwrap();
        buffer
    }

    #[test]
    fn a_sparse_continuation_needs_only_the_ranks_whose_streams_have_its_block() {
        // Rank 0's stream ends after block 0; rank 1's goes on at block 5, so the next
        // round of the slot is a continuation only rank 1 contributes to.
        let (mut engine, session, now, mut out) = one_slot(4);
        engine.handle_datagram(now, &sparse(session, 0, 0, 0, END_OF_STREAM), &mut out);
        engine.handle_datagram(now, &sparse(session, 1, 0, 0, 5), &mut out);
        // Rank 0 may leave; rank 1 may not, though nothing of block 5 has arrived yet.
        assert_eq!(engine.depart(session, 1), Ok(Departure::Needed));
        assert_eq!(engine.depart(session, 0), Ok(Departure::Lingers));
        let completed = engine.handle_datagram(now, &sparse(session, 1, 1, 5, END_OF_STREAM), &mut out);
        assert!(matches!(completed, Verdict::Send(_)), "{completed:?}");
        assert!(!engine.has_orphaned());
        // The next start round needs rank 0: the session cannot go on.
        engine.handle_datagram(now, &sparse(session, 1, 2, 0, END_OF_STREAM), &mut out);
        assert_eq!(engine.take_orphaned(), [(session, 0)]);
    }
}
