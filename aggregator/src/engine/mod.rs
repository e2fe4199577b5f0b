//! The aggregation engine: sessions of slots that sum the workers' packets, without I/O.
//!
//! A datagram and the current time go in ([`Engine::handle_datagram`]); a [`Verdict`]
//! comes out, naming the packet to send (written into a buffer the caller lends) and its
//! recipients. Idle sessions expire through [`Engine::poll_timeout`] and
//! [`Engine::handle_timeout`]. `docs/protocol.md` explains the protocol this implements.
//!
//! The engine's table of sessions and its public surface are here; the rest each have a
//! module:
//! - `session`: one session's shape, counters and checks of every datagram it receives.
//! - `slot`: slots, their rounds, and the sets that aggregate and retain them.
//! - `stream`: which workers a slot's next round expects, dense or sparse.
//! - `answer`: results and pending notices, written into the caller's buffer.
//! - `sequence`: the numbers of each worker thread's broadcast results.
//! - `first_sendings`: lost contributions found by the workers' numbering of their first
//!   sendings, and the notices that tell their members.
//! - `departures`: ranks that leave a session, and the rounds that then cannot complete.
//! - `uplink`: a session of a lower switch in an aggregation tree, whose rounds complete
//!   at the upper switch it takes part in as one member.

use std::time::{Duration, Instant};

use netagg_wire::packet::MAX_ELEMENTS;
use netagg_wire::{Integrity, PacketRepr, WireError};

mod answer;
mod departures;
mod first_sendings;
mod sequence;
mod session;
mod slot;
mod stream;
#[cfg(test)]
mod testing;
mod uplink;

pub use departures::Departure;
pub use session::{SessionCounters, SessionError, SessionId, SessionSpec};
pub use slot::Summand;
pub use uplink::{UplinkCounters, Upstream, UPSTREAM_RANK};

use first_sendings::SendingGaps;
use session::Session;

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
    /// The upper switch of a lower switch's session ([`Engine::attach_upstream`]).
    Upstream,
}

/// Why a datagram was dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DropReason {
    #[error("malformed packet: {0}")]
    Malformed(WireError),
    /// The checksum did not match ([`WireError::Checksum`], which says so).
    #[error("{0}")]
    Corrupt(WireError),
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

