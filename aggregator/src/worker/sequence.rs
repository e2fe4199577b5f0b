//! Lost results found by the switch's numbering of its broadcasts, in a few packets.
//!
//! The switch numbers the results it broadcasts to each worker thread in one sequence
//! (`PacketRepr::sequence`, modulo 256), so a thread sees a lost result as a gap the
//! moment later ones arrive, whatever order the rounds complete in. The reordering rule
//! of `early_loss` cannot be as quick: a leading worker's results come back 6-26 ms out
//! of the order it sent in (90th percentile, in the simulator's 1 % row) while they only
//! wait for peers, so its allowance is tens of milliseconds. A number stays missing only
//! on a path that reorders or loses; it counts as lost once a number three
//! past it has come, as TCP waits for three duplicate acknowledgements
//! (`crate::sequence_gaps`).
//!
//! The gap does not say which slot's result it held. It was a round this thread
//! contributed to that completed before the later numbers' rounds: every rank sends each
//! slot's next block when the slot's result comes, and results come to every rank in the
//! switch's one order, so the rounds complete about in the order this thread's oldest
//! waits began. The thread asks after its oldest waiting contributions, one per lost
//! result: the switch answers a right guess with the result and a wrong one with a
//! pending notice, which costs a header each way and tells the slot whether its own
//! contribution is in.

use netagg_wire::PacketRepr;

use super::{Send, WorkerProtocol};
use crate::sequence_gaps::SequenceGaps;

/// Broadcasts after the latest loss seen on a path during which it still counts as
/// losing: one turn of the numbers. At 1 % loss a path loses about one result in each
/// hundred, so it counts as losing throughout.
const LOSING_SPELL: u32 = 256;

/// What a worker thread has seen of one switch endpoint's broadcasts to it, and of the
/// losses on its path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct BroadcastGaps {
    gaps: SequenceGaps,
    /// Numbers taken as lost that no slot has asked after yet.
    unasked: u32,
    /// Broadcasts still to come before the path counts as clean again: set to
    /// [`LOSING_SPELL`] by each loss seen, in either direction.
    losing_for: u32,
    /// The thread's transmissions when the latest loss was seen (the clock of
    /// `SlotState::waiting_since`).
    latest_loss: Option<u64>,
}

impl BroadcastGaps {
    /// Takes broadcast number `sequence`, come after the thread's `transmissions`-th
    /// packet; counts the numbers now taken as lost.
    #[inline]
    pub(super) fn take(&mut self, sequence: u8, transmissions: u64) {
        let lost = self.gaps.take(sequence).count;
        if lost > 0 {
            // Saturating: between jobs, broadcasts that come stale are still counted.
            self.unasked = self.unasked.saturating_add(lost);
            self.loss_seen(transmissions);
        } else {
            self.losing_for = self.losing_for.saturating_sub(1);
        }
    }

    /// A loss on the path was seen after the thread's `transmissions`-th packet: a gap
    /// in the broadcasts' numbers, a notice from the switch naming a lost first sending,
    /// or a probe's report finding a result or a contribution lost.
    pub(super) fn loss_seen(&mut self, transmissions: u64) {
        self.losing_for = LOSING_SPELL;
        self.latest_loss = Some(transmissions);
    }

    /// Whether the path is seen losing by a wait that began at the thread's
    /// `wait_began`-th transmission: it lost a packet within the last [`LOSING_SPELL`]
    /// broadcasts, or since the wait began. At a gigabit a spell of broadcasts passes
    /// within the timeout floor, before the timer of a slot whose result the loss took.
    pub(super) fn losing(&self, wait_began: u64) -> bool {
        self.losing_for > 0 || self.latest_loss.is_some_and(|seen| seen >= wait_began)
    }

    /// Forgets the numbers still missing, keeping the count: at a job's start, when every
    /// result of the job before is in, however its gaps were filled.
    pub(super) fn settle(&mut self) {
        self.gaps.forget_missing();
        self.unasked = 0;
    }
}

/// First sendings [`FirstSendingNumbers`] remembers: two turns of the 256 numbers, so
/// that a thread with up to 256 slots on one switch, each of which may send again before
/// a notice comes, still holds the sending a number named besides a later one numbered
/// alike.
const REMEMBERED_SENDINGS: usize = 512;

