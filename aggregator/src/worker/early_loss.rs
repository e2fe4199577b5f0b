//! Loss found and repaired in round trips of the path, not in timeouts.
//!
//! A lost packet stalls its slot's round for every worker until it is repaired, while
//! the retransmission timeout learns the round trips of a standing queue and of rounds
//! that waited for a peer, and their deviations: at 50 Mbit/s with a window of 256
//! packets, 50-100 ms on some workers, where the path alone takes 2-5 ms. Two rules
//! shorten the wait:
//! - *Overtaken*: a contribution whose result has not come back when the result of one
//!   sent after it to the same switch endpoint has (another endpoint answers behind a
//!   queue of its own), and a reorder allowance has passed since, is taken as lost then,
//!   not at its slot's timeout (RACK's rule, RFC 8985). Results come back out of the
//!   order this worker sent in by as much as the workers' orders of sending differ
//!   (each paces its own queue, and resends go first), which shows in the round trips'
//!   spread: the allowance is half the smoothed round trip plus two deviations. RACK's
//!   quarter of the least round trip took so many results still coming for lost that the
//!   requests and duplicate results they caused cost more than they saved (1.54 of the
//!   link-rate model in the simulator against 1.34 without the rule). Each first sending
//!   is judged once. In a sparse job a round completes when the peers holding its block
//!   have each received the result naming it, in no relation to this thread's order:
//!   there the slot takes it as evidence only while its path is seen losing (see
//!   `recovery`).
//! - *Unanswered*: the switch answers a request or a retransmission at once (the result,
//!   or a pending notice), so an answer overdue by the timeout of the answers measured
//!   means the packet or its answer was lost. The first [`QUICK_RECOVERIES`] recoveries
//!   of a wait are sent again then; later ones wait for the slot's timer, which backs
//!   off, so that a switch that stopped answering meets the exponential backoff.
//!
//! The job's tail, which no later result reveals, is left to the timers and the probe
//! (see `recovery`).

use std::time::Instant;

use super::{RttEstimate, WorkerProtocol};
use crate::overtaking::{Overtaken, Sending};

/// A contribution's first sending: the thread's transmissions when it went out (its
/// slot's `waiting_since` while the slot waits for its result), and its round.
pub(super) type FirstSending = Sending<u64, u32>;

/// Recoveries of one wait that are sent again once their answer is overdue, before the
/// slot's backed-off timer takes over.
const QUICK_RECOVERIES: u32 = 2;

impl WorkerProtocol {
    /// Books the first sending of slot `index`'s contribution to `round`, to the slot's
    /// `endpoint`, just sent as the thread's `transmission`-th packet.
    #[inline]
    pub(super) fn sent_first(&mut self, transmission: u64, index: u16, endpoint: usize, round: u32) {
        let sending = FirstSending { sent: transmission, slot: index, tag: round };
        self.endpoints[endpoint].first_sendings.push(sending);
    }

    /// A result answered slot `index`'s contribution first sent to `endpoint` as the
    /// thread's `answered`-th packet, at `now`: every contribution sent to the same
    /// endpoint before it and still unanswered is taken as lost once the reorder allowance
    /// has passed, its slot's timer brought forward to then.
    // Inlined by force into its one caller, which runs per packet: a build of 16 codegen
    // units left it a call (callgrind).
    #[inline(always)]
    pub(super) fn overtaken_by(&mut self, now: Instant, index: u16, endpoint: usize, answered: u64) {
        // Results mostly come in the order their contributions went out: then none is
        // older than the answered one, and the walk is skipped.
        let mut sendings = &mut self.endpoints[endpoint].first_sendings;
        if sendings.oldest().is_some_and(|oldest| oldest.sent < answered) {
            self.walk_overtaken(now, endpoint, answered);
            sendings = &mut self.endpoints[endpoint].first_sendings;
        }
        // The answered sending waits no more (its round's result is in, and the slot never
        // sends that round again): forgotten now, so that the next result, in order, finds
        // nothing older than its own.
        if sendings.oldest().is_some_and(|oldest| oldest.sent == answered && oldest.slot == index) {
            sendings.forget_oldest();
        }
    }

