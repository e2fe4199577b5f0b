//! The numbers of a session's broadcast results, one sequence per worker thread.
//!
//! Every rank's thread of one index owns the same slots, so each of them receives the
//! same broadcasts, in the order the switch sends them: one count per thread index serves
//! every rank, and a broadcast is still written and sealed once for all its recipients. A
//! result sent to one worker alone (an answer to its request or repeated contribution) is
//! not numbered, since the other ranks' threads never see it; its loss is the answering
//! timer's to find (`worker/early_loss.rs`).

/// The last number given to each worker thread's broadcasts, modulo 256.
#[derive(Debug)]
pub(super) struct BroadcastNumbers {
    last: Vec<u8>,
    /// The threads' share of the slots, as a reciprocal ([`ThreadOfSlot`]): every
    /// contribution asks which thread its slot is, twice.
    thread_of: ThreadOfSlot,
}

/// `slot / slots_per_thread` as a multiplication and a shift: `⌈2³² / slots_per_thread⌉`
/// times `slot`, over 2³². Exact for every 16-bit slot and divisor, since the rounding up
/// adds less than `slot / 2³²` (below 2⁻¹⁶) to a quotient whose fraction is at most
/// `1 - 1 / slots_per_thread`. The engine asks twice a contribution (its thread's first
/// sendings, its result's number), where a division took about 12 cycles each.
#[derive(Debug, Clone, Copy)]
struct ThreadOfSlot {
    reciprocal: u64,
}

impl ThreadOfSlot {
    fn new(slots_per_thread: u16) -> ThreadOfSlot {
        let divisor = u64::from(slots_per_thread.max(1));
        ThreadOfSlot { reciprocal: (1u64 << 32).div_ceil(divisor) }
    }

    #[inline]
    fn of(self, slot: u16) -> usize {
        ((u64::from(slot) * self.reciprocal) >> 32) as usize
    }
}

impl BroadcastNumbers {
    /// One sequence for a session of `slots` slots whose ranks each run one thread, until
    /// [`BroadcastNumbers::split`] says otherwise.
    pub(super) fn new(slots: u16) -> BroadcastNumbers {
        BroadcastNumbers { last: vec![0], thread_of: ThreadOfSlot::new(slots) }
    }

    /// One sequence per thread of `slots_per_thread` slots each (the threads' contiguous
    /// ranges, in slot order).
    pub(super) fn split(&mut self, slots: u16, slots_per_thread: u16) {
        let slots_per_thread = slots_per_thread.clamp(1, slots.max(1));
        self.thread_of = ThreadOfSlot::new(slots_per_thread);
        self.last = vec![0; usize::from(slots.div_ceil(slots_per_thread))];
    }

    /// How many worker threads each rank runs.
    pub(super) fn threads(&self) -> usize {
        self.last.len()
    }

    /// The worker thread, of each rank, that owns `slot`.
    #[inline]
    pub(super) fn thread(&self, slot: u16) -> usize {
        self.thread_of.of(slot)
    }

    /// The number of the next broadcast of `slot`'s round.
    #[inline]
    pub(super) fn number(&mut self, slot: u16) -> u8 {
        let thread = self.thread(slot);
        // `handle` checked `slot` against the session's slots, which `split` covered.
        let last = &mut self.last[thread];
        *last = last.wrapping_add(1);
        *last
    }
}

#[cfg(test)]
mod tests {
    use netagg_wire::Packet;

    use super::super::testing::{ask, contribution, one_slot};
    use super::super::{Recipient, Transmit, Verdict};
    use super::*;

    #[test]
    fn broadcasts_carry_consecutive_numbers_and_an_answer_to_one_worker_none() {
        let (mut engine, session, now, mut out) = one_slot(2);
        let mut numbers = Vec::new();
        for round in 0..3 {
            engine.handle_datagram(now, &contribution(session, 0, round, round.wrapping_sub(1)), &mut out);
            let verdict = engine.handle_datagram(
                now,
                &contribution(session, 1, round, round.wrapping_sub(1)),
                &mut out,
            );
            let Verdict::Send(Transmit { recipient: Recipient::All, len, .. }) = verdict else {
                panic!("{verdict:?}")
            };
            numbers.push(Packet::new_checked(&out[..len]).unwrap().sequence());
            // Rank 0 asks for the result again: the answer goes to it alone, unnumbered.
            let verdict = engine.handle_datagram(now, &ask(session, 0, round, false), &mut out);
            let Verdict::Send(Transmit { recipient: Recipient::Worker(0), len, .. }) = verdict else {
                panic!("{verdict:?}")
            };
            assert_eq!(out[23], 0, "byte 23 of an answer");
            assert_eq!(Packet::new_checked(&out[..len]).unwrap().round(), round);
        }
        assert_eq!(numbers, [1, 2, 3]);
    }

    #[test]
    fn a_slots_thread_is_its_quotient_for_every_slot_and_share() {
        for slots_per_thread in (1..=300).chain([1000, 4095, 4097, 32767, 32768, 65521, 65535]) {
            let thread_of = ThreadOfSlot::new(slots_per_thread);
            for slot in 0..=u16::MAX {
                assert_eq!(
                    thread_of.of(slot),
                    usize::from(slot / slots_per_thread),
                    "{slot} / {slots_per_thread}"
                );
            }
        }
    }

    #[test]
    fn each_threads_broadcasts_count_on_their_own_and_wrap() {
        let mut numbers = BroadcastNumbers::new(8);
        assert_eq!([0, 7, 3].map(|slot| numbers.number(slot)), [1, 2, 3]);
        numbers.split(8, 4);
        // Slots 0-3 are thread 0's, 4-7 thread 1's.
        assert_eq!([0, 4, 3, 5, 7].map(|slot| numbers.number(slot)), [1, 1, 2, 2, 3]);
        for _ in 0..253 {
            numbers.number(1);
        }
        assert_eq!((numbers.number(2), numbers.number(2)), (0, 1), "modulo 256");
    }
}