/// The numbers a worker thread gave its contributions' first sendings to one switch
/// endpoint, so that a notice naming one the switch found missing (`Flags::LOST`, the
/// mirror of the broadcasts' numbers) can be mapped back to its slot and round.
#[derive(Debug, Clone)]
pub(super) struct FirstSendingNumbers {
    /// First sendings numbered so far; the number is this count modulo 256.
    count: usize,
    /// Entry `count % REMEMBERED_SENDINGS`: the slot and round of that first sending.
    sent: Box<[Option<(u16, u32)>; REMEMBERED_SENDINGS]>,
}

impl Default for FirstSendingNumbers {
    fn default() -> Self {
        FirstSendingNumbers { count: 0, sent: Box::new([None; REMEMBERED_SENDINGS]) }
    }
}

impl FirstSendingNumbers {
    /// The number of slot `index`'s first sending of its contribution to `round`.
    #[inline]
    pub(super) fn number(&mut self, index: u16, round: u32) -> u8 {
        let count = self.count;
        self.sent[count % REMEMBERED_SENDINGS] = Some((index, round));
        self.count = count.wrapping_add(1);
        count as u8
    }

    /// The slots and rounds of the latest two first sendings numbered `number`.
    pub(super) fn sent(&self, number: u8) -> impl Iterator<Item = (u16, u32)> + '_ {
        [0, 256].into_iter().filter_map(move |turn| self.sent[usize::from(number) + turn])
    }
}

impl WorkerProtocol {
    /// Broadcast `sequence` of slot `index`'s switch came: counts the results it shows
    /// lost.
    #[inline]
    pub(super) fn take_sequence(&mut self, index: u16, sequence: u8) {
        let endpoint = self.slots[index as usize].endpoint;
        self.endpoints[endpoint].gaps.take(sequence, self.transmissions);
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
        let lost = std::mem::take(&mut self.endpoints[endpoint].gaps.unasked);
        if lost > 0 {
            self.ask_oldest(endpoint, lost);
        }
    }

