//! Losses the switch sees first: a member's contribution that arrives after one it sent
//! later.
//!
//! Every worker sends a job's contributions in the order their slots' previous results
//! reached it, which is the order the switch sent those results in: the same order for
//! every member. So when a member's contribution to a round arrives while a round that
//! became open well before it still lacks that member, the member's packet for the
//! earlier round was lost on a path that keeps order: its contribution, or the result
//! that would have released it. The switch knows a packet time after the loss; the
//! member would find out only from its own round trips, tens of ms on a worker whose
//! round trips include waiting for its peers, and its peers wait for it meanwhile.
//!
//! The switch then tells the member at once, with the pending notice it would have had
//! for asking: the round is open and its contribution is not in. A member awaiting that
//! round's contribution sends it again; one still awaiting the result of the round
//! before lost that result, and asks for it. The notice is a header, so that a loss the
//! switch misjudges costs little on the way down. Each member is judged once per round,
//! told only of isolated losses (none among the next rounds), at most once per 32 rounds
//! opened; a burst, or a notice lost, is left to its timers.
//!
//! Not merged: behind queues of one to three packets (`tests/collapse.rs`) these
//! notices still take dense jobs past the test's bounds (12.6 times the link's time in
//! the third job where 12 is allowed, and 47-63 without the isolation and spacing
//! rules); see benches/RESULTS.md, "The switch tells a member of its loss".
//! Rounds that open a job are not judged: workers send those in the order of their
//! slots, not of the previous job's results.
//!
//! The engine answers one packet per datagram ([`Verdict`]); these wait in a queue the
//! shell drains with [`Engine::poll_notice`] after each batch.
//!
//! [`Verdict`]: super::Verdict

use netagg_wire::{MessageType, PacketRepr};

use super::session::{Session, SessionId};
use super::{Engine, Transmit, Verdict};

/// The order in which a session's rounds became open (the round before completed), and
/// how far along it each member's contributions have been judged.
#[derive(Debug)]
pub(super) struct OpeningOrder {
    /// Slot and round of each round opened, by its number modulo the ring's length.
    opened: Box<[(u16, u32)]>,
    /// Rounds opened so far: the number the next one gets.
    count: u64,
    /// Per member, the number of the first opened round not yet judged for it.
    judged: Box<[u64]>,
    /// Per member, the number of the latest round it was told it lacks.
    told: Box<[Option<u64>]>,
}

/// Rounds opened after another that a member's contribution may still precede that
/// one's: the allowance for paths that reorder, and for members whose threads share a
/// link and whose orders interleave.
const REORDER_ROUNDS: u64 = 8;

/// Rounds opened between two notices to one member at least. Random losses of a few in
/// a hundred are told one by one; a burst of them, from a queue that overflows, is told
/// only its first, and the rest left to the member's timers, which back off: notices for
/// every packet of a burst would have it resend the burst at once, into the queue that
/// just dropped it.
const NOTICE_SPACING: u64 = 32;

/// Notices an engine holds for its shell at most; past it, a member is left to its own
/// timers. A shell drains them after every batch, so only one that never does reaches
/// it (the dummy backend's sessions of one worker never queue any).
const MAX_QUEUED_NOTICES: usize = 4096;

/// A member's packet for `round` of `slot` found lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Overtaken {
    slot: u16,
    round: u32,
    rank: u16,
}

impl OpeningOrder {
    /// The order of a session of `workers` and `slots`, remembering the rounds opened
    /// over about two windows.
    pub(super) fn new(workers: u16, slots: u16) -> OpeningOrder {
        OpeningOrder {
            opened: vec![(0, 0); Self::ring_len(slots)].into_boxed_slice(),
            count: 0,
            judged: vec![0; workers as usize].into_boxed_slice(),
            told: vec![None; workers as usize].into_boxed_slice(),
        }
    }

    fn ring_len(slots: u16) -> usize {
        2 * slots as usize + REORDER_ROUNDS as usize
    }

    /// Bytes of the order of a session of `workers` and `slots`, beyond its own size.
    pub(super) fn heap_bytes(workers: u16, slots: u16) -> usize {
        Self::ring_len(slots) * std::mem::size_of::<(u16, u32)>()
            + workers as usize * std::mem::size_of::<u64>()
    }

    /// Records that round `round` of `slot` opened; returns its number.
    pub(super) fn open(&mut self, slot: u16, round: u32) -> u64 {
        let number = self.count;
        let len = self.opened.len() as u64;
        self.opened[(number % len) as usize] = (slot, round);
        self.count += 1;
        number
    }

