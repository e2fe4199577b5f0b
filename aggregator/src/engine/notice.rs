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
//! The switch then tells the member at once: the result it may lack, if the round before
//! is retained and the member has not acknowledged it; otherwise a pending notice saying
//! its contribution is not in, which the member answers by sending it again. Each
//! member is judged once per round; a notice lost is left to the member's timers.
//! Rounds that open a job are not judged: workers send those in the order of their
//! slots, not of the previous job's results.
//!
//! The engine answers one packet per datagram ([`Verdict`]); these wait in a queue the
//! shell drains with [`Engine::poll_notice`] after each batch.
//!
//! [`Verdict`]: super::Verdict

use netagg_wire::{MessageType, PacketRepr};

use super::session::{Session, SessionId};
use super::{Engine, Recipient, Transmit, Verdict};

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
}

/// Rounds opened after another that a member's contribution may still precede that
/// one's: the allowance for paths that reorder, and for members whose threads share a
/// link and whose orders interleave.
const REORDER_ROUNDS: u64 = 8;

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

    /// Slot and round of the round opened as `number`, which the ring holds.
    fn round(&self, number: u64) -> (u16, u32) {
        self.opened[(number % self.opened.len() as u64) as usize]
    }
}

impl Engine {
    /// The next packet to a member whose packet the switch found lost, written into `out`
    /// (as [`Engine::handle_datagram`]'s results are): the result it may lack, or a
    /// pending notice that its contribution is not in. Call until `None` after each batch
    /// of datagrams. One whose member has contributed since, or whose session has
    /// closed, is skipped.
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
            let (slot, round) = self.order.round(passed);
            let state = &self.slots[slot as usize];
            // A round a job's first contribution opened is another job's start: not judged.
            let begun_in_job =
                state.open_set.is_some_and(|set| self.sets[self.set_index(slot, set as u32)].job == job);
            let current = state.open_round == round && state.opened == Some((passed, job)) && begun_in_job;
            if current && self.round_needs(slot, rank) {
                self.overtaken.push(Overtaken { slot, round, rank });
            }
        }
    }

    /// Writes what tells the member of `overtaken` of its loss, if it still lacks the
    /// round: the result of the round before, if retained and not acknowledged by it,
    /// or a pending notice.
    fn emit_notice(&mut self, overtaken: Overtaken, out: &mut [u8]) -> Option<Transmit> {
        let Overtaken { slot, round, rank } = overtaken;
        let state = &self.slots[slot as usize];
        if state.open_round != round || !self.round_needs(slot, rank) {
            return None;
        }
        let verdict = match self.retained_set(slot, round.wrapping_sub(1)) {
            Some(index) if self.sets[index].unacked.contains(rank) => {
                self.emit_result(index, slot, Recipient::Worker(rank), out)
            }
            _ => {
                let set = &self.sets[self.set_index(slot, state.open_set? as u32)];
                let notice = PacketRepr {
                    job: set.job,
                    rank,
                    slot,
                    round,
                    ..PacketRepr::new(MessageType::Pending, set.element_type, self.id.0, self.token, 0)
                };
                self.emit_pending(&notice, out)
            }
        };
        match verdict {
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

    use super::super::{EngineLimits, SessionSpec};
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
    fn a_member_passing_a_round_it_lacks_by_more_than_the_allowance_gets_its_result_once() {
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
        // Slot 9's was sent nine rounds after: rank 1 lost its packet of slot 0. It has
        // not acknowledged round 0 there, so it gets that result, which it may lack.
        engine.handle_datagram(now, &contribution(session, 1, 1, 9, 1), &mut out);
        let told = engine.poll_notice(&mut out).expect("rank 1 is told");
        assert_eq!(read(told, &out), (Recipient::Worker(1), MessageType::Result, 0, 0, Flags::NONE));
        assert_eq!(engine.poll_notice(&mut out), None);
        // Judged once: its later contributions say nothing more of slot 0.
        for slot in 10..SLOTS {
            engine.handle_datagram(now, &contribution(session, 1, 1, slot, 1), &mut out);
        }
        assert_eq!(engine.poll_notice(&mut out), None);
        assert_eq!(engine.session(session).unwrap().1.notices, 1);
    }

    #[test]
    fn a_member_that_acknowledged_the_round_before_is_told_its_contribution_is_not_in() {
        let (mut engine, session, now, mut out) = after_round_zero();
        for slot in 0..SLOTS {
            engine.handle_datagram(now, &contribution(session, 1, 0, slot, 1), &mut out);
        }
        // Rank 1 acknowledges round 0 of slot 0 on its own: its contribution is what was
        // lost, and the switch says so.
        let ack = PacketRepr {
            job: 1,
            rank: 1,
            ack_round: 0,
            round: 1,
            ..PacketRepr::new(MessageType::Ack, ElementType::Int32, session.0, 7, 0)
        };
        let mut packet = vec![0; ack.buffer_len()];
        ack.emit(&mut packet).unwrap().seal();
        assert_eq!(engine.handle_datagram(now, &packet, &mut out), Verdict::Consumed);
        for slot in 1..=9 {
            engine.handle_datagram(now, &contribution(session, 1, 1, slot, 1), &mut out);
        }
        let told = engine.poll_notice(&mut out).expect("rank 1 is told");
        assert_eq!(read(told, &out), (Recipient::Worker(1), MessageType::Pending, 0, 1, Flags::NONE));
        assert_eq!(engine.poll_notice(&mut out), None);
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
