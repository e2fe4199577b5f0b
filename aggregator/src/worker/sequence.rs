//! Lost results found by the switch's numbering of its broadcasts, in a few packets.
//!
//! The switch numbers the results it broadcasts to each worker thread in one sequence
//! (`PacketRepr::sequence`, modulo 256), so a thread sees a lost result as a gap the
//! moment later ones arrive, whatever order the rounds complete in. The reordering rule
//! of `early_loss` cannot be as quick: a leading worker's results come back 6-26 ms out
//! of the order it sent in (90th percentile, in the simulator's 1 % row) while they only
//! wait for peers, so its allowance is tens of milliseconds. A number stays missing only
//! on a path that reorders or loses; it counts as lost once a number [`REORDER_PACKETS`]
//! past it has come, as TCP waits for three duplicate acknowledgements.
//!
//! The gap does not say which slot's result it held. It was a round this thread
//! contributed to that completed before the later numbers' rounds: every rank sends each
//! slot's next block when the slot's result comes, and results come to every rank in the
//! switch's one order, so the rounds complete about in the order this thread's oldest
//! waits began. The thread asks after its oldest waiting contributions, one per lost
//! result: the switch answers a right guess with the result and a wrong one with a
//! pending notice, which costs a header each way and tells the slot whether its own
//! contribution is in.

use super::{Send, WorkerProtocol};

/// How far past a missing number a broadcast must come for it to be taken as lost
/// rather than reordered.
pub(super) const REORDER_PACKETS: u32 = 3;

/// What a worker thread has seen of one switch endpoint's broadcasts to it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct BroadcastGaps {
    /// The number the next broadcast should carry, once one has come.
    next: Option<u8>,
    /// Bit `i`, below [`REORDER_PACKETS`]: number `next - 1 - i` has not come (bit 0,
    /// the latest, always has); those further back are lost already.
    missing: u64,
    /// Numbers taken as lost that no slot has asked after yet.
    unasked: u32,
}

impl BroadcastGaps {
    /// Takes broadcast number `sequence`; counts the numbers now taken as lost, missing
    /// while one [`REORDER_PACKETS`] or more past them has come, each once.
    #[inline]
    pub(super) fn take(&mut self, sequence: u8) {
        let lost = self.lost_at(sequence);
        self.unasked += lost;
    }

    /// How many numbers broadcast `sequence` shows lost.
    #[inline]
    fn lost_at(&mut self, sequence: u8) -> u32 {
        if self.next == Some(sequence) && self.missing == 0 {
            // The next number, with none missing: the common case, without the shifts.
            self.next = Some(sequence.wrapping_add(1));
            return 0;
        }
        let Some(next) = self.next else {
            self.next = Some(sequence.wrapping_add(1));
            return 0;
        };
        let skipped = sequence.wrapping_sub(next);
        if skipped >= 128 {
            // Behind `next`: a number reordered into its gap, or a duplicate.
            let behind = u32::from(next.wrapping_sub(1).wrapping_sub(sequence));
            if behind < REORDER_PACKETS {
                self.missing &= !(1 << behind);
            }
            return 0;
        }
        // Numbers past `next` skipped, and the ones already missing, move `skipped + 1`
        // places back: each that reaches the allowance is lost, the others still missing.
        let skipped = u32::from(skipped);
        self.next = Some(sequence.wrapping_add(1));
        let moved = skipped + 1;
        let window = (1u64 << REORDER_PACKETS) - 1;
        let (old_lost, old_kept) = if moved >= REORDER_PACKETS {
            (self.missing.count_ones(), 0)
        } else {
            ((self.missing >> (REORDER_PACKETS - moved)).count_ones(), self.missing << moved & window)
        };
        let new_lost = skipped.saturating_sub(REORDER_PACKETS - 1);
        let new_kept = ((1u64 << skipped.min(REORDER_PACKETS - 1)) - 1) << 1;
        self.missing = old_kept | new_kept;
        old_lost + new_lost
    }

    /// Forgets the numbers still missing, keeping the count: at a job's start, when every
    /// result of the job before is in, however its gaps were filled.
    pub(super) fn settle(&mut self) {
        self.missing = 0;
        self.unasked = 0;
    }
}

impl WorkerProtocol {
    /// Broadcast `sequence` of slot `index`'s switch came: counts the results it shows
    /// lost.
    #[inline]
    pub(super) fn take_sequence(&mut self, index: u16, sequence: u8) {
        let endpoint = self.slots[index as usize].endpoint;
        self.gaps[endpoint].take(sequence);
    }

    /// For each result slot `index`'s switch's numbers showed lost, the oldest waiting
    /// contribution of that switch's slots that a later result overtook asks for its
    /// round's result, at once.
    ///
    /// A thread that loses results in a burst has the same oldest slots asked by each
    /// gap; one asked in its current wait is not asked again, so that the next gap's guess
    /// is the next oldest.
    // Inlined by force into its one caller, which runs per result: a build of 16 codegen
    // units left it a call (callgrind).
    #[inline(always)]
    pub(super) fn ask_after_gaps(&mut self, index: u16) {
        let endpoint = self.slots[index as usize].endpoint;
        let lost = std::mem::take(&mut self.gaps[endpoint].unasked);
        if lost > 0 {
            self.ask_oldest(endpoint, lost);
        }
    }

