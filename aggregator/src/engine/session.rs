//! One session: its shape, its counters, and the checks every datagram naming it passes
//! before it reaches a slot.

use std::collections::VecDeque;
use std::time::Instant;

use netagg_wire::packet::{datagram_len, progress_slots, ELEMENT_LEN};
use netagg_wire::{ElementType, Flags, Integrity, MessageType, PacketRepr};

use super::answer::PendingNotice;
use super::first_sendings::SendingGaps;
use super::sequence::BroadcastNumbers;
use super::slot::{Set, Slot, Summand};
use super::uplink::Uplink;
use super::{DropReason, Verdict};
use crate::sum::InstructionSet;
use crate::workers::WorkerSet;

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
        let set = core::mem::size_of::<Set>() + 2 * bitmap + self.sum_len();
        // A slot's bitmaps: the workers expected, and those refused a set; and, since a
        // worker runs at most a thread per slot, at most one numbering of a worker
        // thread's first sendings per worker.
        let slot = core::mem::size_of::<Slot>()
            + 2 * bitmap
            + self.workers as usize * (4 + SendingGaps::MEMBER_THREAD_BYTES);
        self.slots as usize * (slot + self.depth as usize * set)
    }

    /// Bytes of one set's sum: a float32 for each element of the session's longest packet,
    /// a 16-bit one's, which carries twice `packet_elements`.
    pub(super) fn sum_len(&self) -> usize {
        ElementType::Float16.per_packet(self.packet_elements) as usize * ELEMENT_LEN
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
    #[error("session id {id:#010x} is taken: session {open:#010x} is open at its index")]
    Taken { id: u32, open: u32 },
}

/// Handle of an open session; also the `session` field of its packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u32);

impl SessionId {
    pub(super) fn index(self) -> usize {
        (self.0 & 0xFFFF) as usize
    }

    pub(super) fn generation(self) -> u16 {
        (self.0 >> 16) as u16
    }
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
        /// Pending notices telling a worker that a contribution it sent, found by the gap
        /// in its numbers, never came.
        pub lost_notices: u64,
        /// Notices of lost contributions not sent: their packet had another answer, and
        /// the queue that holds such notices for `Engine::poll_notice` was full (a shell
        /// that does not poll), so the member finds the loss by its own timers.
        pub lost_notices_dropped: u64,
        /// Packets that break the protocol (wrong rank, slot, round, size or fields).
        pub rejected: u64,
        /// Packets naming the session without its token, or from an address other than
        /// their rank's: forged or misdirected, and never let near the sums.
        pub forged: u64,
    }
}

#[derive(Debug)]
pub(super) struct Session {
    pub(super) id: SessionId,
    pub(super) spec: SessionSpec,
    pub(super) token: u64,
    pub(super) last_activity: Instant,
    pub(super) counters: SessionCounters,
    pub(super) slots: Vec<Slot>,
    /// `slots × depth` sets; slot `s` owns `s * depth .. (s + 1) * depth`.
    pub(super) sets: Vec<Set>,
    /// The sets' payloads, `payload_len` bytes each in the order of `sets`: one
    /// allocation, whose pages a set touches only once a round uses it.
    pub(super) payloads: Box<[u8]>,
    pub(super) payload_len: usize,
    /// Ranks that left after their last job ([`Engine::depart`]).
    ///
    /// [`Engine::depart`]: super::Engine::depart
    pub(super) departed: WorkerSet,
    /// The rank in the whole tree of this session's worker 0, for a lower switch's group
    /// of workers ([`Upstream::first_rank`]); 0 for a session of its own.
    ///
    /// [`Upstream::first_rank`]: super::Upstream::first_rank
    pub(super) rank_base: u16,
    /// The upper switch this session's rounds complete at, for a lower switch.
    pub(super) uplink: Option<Box<Uplink>>,
    /// Whether its answers are sealed: its engine's [`Integrity`].
    pub(super) integrity: Integrity,
    /// The sum kernels' vectors, chosen once rather than looked up per contribution.
    pub(super) instruction_set: InstructionSet,
    /// The numbers of the broadcasts to each worker thread.
    pub(super) broadcasts: BroadcastNumbers,
    /// What each worker thread's numbers of its first sendings show lost.
    pub(super) sendings: SendingGaps,
    /// Notices of lost contributions whose packets completed a round, which the shell
    /// sends after the round's result ([`Engine::poll_notice`]).
    ///
    /// [`Engine::poll_notice`]: super::Engine::poll_notice
    pub(super) lost_notices: VecDeque<PendingNotice>,
}