    /// The walk of [`WorkerProtocol::overtaken_by`] over the sendings to `endpoint`
    /// before the answered one.
    fn walk_overtaken(&mut self, now: Instant, endpoint: usize, answered: u64) {
        let Some(rtt) = self.rtt else {
            // No round trip measured yet, so no allowance known: the timers judge.
            return;
        };
        let mut walk = Overtaken::new(answered, now, rtt);
        while let Some((sending, lost_at)) =
            walk.next(&mut self.endpoints[endpoint].first_sendings, |sending| {
                let slot = &self.slots[sending.slot as usize];
                slot.active
                    && slot.waiting_since == sending.sent
                    && slot.outstanding.is_some_and(|c| c.round == sending.tag)
            })
        {
            // A slot that would not take the ordering's word at its timer is left to it.
            let due_later =
                self.slots[sending.slot as usize].deadline.is_some_and(|deadline| lost_at < deadline);
            if due_later && self.order_speaks(sending.slot) {
                self.set_deadline(sending.slot, lost_at);
            }
        }
    }

    /// Slot `index` sent a request or a retransmission at `now`: its timer fires when
    /// the answer is overdue, if that is sooner, for the first recoveries of a wait.
    pub(super) fn recovery_sent(&mut self, now: Instant, index: u16) {
        let slot = &mut self.slots[index as usize];
        slot.recovery_sent = Some(now);
        let Some(answers) = self.answer_rtt.filter(|_| slot.backoff <= QUICK_RECOVERIES) else {
            return;
        };
        let ceiling = self.config.max_retransmit_timeout.max(self.config.retransmit_timeout);
        let overdue_at = now + answers.timeout(self.config.retransmit_timeout, ceiling);
        if slot.deadline.is_some_and(|deadline| overdue_at < deadline) {
            self.set_deadline(index, overdue_at);
        }
    }