counters! {
    /// Counters of the whole engine.
    pub struct EngineCounters {
        pub datagrams: u64,
        /// Datagrams whose checksum did not match their bytes: corrupted on their way,
        /// dropped before any field was believed, and left to the workers' loss recovery.
        pub corrupt: u64,
        /// Datagrams that break the packet format (a peer of another version, say).
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
    /// Open sessions with an upper switch: while there are none, packets from a switch
    /// are refused as they always were, at one predictable check.
    uplinked: usize,
    /// What closed sessions exchanged with their upper switches.
    closed_uplinks: UplinkCounters,
    /// Whether datagrams' checksums are checked and answers sealed.
    integrity: Integrity,
    /// Some session may hold a notice for [`Engine::poll_notice`].
    notices_waiting: bool,
}

impl Engine {
    /// An engine behind a network: every datagram's checksum checked, every answer sealed.
    pub fn new(limits: EngineLimits) -> Engine {
        Engine::with_integrity(limits, Integrity::Checksummed)
    }

    /// An engine whose datagrams are checked and answers sealed only as `integrity` says:
    /// [`Integrity::InProcess`] for one that shares its workers' memory (the dummy
    /// backend's), where nothing could alter a byte on the way.
    pub fn with_integrity(limits: EngineLimits, integrity: Integrity) -> Engine {
        Engine {
            integrity,
            limits,
            sessions: Vec::new(),
            generations: Vec::new(),
            bytes_in_use: 0,
            counters: EngineCounters::default(),
            orphaned: Vec::new(),
            uplinked: 0,
            closed_uplinks: UplinkCounters::default(),
            notices_waiting: false,
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
        self.check_room(&spec)?;
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
        let id = SessionId((generation as u32) << 16 | index as u32);
        self.place(now, id, spec, token);
        Ok(id)
    }

    /// [`Engine::open_session`] under an id another engine chose: for a switch whose
    /// data-path threads each hold the same sessions, every thread's engine summing its
    /// share of the slots, so that a packet's session id is valid in all of them.
    pub fn open_session_as(
        &mut self,
        now: Instant,
        id: SessionId,
        spec: SessionSpec,
        token: u64,
    ) -> Result<SessionId, SessionError> {
        if let Some(Some(open)) = self.sessions.get(id.index()) {
            return Err(SessionError::Taken { id: id.0, open: open.id.0 });
        }
        self.check_room(&spec)?;
        if self.sessions.len() <= id.index() {
            self.sessions.resize_with(id.index() + 1, || None);
            self.generations.resize(id.index() + 1, 0);
        }
        self.place(now, id, spec, token);
        Ok(id)
    }

    /// Checks a session of `spec` against every limit.
    fn check_room(&self, spec: &SessionSpec) -> Result<(), SessionError> {
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
        Ok(())
    }

    /// Puts a session checked by [`Engine::check_room`] at its id's free index.
    fn place(&mut self, now: Instant, id: SessionId, spec: SessionSpec, token: u64) {
        self.generations[id.index()] = id.generation();
        self.sessions[id.index()] = Some(Session::new(id, spec, token, now, self.integrity));
        self.bytes_in_use += spec.state_bytes();
        self.counters.sessions_opened += 1;
    }

    /// Closes a session, freeing its slots; returns its final counters.
    pub fn close_session(&mut self, id: SessionId) -> Result<SessionCounters, SessionError> {
        let session = self.take_session(id).ok_or(SessionError::Unknown(id.0))?;
        self.counters.sessions_closed += 1;
        Ok(session.counters)
    }

    fn take_session(&mut self, id: SessionId) -> Option<Session> {
        let entry = self.sessions.get_mut(id.index())?;
        if entry.as_ref().is_none_or(|s| s.id != id) {
            return None;
        }
        let session = entry.take()?;
        self.bytes_in_use -= session.spec.state_bytes();
        if let Some(uplink) = &session.uplink {
            self.uplinked -= 1;
            self.closed_uplinks = self.closed_uplinks + uplink.counters();
        }
        Some(session)
    }

    #[inline]
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

    /// When an open session last received a packet that passed its token, rank, slot
    /// and source checks.
    pub fn last_activity(&self, id: SessionId) -> Option<Instant> {
        Some(self.sessions.get(id.index())?.as_ref().filter(|s| s.id == id)?.last_activity)
    }

    /// Counts `at` as activity of session `id`, if it is later than the session's own:
    /// for a switch whose threads each hold a share of a session's slots, so that a
    /// session busy on one thread does not expire on another.
    pub fn note_activity(&mut self, id: SessionId, at: Instant) {
        if let Some(session) = self.session_mut(id) {
            session.last_activity = session.last_activity.max(at);
        }
    }

    /// Numbers session `id`'s broadcast results in one sequence per worker thread of
    /// `slots_per_thread` slots, as its workers registered them, and takes each rank's
    /// threads' numbering of their first sendings the same way: each thread sees only its
    /// slots' results, and numbers only its own sendings, so a count over all of them
    /// would show gaps that are not losses. Until told, a session takes one thread a rank.
    pub fn number_per_thread(&mut self, id: SessionId, slots_per_thread: u16) {
        if let Some(session) = self.session_mut(id) {
            session.broadcasts.split(session.spec.slots, slots_per_thread);
            session.sendings = SendingGaps::new(session.spec.workers, session.broadcasts.threads());
        }
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
        let packet = match self.integrity.check(datagram) {
            Ok(packet) => packet,
            Err(error @ WireError::Checksum { .. }) => {
                self.counters.corrupt += 1;
                return Verdict::Dropped(DropReason::Corrupt(error));
            }
            Err(error) => {
                self.counters.malformed += 1;
                return Verdict::Dropped(DropReason::Malformed(error));
            }
        };
        self.handle_repr(now, PacketRepr::parse(&packet), packet.payload(), out, from_its_rank)
    }

    /// [`Engine::handle_datagram`] for a worker's packet that needs no checks, given as its
    /// header and payload: one a caller in this process made from a datagram that passed
    /// them ([`netagg_wire::Packet::new_checked`]). It is neither parsed again nor its
    /// checksum read, and its payload may be the caller's own [`Summand`]: the dummy
    /// backend's writes the n-fold sum of a worker's payload straight into the round's
    /// sum, rather than into a packet the engine then copies. A packet from an upper
    /// switch goes to [`Engine::handle_datagram`].
    ///
    /// # Panics
    /// If `payload` holds fewer elements than `repr` says, as a packet's accessors would.
    pub fn handle_parsed(
        &mut self,
        now: Instant,
        repr: PacketRepr,
        payload: impl Summand,
        out: &mut [u8],
    ) -> Verdict {
        self.counters.datagrams += 1;
        self.handle_from_worker(now, repr, payload, out, |_, _, _| true)
    }

    fn handle_repr(
        &mut self,
        now: Instant,
        repr: PacketRepr,
        payload: &[u8],
        out: &mut [u8],
        from_its_rank: impl FnOnce(SessionId, u16, u16) -> bool,
    ) -> Verdict {
        if self.uplinked > 0 && uplink::is_from_switch(repr.message_type) {
            return self.handle_from_upstream(now, &repr, payload, out, from_its_rank);
        }
        self.handle_from_worker(now, repr, payload, out, from_its_rank)
    }

    fn handle_from_worker(
        &mut self,
        now: Instant,
        mut repr: PacketRepr,
        payload: impl Summand,
        out: &mut [u8],
        from_its_rank: impl FnOnce(SessionId, u16, u16) -> bool,
    ) -> Verdict {
        let Some(session) = self.session_mut(SessionId(repr.session)) else {
            self.counters.unknown_session += 1;
            return Verdict::Dropped(DropReason::UnknownSession);
        };
        // A lower switch's workers send their ranks in the whole tree; 0 elsewhere.
        repr.rank = repr.rank.wrapping_sub(session.rank_base);
        let verdict = session.handle(now, &repr, payload, out, from_its_rank);
        self.notices_waiting |= !session.lost_notices.is_empty();
        if let Verdict::Dropped(DropReason::Departed(rank)) = verdict {
            self.orphan(SessionId(repr.session), rank);
        }
        verdict
    }

    /// The next notice of a lost contribution that could not answer the packet showing the
    /// loss, because the engine answered or dropped that packet otherwise (it completed a
    /// round, was answered to its sender alone, or was refused; `docs/protocol.md` §3 rule
    /// 2), written into `out` as [`Engine::handle_datagram`]'s packets are; call until
    /// `None` after each batch of datagrams, after sending or batching their results. A
    /// notice `out` cannot hold waits for the next call.
    // Inlined, so that the shells' call after every batch (the dummy backend's after
    // every packet) costs a test of one flag while no notice waits.
    #[inline]
    pub fn poll_notice(&mut self, out: &mut [u8]) -> Option<Transmit> {
        if !self.notices_waiting {
            return None;
        }
        self.poll_waiting_notice(out)
    }

    /// [`Engine::poll_notice`] once some session may hold a notice.
    fn poll_waiting_notice(&mut self, out: &mut [u8]) -> Option<Transmit> {
        let transmit = self.sessions.iter_mut().flatten().find_map(|session| session.poll_notice(out));
        self.notices_waiting = self.sessions.iter().flatten().any(|session| !session.lost_notices.is_empty());
        transmit
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

#[cfg(test)]
mod tests {
    use netagg_wire::packet::HEADER_LEN;
    use netagg_wire::Packet;

    use super::testing::{contribution, one_slot};
    use super::*;

    #[test]
    fn a_corrupted_datagram_is_counted_and_changes_nothing_but_a_packet_made_here_skips_the_checksum() {
        let (mut engine, session, now, mut out) = one_slot(2);
        let mut corrupted = contribution(session, 0, 0, u32::MAX);
        corrupted[HEADER_LEN] ^= 0x08;
        let verdict = engine.handle_datagram(now, &corrupted, &mut out);
        assert!(
            matches!(verdict, Verdict::Dropped(DropReason::Corrupt(WireError::Checksum { .. }))),
            "{verdict:?}"
        );
        assert_eq!((engine.counters().corrupt, engine.counters().malformed), (1, 0));
        assert_eq!(engine.session(session).unwrap().1.packets_in, 0, "no session saw it");
        // The same bytes as a packet made in this process from a checked one: taken, its
        // checksum not read.
        let packet = Packet::new_unchecked(&corrupted[..]);
        let verdict = engine.handle_parsed(now, PacketRepr::parse(&packet), packet.payload(), &mut out);
        assert_eq!(verdict, Verdict::Consumed);
        assert_eq!(engine.session(session).unwrap().1.contributions, 1);
    }
}
