//! Slots, their rounds, and the sets that aggregate and retain them.
//!
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

use std::time::Instant;

use netagg_wire::packet::{ELEMENT_LEN, END_OF_STREAM};
use netagg_wire::{ElementType, Flags, PacketRepr};

use super::session::Session;
use super::{DropReason, Recipient, Verdict};
use crate::round::is_after;
use crate::sum::InstructionSet;
use crate::workers::WorkerSet;
use crate::{sum, sum16};

/// A contribution's payload as a round's sum takes it in: the bytes a packet carried, or
/// what a caller in this process makes of them ([`Engine::handle_parsed`]). Each
/// contribution either starts its round's sum or adds to it, once.
///
/// [`Engine::handle_parsed`]: super::Engine::handle_parsed
pub trait Summand {
    /// Writes the round's first contribution into `sum`, which holds a float32 for each of
    /// its elements of a 16-bit `element_type` and the elements themselves otherwise.
    fn start(self, instruction_set: InstructionSet, element_type: ElementType, sum: &mut [u8]);
    /// Adds the contribution to `sum`, which holds the round's contributions before it.
    fn add_to(self, instruction_set: InstructionSet, element_type: ElementType, sum: &mut [u8]);
}

impl Summand for &[u8] {
    #[inline]
    fn start(self, _: InstructionSet, element_type: ElementType, sum: &mut [u8]) {
        sum16::widen(element_type, sum, self);
    }

    #[inline]
    fn add_to(self, instruction_set: InstructionSet, element_type: ElementType, sum: &mut [u8]) {
        sum::add_assign_with(instruction_set, element_type, sum, self);
    }
}

#[derive(Debug)]
pub(super) struct Slot {
    /// The round now aggregating; every earlier round has completed.
    pub(super) open_round: u32,
    /// In a sparse stream, the block the open round aggregates; `None` for a start round,
    /// which every worker contributes to.
    pub(super) continuation: Option<u32>,
    /// Workers expected in a continuation round.
    pub(super) expected: WorkerSet,
    /// Each worker's latest *next block* in this slot's sparse stream.
    pub(super) next_blocks: Box<[u32]>,
    /// The set (of the slot's own, counted from 0) aggregating the open round, once its
    /// first contribution arrived.
    pub(super) open_set: Option<u8>,
    /// Bit `i`: the slot's set `i` holds a complete round's result that some worker has
    /// not acknowledged. Every other set but `open_set` is free.
    pub(super) retained: u64,
    /// Workers whose contribution to the open round was dropped for want of a free set
    /// (*stalled*): told when a set frees, so that they send it again then rather than at
    /// their timeout ([`Session::announce_room`]).
    pub(super) refused: WorkerSet,
    /// The job of the latest refused contribution: the notice of room names it, since the
    /// packet that frees the set (a slow worker's ack) may be of the job before.
    pub(super) refused_job: u32,
}

#[derive(Debug)]
pub(super) struct Set {
    /// The round the set aggregates or retains; meaningless while the set is free.
    pub(super) round: u32,
    pub(super) contributed: WorkerSet,
    /// Workers that may still need this set's result; the set is reused only when empty.
    pub(super) unacked: WorkerSet,
    pub(super) contributions: u16,
    /// What every contribution to the round must agree on; the first one sets it.
    pub(super) job: u32,
    pub(super) packet_id: u32,
    pub(super) block: u32,
    pub(super) element_type: ElementType,
    pub(super) sparse: bool,
    /// Elements of the sum; 0 until a contribution with a payload arrives.
    pub(super) element_count: u16,
    pub(super) exponent: i8,
    pub(super) next_block: u32,
    /// The rank whose contribution completed the round; `None` while it aggregates.
    pub(super) completed_by: Option<u16>,
}

impl Slot {
    /// A slot of a session of `workers`, whose round 0 is a start round.
    pub(super) fn new(workers: u16) -> Slot {
        Slot {
            open_round: 0,
            continuation: None,
            expected: WorkerSet::new(workers),
            next_blocks: vec![END_OF_STREAM; workers as usize].into_boxed_slice(),
            open_set: None,
            retained: 0,
            refused: WorkerSet::new(workers),
            refused_job: 0,
        }
    }
}

impl Set {
    /// A free set of a session of `workers`.
    pub(super) fn new(workers: u16) -> Set {
        Set {
            round: 0,
            contributed: WorkerSet::new(workers),
            unacked: WorkerSet::new(workers),
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
        }
    }