    /// Asks after the `count` oldest contributions of endpoint `endpoint`'s slots that
    /// wait for their result with evidence of a loss (a result of a later sending has
    /// come) and no recovery out.
    fn ask_oldest(&mut self, endpoint: usize, count: u32) {
        let Some(latest_answered) = self.endpoints[endpoint].latest_answered else { return };
        for _ in 0..count {
            let oldest = (0..self.slots.len())
                .filter(|&at| {
                    let slot = &self.slots[at];
                    slot.active
                        && !slot.paced
                        && slot.gap_asked != Some(slot.waiting_since)
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

impl WorkerProtocol {
    /// The switch of slot `index` found this thread's first sending numbered `notice.sequence`
    /// lost when the first sending of `notice.round` of slot `index` came: that
    /// contribution goes again, through the pacer, if it still waits for its round and
    /// the switch has not said it holds it.
    ///
    /// Numbers repeat every 256 first sendings, and a thread with that many slots on one
    /// switch may have numbered another sending alike before the notice comes: of the two
    /// latest numbered alike, the one named went out before the packet that showed its
    /// loss. When that packet's wait is neither still open nor the one the slot's latest
    /// result ended, the notice is left to the timers.
    ///
    /// A request out for the same round does not hold it back: the gap rule for results
    /// asks after the oldest overtaken contributions, which is often this one, and its
    /// answer would send it a round trip later. The switch tells only isolated losses, at
    /// most one per 32 first sendings; a resend is still a loss to the pacer, which slows
    /// down if they come in runs.
    pub(super) fn take_lost_notice(&mut self, index: u16, notice: &PacketRepr) {
        let endpoint = self.slots[usize::from(index)].endpoint;
        self.endpoints[endpoint].gaps.loss_seen(self.transmissions);
        let showing = &self.slots[usize::from(index)];
        let shown_at = match (showing.outstanding, showing.answered_wait) {
            (Some(c), _) if c.round == notice.round => showing.waiting_since,
            (_, (round, wait)) if round == notice.round => wait,
            _ => return,
        };
        let lost = self.endpoints[endpoint].first_numbers.sent(notice.sequence).find(|&(at, round)| {
            self.slots.get(usize::from(at)).is_some_and(|slot| {
                slot.active
                    && !slot.paced
                    && slot.held != Some(round)
                    && slot.waiting_since < shown_at
                    && slot.outstanding.is_some_and(|c| c.round == round)
            })
        });
        if let Some((at, round)) = lost {
            self.pending.push_back((at, Send::Data { retransmission: Some(round) }));
            self.counters.lost_notices += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use netagg_wire::{Flags, MessageType, PacketRepr};

    use super::super::testing::{numbered, parsed, pending_of, result_of, running, sent, Numbers};
    use super::super::Delivery;
    use super::*;

    /// What a thread of 8 slots sends at `now` after the broadcasts of its first window's
    /// slots `slots`, numbered `numbers`: (message type, slot, flags) of each packet.
    fn after(slots: &[usize], numbers: &[u8]) -> (WorkerProtocol, Vec<(MessageType, u16, Flags)>) {
        let start = Instant::now();
        let mut protocol = running(start, 8, 16, Duration::from_millis(10));
        let first = sent(&mut protocol, start);
        assert_eq!(first.len(), 8);
        for (&slot, &number) in slots.iter().zip(numbers) {
            let delivery =
                protocol.handle_datagram(start, &numbered(result_of(&first[slot]), number), &mut Numbers);
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

    /// The switch's notice, answering `packet`, that this thread's first sending `number`
    /// never came.
    fn lost_notice(packet: &[u8], number: u8) -> Vec<u8> {
        let shown_by = parsed(packet);
        let notice = PacketRepr {
            flags: Flags::LOST,
            job: shown_by.job,
            rank: shown_by.rank,
            slot: shown_by.slot,
            round: shown_by.round,
            sequence: number,
            ..PacketRepr::new(
                MessageType::Pending,
                shown_by.element_type,
                shown_by.session,
                shown_by.token,
                0,
            )
        };
        let mut bytes = vec![0; notice.buffer_len()];
        notice.emit(&mut bytes[..]).unwrap().seal();
        bytes
    }

    #[test]
    fn first_sendings_are_numbered_and_a_lost_one_named_by_the_switch_goes_again_once() {
        let start = Instant::now();
        let mut protocol = running(start, 8, 16, Duration::from_millis(10));
        let first = sent(&mut protocol, start);
        let numbers: Vec<u8> = first.iter().map(|p| parsed(p).sequence).collect();
        assert_eq!(numbers, [0, 1, 2, 3, 4, 5, 6, 7]);
        // Slot 2's first sending, number 2, never came; the notice rides slot 5's.
        let delivery = protocol.handle_datagram(start, &lost_notice(&first[5], 2), &mut Numbers);
        assert_eq!(delivery, Delivery::Pending);
        let again = sent(&mut protocol, start);
        let again: Vec<_> = again.iter().map(|p| parsed(p)).map(|p| (p.slot, p.flags, p.sequence)).collect();
        assert_eq!(again, [(2, Flags::RETRANSMISSION, 0)], "sent again, unnumbered");
        assert_eq!((protocol.counters().lost_notices, protocol.counters().timeouts), (1, 0));
        // Once its result is in, a duplicate of the notice sends nothing.
        protocol.handle_datagram(start, &result_of(&first[2]), &mut Numbers);
        let next = sent(&mut protocol, start);
        assert_eq!(next.iter().map(|p| parsed(p).sequence).collect::<Vec<_>>(), [8], "slot 2's next block");
        protocol.handle_datagram(start, &lost_notice(&first[5], 2), &mut Numbers);
        assert!(sent(&mut protocol, start).is_empty());
        assert_eq!(protocol.counters().lost_notices, 1);
    }

    #[test]
    fn a_notice_behind_the_result_that_ended_its_slots_stream_still_sends_the_lost_one_again() {
        // One block a slot: slot 3's result ends its stream, and the switch's notice that
        // number 1 (slot 1's) never came waited behind that result.
        let start = Instant::now();
        let mut protocol = running(start, 4, 4, Duration::from_millis(10));
        let first = sent(&mut protocol, start);
        protocol.handle_datagram(start, &result_of(&first[3]), &mut Numbers);
        let delivery = protocol.handle_datagram(start, &lost_notice(&first[3], 1), &mut Numbers);
        assert_eq!(delivery, Delivery::Pending);
        let again: Vec<_> =
            sent(&mut protocol, start).iter().map(|p| parsed(p)).map(|p| (p.slot, p.flags)).collect();
        assert_eq!(again, [(1, Flags::RETRANSMISSION)]);
    }

    #[test]
    fn a_number_given_again_since_the_packet_that_showed_the_loss_is_not_taken_for_the_lost_one() {
        // Slot 3's first sending (number 3) is lost and slot 4's (number 4) waits on; the
        // other slots run on until number 3 comes round again, on a sending still in
        // flight. The switch's notice that number 3 never came, shown by slot 4's packet,
        // is about slot 3's, not the later one numbered alike.
        let start = Instant::now();
        let mut protocol = running(start, 8, 512, Duration::from_millis(10));
        let first = sent(&mut protocol, start);
        let mut in_flight: std::collections::VecDeque<Vec<u8>> = first.iter().cloned().collect();
        let mut numbered = first.len();
        while numbered <= 260 {
            let packet = in_flight.pop_front().expect("a packet in flight");
            if [3, 4].contains(&parsed(&packet).slot) {
                continue;
            }
            protocol.handle_datagram(start, &result_of(&packet), &mut Numbers);
            for next in sent(&mut protocol, start) {
                if parsed(&next).message_type == MessageType::Data {
                    numbered += 1;
                    in_flight.push_back(next);
                }
            }
        }
        let reused = in_flight.iter().map(|p| parsed(p)).find(|p| p.sequence == 3).expect("number 3 again");
        assert!(![3, 4].contains(&reused.slot), "{reused:?}");
        protocol.handle_datagram(start, &lost_notice(&first[4], 3), &mut Numbers);
        let again: Vec<_> =
            sent(&mut protocol, start).iter().map(|p| parsed(p)).map(|p| (p.slot, p.flags)).collect();
        assert_eq!(again, [(3, Flags::RETRANSMISSION)]);
        assert_eq!(protocol.counters().lost_notices, 1);
    }

    #[test]
    fn a_notice_about_a_contribution_the_switch_said_it_holds_sends_nothing() {
        let start = Instant::now();
        let mut protocol = running(start, 4, 8, Duration::from_millis(10));
        let first = sent(&mut protocol, start);
        // The switch said slot 1's contribution is in (a pending notice with CONTRIBUTED):
        // a later notice naming its number, a stale one, changes nothing.
        let asked = PacketRepr {
            message_type: MessageType::Ack,
            flags: Flags::WANT_RESULT,
            element_count: 0,
            sequence: 0,
            ..parsed(&first[1])
        };
        let mut request = vec![0; asked.buffer_len()];
        asked.emit(&mut request[..]).unwrap().seal();
        protocol.handle_datagram(start, &pending_of(&request, true), &mut Numbers);
        protocol.handle_datagram(start, &lost_notice(&first[3], 1), &mut Numbers);
        assert!(sent(&mut protocol, start).is_empty());
        assert_eq!(protocol.counters().lost_notices, 0);
    }

    #[test]
    fn a_path_counts_as_losing_for_a_turn_of_broadcasts_after_a_loss_or_within_the_wait_that_saw_it() {
        let mut gaps = BroadcastGaps::default();
        (0..=255).for_each(|number| gaps.take(number, 10));
        assert!(!gaps.losing(0), "nothing lost");
        // Number 0 of the next turn is lost, seen when number 3 comes after the thread's
        // 20th transmission.
        (1..=3).for_each(|number| gaps.take(number, 20));
        assert!(gaps.losing(21));
        (4..=255).chain(0..=2).for_each(|number| gaps.take(number, 30));
        assert!(gaps.losing(21), "255 broadcasts after the one that showed it");
        gaps.take(3, 30);
        assert!(!gaps.losing(21), "256 after it");
        assert!(gaps.losing(20), "for a wait that began before it was seen");
        // A loss seen otherwise (a notice of a lost first sending) starts a spell too.
        gaps.loss_seen(40);
        (4..=255).chain(0..=2).for_each(|number| gaps.take(number, 50));
        assert!(gaps.losing(41), "255 broadcasts after the notice");
        gaps.take(3, 50);
        assert!(!gaps.losing(41) && gaps.losing(40));
    }
}