    /// The switch answered slot `index` at `now`: the time since its recovery went out,
    /// if one is out, is a round trip of the answers.
    pub(super) fn answered(&mut self, now: Instant, index: u16) {
        if let Some(sent) = self.slots[index as usize].recovery_sent.take() {
            let sample = now.saturating_duration_since(sent);
            self.answer_rtt = Some(RttEstimate::sampled(self.answer_rtt, sample));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use netagg_wire::{Flags, MessageType};

    use super::super::testing::{config, parsed, pending_of, result_of, running, running_on, sent, Numbers};
    use super::super::{Delivery, JobStatus, SessionKey, SessionKeys};
    use super::*;

    /// The timeout before any round trip is measured, and its floor.
    const FLOOR: Duration = Duration::from_millis(10);
    const MS: Duration = Duration::from_millis(1);

    /// A thread of 4 slots running a dense job of `blocks`, whose first window went out at
    /// `start` and whose first round trip measured 8 ms (slot 0's result): a timeout of
    /// 24 ms and a reorder allowance of 12 ms. The other slots' timers, due at 10 ms, see
    /// results still coming and run on to 32 ms.
    fn measured(start: Instant, blocks: u64) -> (WorkerProtocol, Vec<Vec<u8>>) {
        let mut protocol = running(start, 4, blocks, FLOOR);
        let first = sent(&mut protocol, start);
        assert_eq!(first.len(), 4);
        protocol.handle_datagram(start + 8 * MS, &result_of(&first[0]), &mut Numbers);
        assert_eq!(protocol.rtt.map(|rtt| rtt.reorder_allowance()), Some(12 * MS));
        assert_eq!(sent(&mut protocol, start + 8 * MS).len(), usize::from(blocks > 4));
        protocol.handle_timeout(start + 10 * MS);
        assert!(sent(&mut protocol, start + 10 * MS).is_empty());
        (protocol, first)
    }

    /// Slot 2's result comes back at 11 ms and slot 1's, sent before it, has not: slot 1
    /// is taken as lost at 23 ms, not at its timer's 32 ms, and asks whether the switch
    /// holds its contribution (peers complete the rounds); told at 27 ms that it does
    /// not, it sends it again. Returns the thread and its first window.
    fn overtaken(start: Instant, blocks: u64) -> (WorkerProtocol, Vec<Vec<u8>>) {
        let (mut protocol, first) = measured(start, blocks);
        protocol.handle_datagram(start + 11 * MS, &result_of(&first[2]), &mut Numbers);
        sent(&mut protocol, start + 11 * MS);
        let lost_at = start + 23 * MS;
        protocol.handle_timeout(lost_at - Duration::from_nanos(1));
        assert!(sent(&mut protocol, lost_at).is_empty(), "not before the allowance");
        protocol.handle_timeout(lost_at);
        let asked = sent(&mut protocol, lost_at);
        let request = parsed(&asked[0]);
        assert_eq!(
            (asked.len(), request.message_type, request.slot, request.round),
            (1, MessageType::Ack, 1, 0)
        );
        assert!(request.flags.contains(Flags::WANT_RESULT));
        protocol.handle_datagram(start + 27 * MS, &pending_of(&asked[0], false), &mut Numbers);
        let again = sent(&mut protocol, start + 27 * MS);
        assert_eq!(
            (again.len(), parsed(&again[0]).block, parsed(&again[0]).flags),
            (1, 1, Flags::RETRANSMISSION)
        );
        (protocol, first)
    }

    #[test]
    fn a_contribution_overtaken_by_a_later_ones_result_is_recovered_after_the_allowance() {
        let start = Instant::now();
        let (mut protocol, first) = overtaken(start, 12);
        // Slot 3, sent after slot 2, was overtaken by nothing: its timer is its own.
        protocol.handle_timeout(start + 31 * MS);
        assert!(sent(&mut protocol, start + 31 * MS).is_empty());
        assert_eq!(protocol.counters().timeouts, 1);
        for packet in [&first[1], &first[3]] {
            let delivery = protocol.handle_datagram(start + 31 * MS, &result_of(packet), &mut Numbers);
            assert_eq!(delivery, Delivery::Accepted);
        }
        assert_eq!(protocol.counters().timeouts, 1);
    }

    /// Slots 0 and 1 belong to one switch and slots 2 and 3 to another, whose queue is
    /// shorter: the results of slots 2 and 3 come first though their packets went out
    /// after slot 1's. They show nothing of slot 1's path, which waits for its own result
    /// without asking or sending again (taken as evidence, they had each worker of a
    /// sharded session on lossless links resend up to a seventh of its packets).
    #[test]
    fn a_result_from_another_switch_overtakes_nothing() {
        let start = Instant::now();
        let mut sharded = config(4, FLOOR);
        let key = |session| SessionKey { session, token: u64::from(session) << 8 };
        sharded.keys = SessionKeys::sharded([(0..2, key(1)), (2..4, key(3))]).unwrap();
        let mut protocol = running_on(sharded, start, 4);
        let first = sent(&mut protocol, start);
        assert_eq!(first.iter().map(|p| parsed(p).session).collect::<Vec<_>>(), [1, 1, 3, 3]);
        protocol.handle_datagram(start + 8 * MS, &result_of(&first[0]), &mut Numbers);
        assert_eq!(protocol.rtt.map(|rtt| rtt.reorder_allowance()), Some(12 * MS));
        // The timers of slots 1-3, due at 10 ms, see results still coming and run on.
        protocol.handle_timeout(start + 10 * MS);
        assert!(sent(&mut protocol, start + 10 * MS).is_empty());
        for packet in [&first[2], &first[3]] {
            let delivery = protocol.handle_datagram(start + 11 * MS, &result_of(packet), &mut Numbers);
            assert_eq!(delivery, Delivery::Accepted);
        }
        // Past the allowance that would have taken slot 1 as lost (23 ms), and close to
        // its timer (32 ms): nothing.
        for at in [23, 31] {
            protocol.handle_timeout(start + at * MS);
            assert!(sent(&mut protocol, start + at * MS).is_empty(), "at {at} ms");
        }
        let delivery = protocol.handle_datagram(start + 31 * MS, &result_of(&first[1]), &mut Numbers);
        assert_eq!(delivery, Delivery::Accepted);
        assert_eq!(protocol.status(), &JobStatus::Done);
        let counters = protocol.counters();
        assert_eq!((counters.timeouts, counters.acks_sent, counters.retransmissions), (0, 0, 0));
    }

    #[test]
    fn results_in_order_leave_only_the_unanswered_first_sendings_booked() {
        let start = Instant::now();
        let (mut protocol, first) = measured(start, 12);
        // Slot 0's result and its next block's first sending: slots 1-3 and that one wait.
        assert_eq!(protocol.endpoints[0].first_sendings.len(), 4);
        for (at, packet) in (12..).zip(&first[1..]) {
            let now = start + at * MS;
            assert_eq!(protocol.handle_datagram(now, &result_of(packet), &mut Numbers), Delivery::Accepted);
            assert_eq!(sent(&mut protocol, now).len(), 1);
            assert_eq!(protocol.endpoints[0].first_sendings.len(), 4, "at {at} ms");
        }
        assert_eq!((protocol.counters().timeouts, protocol.counters().acks_sent), (0, 0));
    }

    #[test]
    fn a_result_reordered_within_the_allowance_is_not_taken_as_lost() {
        let start = Instant::now();
        let (mut protocol, first) = measured(start, 12);
        protocol.handle_datagram(start + 11 * MS, &result_of(&first[2]), &mut Numbers);
        // Slot 1's result comes 11.9 ms behind slot 2's: nothing is asked or sent again.
        let late = start + 11 * MS + Duration::from_micros(11_900);
        assert_eq!(protocol.handle_datagram(late, &result_of(&first[1]), &mut Numbers), Delivery::Accepted);
        protocol.handle_timeout(late);
        let next = sent(&mut protocol, late);
        assert_eq!(next.len(), 2, "the next blocks of slots 1 and 2");
        assert!(next
            .iter()
            .all(|p| parsed(p).message_type == MessageType::Data && parsed(p).flags == Flags::NONE));
        assert_eq!((protocol.counters().timeouts, protocol.counters().acks_sent), (0, 0));
    }

    #[test]
    fn an_unanswered_recovery_is_sent_again_when_its_answer_is_overdue_twice_then_backs_off() {
        let start = Instant::now();
        let (mut protocol, first) = overtaken(start, 4);
        protocol.handle_datagram(start + 28 * MS, &result_of(&first[3]), &mut Numbers);
        // The request's answer took 4 ms: the answers' timeout is 4 ms and four
        // deviations of 2 ms. The retransmission at 27 ms is lost, and so are the two
        // after it.
        let resent_at = |protocol: &mut WorkerProtocol, at: Instant| {
            protocol.handle_timeout(at - Duration::from_nanos(1));
            assert!(sent(protocol, at).is_empty(), "not before {:?}", at - start);
            protocol.handle_timeout(at);
            let again: Vec<_> =
                sent(protocol, at).iter().map(|p| (parsed(p).slot, parsed(p).flags)).collect();
            assert_eq!(again, [(1, Flags::RETRANSMISSION)], "at {:?}", at - start);
        };
        resent_at(&mut protocol, start + 39 * MS);
        resent_at(&mut protocol, start + 51 * MS);
        // Then the slot's timer, backed off to its ceiling of 80 ms.
        resent_at(&mut protocol, start + 131 * MS);
        protocol.handle_datagram(start + 135 * MS, &result_of(&first[1]), &mut Numbers);
        assert_eq!(protocol.status(), &JobStatus::Done);
    }
}