impl Session {
    pub(super) fn new(
        id: SessionId,
        spec: SessionSpec,
        token: u64,
        now: Instant,
        integrity: Integrity,
    ) -> Session {
        let slots = (0..spec.slots).map(|_| Slot::new(spec.workers)).collect();
        let payload_len = spec.sum_len();
        let set_count = spec.slots as usize * spec.depth as usize;
        let sets = (0..set_count).map(|_| Set::new(spec.workers)).collect();
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
            rank_base: 0,
            uplink: None,
            integrity,
            instruction_set: InstructionSet::best(),
            broadcasts: BroadcastNumbers::new(spec.slots),
            sendings: SendingGaps::new(spec.workers, 1),
            lost_notices: VecDeque::new(),
        }
    }

    pub(super) fn handle(
        &mut self,
        now: Instant,
        repr: &PacketRepr,
        payload: impl Summand,
        out: &mut [u8],
        from_its_rank: impl FnOnce(SessionId, u16, u16) -> bool,
    ) -> Verdict {
        self.counters.packets_in += 1;
        // Before anything else: a forged packet must not even keep the session alive.
        if repr.token != self.token {
            self.counters.forged += 1;
            return Verdict::Dropped(DropReason::WrongToken);
        }
        if out.len() < datagram_len(self.spec.packet_elements as usize) {
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
            MessageType::Result | MessageType::Pending | MessageType::Progress => {
                self.reject(DropReason::NotForSwitch)
            }
            MessageType::Ack => {
                self.apply_ack(repr.slot, repr.rank, repr.ack_round);
                if !repr.flags.contains(Flags::WANT_RESULT) {
                    // A silent worker's acknowledgement may free the set a stalled round
                    // waits for.
                    return self
                        .announce_room(repr.slot, repr.element_type, out)
                        .unwrap_or(Verdict::Consumed);
                }
                if repr.round == self.slots[repr.slot as usize].open_round {
                    if let Some(rank) = self.departed_awaited(repr.slot) {
                        return self.reject(DropReason::Departed(rank));
                    }
                }
                self.resend_result(repr, false, out)
            }
            MessageType::Probe => {
                self.apply_ack(repr.slot, repr.rank, repr.ack_round);
                let reported = repr.slot
                    ..(repr.slot as usize + progress_slots(self.spec.packet_elements))
                        .min(self.spec.slots as usize) as u16;
                if let Some(rank) = reported.clone().find_map(|slot| self.departed_awaited(slot)) {
                    return self.reject(DropReason::Departed(rank));
                }
                self.emit_progress(reported, repr, out)
            }
            MessageType::Data => {
                self.apply_ack(repr.slot, repr.rank, repr.ack_round);
                let lost = if repr.flags.contains(Flags::RETRANSMISSION) {
                    None
                } else {
                    self.sendings.take(repr.rank, self.broadcasts.thread(repr.slot), repr.sequence)
                };
                let verdict = self.contribute(now, repr, payload, out);
                match lost {
                    Some(sequence) => self.tell_lost(repr, sequence, verdict, out),
                    None => verdict,
                }
            }
        }
    }

    pub(super) fn reject(&mut self, reason: DropReason) -> Verdict {
        self.counters.rejected += 1;
        Verdict::Dropped(reason)
    }
}