    /// The numbers of the rounds opened more than the allowance before `number` that
    /// `rank` has not been judged for, taken as judged now: each once, and one the ring
    /// no longer holds never.
    fn judge(&mut self, rank: u16, number: u64) -> std::ops::Range<u64> {
        let oldest = self.count.saturating_sub(self.opened.len() as u64);
        let judged = &mut self.judged[rank as usize];
        let from = (*judged).max(oldest);
        let to = number.saturating_sub(REORDER_ROUNDS).max(from);
        *judged = to;
        from..to
    }

    /// Whether `rank` may be told it lacks the round opened as `number`, and if so takes
    /// it as told: at most once per [`NOTICE_SPACING`] rounds opened.
    fn may_tell(&mut self, rank: u16, number: u64) -> bool {
        let told = &mut self.told[rank as usize];
        let spaced = told.is_none_or(|last| number >= last + NOTICE_SPACING);
        if spaced {
            *told = Some(number);
        }
        spaced
    }

    /// Slot and round of the round opened as `number`, which the ring holds.
    fn round(&self, number: u64) -> (u16, u32) {
        self.opened[(number % self.opened.len() as u64) as usize]
    }
}

impl Engine {
    /// The next pending notice to a member whose packet the switch found lost, written
    /// into `out` (as [`Engine::handle_datagram`]'s results are). Call until `None` after
    /// each batch of datagrams. One whose member has contributed since, or whose session
    /// has closed, is skipped.
    pub fn poll_notice(&mut self, out: &mut [u8]) -> Option<Transmit> {
        while let Some((id, overtaken)) = self.notices.pop() {
            let Some(session) = self.session_mut(id) else { continue };
            if let Some(transmit) = session.emit_notice(overtaken, out) {
                session.counters.notices += 1;
                return Some(transmit);
            }
        }
        None
    }

    /// Takes the notices session `id` queued while it handled a datagram.
    pub(super) fn take_notices(&mut self, id: SessionId) {
        let Some(session) = self.session_mut(id) else { return };
        let found = std::mem::take(&mut session.overtaken);
        let room = MAX_QUEUED_NOTICES.saturating_sub(self.notices.len());
        self.notices.extend(found.iter().take(room).map(|&overtaken| (id, overtaken)));
        // The buffer goes back, so that finding a loss allocates nothing once warm.
        let session = self.session_mut(id).expect("the session was just found");
        session.overtaken = found;
        session.overtaken.clear();
    }
}

impl Session {
    /// Takes `rank`'s contribution to a round of job `job` opened as `number` as passing
    /// every round of the job opened well before it: each still lacking `rank`'s
    /// contribution is queued.
    pub(super) fn judge_overtaken(&mut self, rank: u16, job: u32, number: u64) {
        for passed in self.order.judge(rank, number) {
            if !self.lacks(rank, job, passed) {
                continue;
            }
            // A loss among the rounds after it too is a burst, from a queue that
            // overflowed: left to the member's timers, which back off.
            let isolated = (passed + 1..=passed + REORDER_ROUNDS).all(|next| !self.lacks(rank, job, next));
            if isolated && self.order.may_tell(rank, passed) {
                let (slot, round) = self.order.round(passed);
                self.overtaken.push(Overtaken { slot, round, rank });
            }
        }
    }

    /// Whether the round of job `job` opened as `number` is still open and lacks `rank`'s
    /// contribution.
    fn lacks(&self, rank: u16, job: u32, number: u64) -> bool {
        let (slot, round) = self.order.round(number);
        let state = &self.slots[slot as usize];
        // A round a job's first contribution opened is another job's start: not judged.
        let begun_in_job =
            state.open_set.is_some_and(|set| self.sets[self.set_index(slot, set as u32)].job == job);
        state.open_round == round
            && state.opened == Some((number, job))
            && begun_in_job
            && self.round_needs(slot, rank)
    }