    /// Asks after the `count` oldest contributions of endpoint `endpoint`'s slots that
    /// wait for their result with evidence of a loss (a result of a later sending has
    /// come) and no recovery out.
    fn ask_oldest(&mut self, endpoint: usize, count: u32) {
        let Some(latest_answered) = self.latest_answered else { return };
        for _ in 0..count {
            let oldest = (0..self.slots.len())
                .filter(|&at| {
                    let slot = &self.slots[at];
                    slot.active
                        && !slot.paced
                        && slot.gap_asked != Some(slot.waiting_since)
                        && slot.recovery_sent.is_none()
                        && slot.waiting_since < latest_answered
                        && slot.outstanding.is_some_and(|c| c.round == slot.have.wrapping_add(1))
                        && slot.endpoint == endpoint
                })
                .min_by_key(|&at| self.slots[at].waiting_since);
            let Some(at) = oldest else { return };
            let slot = &mut self.slots[at];
            slot.gap_asked = Some(slot.waiting_since);
            let round = slot.have.wrapping_add(1);
            self.pending.push_back((at as u16, Send::Request { round }));
            self.counters.gap_requests += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use netagg_wire::{Flags, MessageType, Packet};

    use super::super::testing::{parsed, result_of, running, sent, Numbers};
    use super::super::Delivery;
    use super::*;

    fn taken(numbers: &[u8]) -> Vec<u32> {
        let mut gaps = BroadcastGaps::default();
        numbers.iter().map(|&n| gaps.lost_at(n)).collect()
    }

    #[test]
    fn a_missing_number_is_lost_once_the_number_three_past_it_comes() {
        assert_eq!(taken(&[7, 8, 10, 11, 12]), [0, 0, 0, 0, 1]);
        // Two missing at once, each lost when the number three past it comes; a jump
        // past the allowance loses all but the last two at once.
        assert_eq!(taken(&[1, 4, 5, 6, 7]), [0, 0, 1, 1, 0]);
        assert_eq!(taken(&[1, 9]), [0, 5]);
        // The largest jump a byte tells from a late number, 127 skipped.
        assert_eq!(taken(&[1, 129, 130]), [0, 125, 1]);
    }

    #[test]
    fn a_number_reordered_within_the_allowance_or_duplicated_is_not_lost() {
        assert_eq!(taken(&[1, 3, 4, 2, 5, 6, 7]), [0; 7]);
        assert_eq!(taken(&[1, 2, 2, 1, 3, 4, 5, 6]), [0; 8]);
        // Too late: lost already, and not counted again when it comes.
        assert_eq!(taken(&[1, 3, 4, 5, 2, 6]), [0, 0, 0, 1, 0, 0]);
    }

    #[test]
    fn numbers_wrap_and_a_job_start_forgets_what_is_missing() {
        assert_eq!(taken(&[254, 255, 0, 2, 3, 4]), [0, 0, 0, 0, 0, 1]);
        let mut gaps = BroadcastGaps::default();
        for n in [1, 3, 4, 5, 7] {
            gaps.take(n);
        }
        assert_eq!(gaps.unasked, 1);
        gaps.settle();
        assert_eq!([8, 9, 10].map(|n| gaps.lost_at(n)), [0, 0, 0]);
        assert_eq!(gaps.unasked, 0);
    }

    /// The switch's broadcast of `packet`'s round, numbered `number`.
    fn numbered(packet: &[u8], number: u8) -> Vec<u8> {
        let mut result = result_of(packet);
        let mut view = Packet::new_unchecked(&mut result[..]);
        view.set_sequence(number);
        view.seal();
        result
    }

    /// What a thread of 8 slots sends at `now` after the broadcasts of its first window's
    /// slots `slots`, numbered `numbers`: (message type, slot, flags) of each packet.
    fn after(slots: &[usize], numbers: &[u8]) -> (WorkerProtocol, Vec<(MessageType, u16, Flags)>) {
        let start = Instant::now();
        let mut protocol = running(start, 8, 16, Duration::from_millis(10));
        let first = sent(&mut protocol, start);
        assert_eq!(first.len(), 8);
        for (&slot, &number) in slots.iter().zip(numbers) {
            let delivery = protocol.handle_datagram(start, &numbered(&first[slot], number), &mut Numbers);
            assert_eq!(delivery, Delivery::Accepted);
        }
        let packets = sent(&mut protocol, start);
        (protocol, packets.iter().map(|p| parsed(p)).map(|p| (p.message_type, p.slot, p.flags)).collect())
    }

    #[test]
    fn a_result_missing_three_numbers_back_is_asked_for_at_once_by_the_oldest_overtaken_slot() {
        // Slot 1's result, number 11, is lost: once number 13 has come, slot 1 asks.
        let (protocol, packets) = after(&[0, 2, 3], &[10, 12, 13]);
        let requests: Vec<_> = packets.iter().filter(|p| p.0 == MessageType::Ack).collect();
        assert!(requests.is_empty(), "{packets:?}");
        assert_eq!(protocol.counters().gap_requests, 0);
        let (protocol, packets) = after(&[0, 2, 3, 4], &[10, 12, 13, 14]);
        let requests: Vec<_> = packets.iter().filter(|p| p.0 == MessageType::Ack).collect();
        assert_eq!(requests, [&(MessageType::Ack, 1, Flags::WANT_RESULT)], "{packets:?}");
        assert_eq!((protocol.counters().gap_requests, protocol.counters().timeouts), (1, 0));
        // The next blocks of the four slots answered, and nothing sent again.
        assert_eq!(packets.iter().filter(|p| p.0 == MessageType::Data && p.2 == Flags::NONE).count(), 4);
    }

    #[test]
    fn a_result_reordered_within_three_numbers_is_not_asked_for() {
        let (protocol, packets) = after(&[0, 2, 3, 1, 4, 5], &[10, 12, 13, 11, 14, 15]);
        assert!(packets.iter().all(|p| p.0 == MessageType::Data && p.2 == Flags::NONE), "{packets:?}");
        assert_eq!(protocol.counters().gap_requests, 0);
    }
}