    /// Resets the set for a new round; the first contribution writes rather than adds.
    #[inline]
    pub(super) fn start(&mut self, repr: &PacketRepr) {
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
    pub(super) fn agrees_with(&self, repr: &PacketRepr) -> Result<(), &'static str> {
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

impl Session {
    /// The index in `sets` of the slot's own set `set`.
    pub(super) fn set_index(&self, slot: u16, set: u32) -> usize {
        slot as usize * self.spec.depth as usize + set as usize
    }

    /// Bit `i`: `slot`'s set `i` is neither retained nor beyond the session's depth. The
    /// open set, if any, is among them.
    pub(super) fn free_sets(&self, slot: u16) -> u64 {
        let depth_mask = u64::MAX >> (64 - self.spec.depth as u32);
        !self.slots[slot as usize].retained & depth_mask
    }

    /// The index in `sets` of the set retaining complete round `round` of `slot`.
    pub(super) fn retained_set(&self, slot: u16, round: u32) -> Option<usize> {
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

    /// Records that `rank` holds every result of `slot` up to round `ack` (the cross-clear),
    /// freeing the sets every worker now holds.
    pub(super) fn apply_ack(&mut self, slot: u16, rank: u16, ack: u32) {
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

    pub(super) fn contribute(
        &mut self,
        now: Instant,
        repr: &PacketRepr,
        payload: impl Summand,
        out: &mut [u8],
    ) -> Verdict {
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
                let free = self.free_sets(repr.slot);
                if free == 0 {
                    self.counters.stalled += 1;
                    let slot = &mut self.slots[slot_index];
                    slot.refused.insert(repr.rank);
                    slot.refused_job = repr.job;
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
            // Sums of 16-bit floats are held in float32: twice the payload's bytes.
            let sum_len = repr.element_count as usize * ELEMENT_LEN;
            let sum = &mut self.payloads[index * self.payload_len..][..sum_len];
            if set.element_count == 0 {
                set.element_count = repr.element_count;
                payload.start(self.instruction_set, set.element_type, sum);
            } else {
                payload.add_to(self.instruction_set, set.element_type, sum);
            }
        }
        self.counters.contributions += 1;

        let slot = &mut self.slots[slot_index];
        slot.refused.remove(repr.rank);
        if set.sparse {
            slot.next_blocks[repr.rank as usize] = repr.next_block;
        }
        if (set.contributions as usize) < slot.expected_contributions(self.spec.workers) {
            // The round has a set now: a worker refused earlier may send its contribution.
            return self.announce_room(repr.slot, repr.element_type, out).unwrap_or(Verdict::Consumed);
        }

        // The last expected contribution: the round completes, or at a lower switch its
        // group's share does, which goes up to the upper switch.
        set.completed_by = Some(repr.rank);
        if self.uplink.is_some() {
            return self.forward(now, repr.slot, false, out);
        }
        set.unacked.fill(self.spec.workers);
        slot.open_set = None;
        slot.retained |= 1 << own_set;
        slot.open_round = repr.round.wrapping_add(1);
        set.next_block = slot.schedule_next_round(set.sparse);
        self.counters.results_broadcast += 1;
        self.emit_result(index, repr.slot, Recipient::All, out)
    }

    /// Checks a contribution to the open round against the slot, before any state changes.
    #[inline]
    fn check_contribution(&self, repr: &PacketRepr) -> Result<(), DropReason> {
        if repr.element_count > repr.element_type.per_packet(self.spec.packet_elements) {
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
}

#[cfg(test)]
mod tests {
    use super::super::testing::{ask, contribution, one_slot, sets_in_use};
    use super::super::Transmit;

    use super::*;

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

    /// A pending notice of `verdict`: its recipient, rank field, job, round and flags.
    fn notice(verdict: Verdict, out: &[u8]) -> (Recipient, u16, u32, u32, Flags) {
        let Verdict::Send(transmit) = verdict else { panic!("expected a notice, got {verdict:?}") };
        let repr = PacketRepr::parse(&netagg_wire::Packet::new_checked(&out[..transmit.len]).unwrap());
        assert_eq!(repr.message_type, netagg_wire::MessageType::Pending);
        (transmit.recipient, repr.rank, repr.job, repr.round, repr.flags)
    }

    /// `datagram`, a worker's packet, of job `job`.
    fn of_job(datagram: &[u8], job: u32) -> Vec<u8> {
        let mut repr = PacketRepr::parse(&netagg_wire::Packet::new_checked(datagram).unwrap());
        repr.job = job;
        let mut bytes = datagram.to_vec();
        repr.emit(&mut bytes).unwrap().seal();
        bytes
    }

    #[test]
    fn a_worker_refused_a_set_is_told_of_its_job_when_an_acknowledgement_frees_one() {
        let (mut engine, session, now, mut out) = one_slot(2);
        // Rank 1 acknowledges nothing: rounds 0 and 1, job 0's, fill both sets, and rank
        // 0's contribution to round 2, job 1's, stalls.
        for round in 0..2u32 {
            engine.handle_datagram(now, &contribution(session, 0, round, round.wrapping_sub(1)), &mut out);
            engine.handle_datagram(now, &contribution(session, 1, round, u32::MAX), &mut out);
        }
        let refused = of_job(&contribution(session, 0, 2, 1), 1);
        assert_eq!(engine.handle_datagram(now, &refused, &mut out), Verdict::Dropped(DropReason::Stalled));
        // An acknowledgement that frees nothing tells no one.
        let mut ack =
            PacketRepr::parse(&netagg_wire::Packet::new_checked(&ask(session, 1, 0, false)[..]).unwrap());
        ack.flags = Flags::NONE;
        ack.ack_round = u32::MAX;
        let mut datagram = vec![0; ack.buffer_len()];
        ack.emit(&mut datagram).unwrap().seal();
        assert_eq!(engine.handle_datagram(now, &datagram, &mut out), Verdict::Consumed);
        // Rank 1, still taking job 0's results, acknowledges round 0: set 0 frees, and
        // rank 0 hears at once, of job 1, that its contribution to round 2 is not in.
        ack.ack_round = 0;
        ack.emit(&mut datagram).unwrap().seal();
        let verdict = engine.handle_datagram(now, &datagram, &mut out);
        assert_eq!(notice(verdict, &out), (Recipient::Worker(0), 0, 1, 2, Flags::NONE));
        // Told once: its contribution then takes the free set.
        assert_eq!(engine.handle_datagram(now, &datagram, &mut out), Verdict::Consumed);
        assert_eq!(engine.handle_datagram(now, &refused, &mut out), Verdict::Consumed);
        assert_eq!(sets_in_use(&mut engine, session), [1, 0]);
    }

    #[test]
    fn workers_refused_a_set_are_told_one_after_another() {
        let mut engine = crate::engine::Engine::new(crate::engine::EngineLimits::default());
        let now = Instant::now();
        let spec = crate::engine::SessionSpec { workers: 4, slots: 1, packet_elements: 4, depth: 2 };
        let session = engine.open_session(now, spec, 7).unwrap();
        let mut out = vec![0; netagg_wire::packet::datagram_len(netagg_wire::packet::MAX_ELEMENTS)];
        // Rank 3 acknowledges nothing, so round 2 has no set for ranks 0 and 1.
        for round in 0..2u32 {
            for rank in 0..4 {
                let ack = if rank == 3 { u32::MAX } else { round.wrapping_sub(1) };
                engine.handle_datagram(now, &contribution(session, rank, round, ack), &mut out);
            }
        }
        for rank in 0..2 {
            let stalled = engine.handle_datagram(now, &contribution(session, rank, 2, 1), &mut out);
            assert_eq!(stalled, Verdict::Dropped(DropReason::Stalled));
        }
        // Rank 3's contribution to round 2 acknowledges round 0 and takes the freed set:
        // rank 0 is told, alone, and the next contribution tells rank 1: a worker whose
        // contribution is in is never told to send it again.
        let verdict = engine.handle_datagram(now, &contribution(session, 3, 2, 0), &mut out);
        assert_eq!(notice(verdict, &out), (Recipient::Worker(0), 0, 0, 2, Flags::NONE));
        let verdict = engine.handle_datagram(now, &contribution(session, 2, 2, 1), &mut out);
        assert_eq!(notice(verdict, &out), (Recipient::Worker(1), 1, 0, 2, Flags::NONE));
        // No one else was refused.
        let verdict = engine.handle_datagram(now, &contribution(session, 0, 2, 1), &mut out);
        assert_eq!(verdict, Verdict::Consumed);
        let completed = engine.handle_datagram(now, &contribution(session, 1, 2, 1), &mut out);
        assert!(matches!(completed, Verdict::Send(Transmit { recipient: Recipient::All, .. })));
    }
}