    /// Writes the pending notice telling the member of `overtaken` that its contribution
    /// is not in, if it still lacks the round.
    fn emit_notice(&mut self, overtaken: Overtaken, out: &mut [u8]) -> Option<Transmit> {
        let Overtaken { slot, round, rank } = overtaken;
        let state = &self.slots[slot as usize];
        if state.open_round != round || !self.round_needs(slot, rank) {
            return None;
        }
        let set = &self.sets[self.set_index(slot, state.open_set? as u32)];
        let notice = PacketRepr {
            job: set.job,
            rank,
            slot,
            round,
            ..PacketRepr::new(MessageType::Pending, set.element_type, self.id.0, self.token, 0)
        };
        match self.emit_pending(&notice, out) {
            Verdict::Send(transmit) => Some(transmit),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use netagg_wire::packet::{datagram_len, MAX_ELEMENTS};
    use netagg_wire::{ElementType, Flags, Packet};

    use super::super::{EngineLimits, Recipient, SessionSpec};
    use super::*;

    const SLOTS: u16 = 12;

    /// A dense contribution of `rank` to `round` of `slot` in job `job`, acknowledging the
    /// round before.
    fn contribution(session: SessionId, job: u32, rank: u16, slot: u16, round: u32) -> Vec<u8> {
        let repr = PacketRepr {
            job,
            rank,
            slot,
            round,
            ack_round: round.wrapping_sub(1),
            ..PacketRepr::new(MessageType::Data, ElementType::Int32, session.0, 7, 1)
        };
        let mut buffer = vec![0; repr.buffer_len()];
        let mut packet = repr.emit(&mut buffer).unwrap();
        packet.payload_mut().copy_from_slice(&(slot as i32).to_le_bytes());
        packet.seal();
        buffer
    }

    /// A session of 2 workers and 12 slots whose round 0 both have completed, in the
    /// order of the slots: round 1 of slot `s` opened as number `s`.
    fn after_round_zero() -> (Engine, SessionId, Instant, Vec<u8>) {
        let mut engine = Engine::new(EngineLimits::default());
        let now = Instant::now();
        let spec = SessionSpec { workers: 2, slots: SLOTS, packet_elements: 4, depth: 2 };
        let session = engine.open_session(now, spec, 7).unwrap();
        let mut out = vec![0; datagram_len(MAX_ELEMENTS)];
        for slot in 0..SLOTS {
            for rank in 0..2 {
                engine.handle_datagram(now, &contribution(session, 1, rank, slot, 0), &mut out);
            }
        }
        (engine, session, now, out)
    }

    /// What `transmit` tells whom: its recipient, type, slot, round and flags.
    fn read(transmit: Transmit, out: &[u8]) -> (Recipient, MessageType, u16, u32, Flags) {
        let packet = Packet::new_checked(&out[..transmit.len]).unwrap();
        (transmit.recipient, packet.message_type(), packet.slot(), packet.round(), packet.flags())
    }

    #[test]
    fn a_member_passing_a_round_it_lacks_by_more_than_the_allowance_is_told_once() {
        let (mut engine, session, now, mut out) = after_round_zero();
        // Rank 1's round 1 of slot 0 is lost (or round 0's result on its way to rank 1):
        // its round 1 of slots 1-8 passes it by no more than the allowance.
        for slot in 0..SLOTS {
            engine.handle_datagram(now, &contribution(session, 1, 0, slot, 1), &mut out);
        }
        for slot in 1..=8 {
            engine.handle_datagram(now, &contribution(session, 1, 1, slot, 1), &mut out);
            assert_eq!(engine.poll_notice(&mut out), None, "slot {slot}");
        }
        // Slot 9's was sent nine rounds after: rank 1 lost its packet of slot 0, and is
        // told that its contribution is not in.
        engine.handle_datagram(now, &contribution(session, 1, 1, 9, 1), &mut out);
        let told = engine.poll_notice(&mut out).expect("rank 1 is told");
        assert_eq!(read(told, &out), (Recipient::Worker(1), MessageType::Pending, 0, 1, Flags::NONE));
        assert_eq!(engine.poll_notice(&mut out), None);
        // Judged once: its later contributions say nothing more of slot 0.
        for slot in 10..SLOTS {
            engine.handle_datagram(now, &contribution(session, 1, 1, slot, 1), &mut out);
        }
        assert_eq!(engine.poll_notice(&mut out), None);
        assert_eq!(engine.session(session).unwrap().1.notices, 1);
    }

    #[test]
    fn nothing_is_sent_for_a_round_the_member_completed_before_the_shell_polled() {
        let (mut engine, session, now, mut out) = after_round_zero();
        for slot in 0..SLOTS {
            engine.handle_datagram(now, &contribution(session, 1, 0, slot, 1), &mut out);
        }
        for slot in 1..=9 {
            engine.handle_datagram(now, &contribution(session, 1, 1, slot, 1), &mut out);
        }
        // Reordered on its way, not lost: rank 1's round 1 of slot 0 arrives in the same
        // batch.
        let completed = engine.handle_datagram(now, &contribution(session, 1, 1, 0, 1), &mut out);
        assert!(matches!(completed, Verdict::Send(Transmit { recipient: Recipient::All, .. })));
        assert_eq!(engine.poll_notice(&mut out), None);
        assert_eq!(engine.session(session).unwrap().1.notices, 0);
    }

    #[test]
    fn rounds_that_open_a_job_are_not_judged() {
        let (mut engine, session, now, mut out) = after_round_zero();
        // Round 1 starts job 2 (its round 0 was of job 1): every worker sends a job's
        // first rounds in the order of its slots, not of the last job's results.
        for slot in 0..SLOTS {
            engine.handle_datagram(now, &contribution(session, 2, 0, slot, 1), &mut out);
        }
        for slot in 1..SLOTS {
            engine.handle_datagram(now, &contribution(session, 2, 1, slot, 1), &mut out);
        }
        assert_eq!(engine.poll_notice(&mut out), None);
    }
}
