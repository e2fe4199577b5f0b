//! When a lower switch asks its upper switch again about a round: each slot's wait for
//! the upper switch's answer, and the rules that end it.
//!
//! A rack's uplink is often slower than its workers' links together (oversubscribed), so
//! the rounds a rack's switch sends up queue at the uplink, and a round's answer takes as
//! long as the queue ahead of it, up to the queue's whole length (100 ms of tbf's), while
//! the timeout learned from earlier rounds is of a shorter queue. A timer run from the
//! sending then fires on rounds that are only queued: each such request, queued itself,
//! is answered with the result once more, and those duplicates fill the downward queue
//! until it drops results, which cost timeouts in turn (benches/RESULTS.md, issue 32
//! item 5 (b): 40-130 % of the rounds asked after, 1.83 of the model). So:
//! - *Queued*: a round that went up (or was asked after) times out one timeout after the
//!   upper switch's latest answer, not after its own sending: while answers come, the
//!   uplink moves and the round may be behind them in its queue.
//! - *Overtaken*: a round still unanswered when the answer of one first sent after it has
//!   come is taken as lost once a reorder allowance has passed (RACK's rule, RFC 8985,
//!   `overtaking`, which a worker's thread applies too): the uplink is one queue, so a
//!   later round's answer means this one's is lost, or comes out of order by at most as
//!   much as the racks' orders of completing rounds differ. Only a round that went up
//!   once overtakes: the answer of one asked after may be its first sending's, and read
//!   as the request's it took every round sent before the request as lost, and each of
//!   their requests did the same (at 4:1, 1.3 requests per round). But a round sent
//!   again, or asked after, is overtaken as its latest sending (RACK's rule keeps the
//!   latest transmission): else a lost request waits for a timeout from the latest
//!   answer to any round, which keeps moving while the others are answered.
//! - *Held*: a round the upper switch said it holds (it waits for other racks), or a
//!   round this group is silent in, times out one timeout after the wait began: nothing
//!   of it is in the uplink's queue.
//!
//! The timeout follows the rounds' measured round trips (RFC 6298, Karn's rule) from a
//! floor to a ceiling, and doubles on every timeout of a slot (not on an overtaken
//! round, which is a loss found, not a silence) until the slot's next round.

use std::time::{Duration, Instant};

use crate::overtaking::{Overtaken, Sending, Sendings};
use crate::worker::RttEstimate;

/// Sendings kept, per slot, for answers to overtake: enough for a slot's every sending
/// within a few round trips, while none overtakes (answers only to requests, say).
const SENDINGS_PER_SLOT: usize = 4;

/// Every slot's wait for the upper switch, and the round trips that time them.
#[derive(Debug)]
pub(super) struct Waits {
    slots: Box<[Option<Wait>]>,
    /// Per slot: its timeout, the base one doubled on every timeout of its round.
    timeouts: Box<[Duration]>,
    /// Per slot: when its round went up, while it has gone only once: its answer then
    /// times the round trip.
    timed: Box<[Option<Instant>]>,
    rtt: Option<RttEstimate>,
    /// A slot's timeout before any doubling, from `rtt` within `floor` and `ceiling`.
    base_timeout: Duration,
    floor: Duration,
    ceiling: Duration,
    /// The rounds' sendings, in the order they went up. The answer of one sent once
    /// takes every earlier one still waiting in the queue as overtaken.
    sendings: Sendings<Instant, ()>,
    /// When the upper switch last answered a round of this session.
    last_answer: Option<Instant>,
    /// No slot's deadline is earlier (a queued one's may have moved later since).
    earliest: Option<Instant>,
}

/// One slot's wait.
#[derive(Debug, Clone, Copy)]
struct Wait {
    /// When its round last went up or was asked after, or when it began to wait.
    since: Instant,
    /// When it times out, for a queued wait as of the latest answer it has seen.
    deadline: Instant,
    kind: WaitKind,
}

impl Wait {
    /// Whether this wait is still the queued one that `sending` began: a slot's entry of
    /// an earlier wait than its current one is stale.
    fn waits_on(&self, sending: &Sending<Instant, ()>) -> bool {
        self.since == sending.sent && self.kind == WaitKind::Queued
    }
}

/// Where a slot's round is, as far as this switch can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WaitKind {
    /// In the uplink's queue, or lost on the way.
    Queued,
    /// Lost, unless its answer comes within the reorder allowance.
    Overtaken,
    /// At the upper switch, waiting for other racks; or a round this group is silent in.
    Held,
}

impl Waits {
    /// No slot waiting, with timeouts of `floor` until round trips are measured, and at
    /// most `ceiling`.
    pub(super) fn new(slots: usize, floor: Duration, ceiling: Duration) -> Waits {
        let ceiling = ceiling.max(floor);
        Waits {
            slots: vec![None; slots].into_boxed_slice(),
            timeouts: vec![floor; slots].into_boxed_slice(),
            timed: vec![None; slots].into_boxed_slice(),
            rtt: None,
            base_timeout: floor,
            floor,
            ceiling,
            sendings: Sendings::new(),
            last_answer: None,
            earliest: None,
        }
    }

    /// `slot`'s round went up at `now` for the first time: its timeout starts from the
    /// base one, and its answer times the round trip and may overtake earlier rounds.
    pub(super) fn sent_first(&mut self, slot: u16, now: Instant) {
        self.timeouts[slot as usize] = self.base_timeout;
        self.timed[slot as usize] = Some(now);
        self.queued(slot, now);
    }

    /// `slot`'s round went up again, or was asked after, at `now`: it waits behind the
    /// uplink's queue once more, and rounds first sent after it overtake it as they would
    /// a first sending; its own answer, which may be the first sending's, times nothing
    /// and overtakes nothing (Karn's rule; RACK's, RFC 8985 §6.2 step 2).
    pub(super) fn sent_again(&mut self, slot: u16, now: Instant) {
        self.timed[slot as usize] = None;
        self.queued(slot, now);
    }

    /// `slot`'s round is at the upper switch, or this group is silent in it: it waits
    /// for the other racks from `now`, its timer unmoved by other rounds' answers.
    pub(super) fn held(&mut self, slot: u16, now: Instant) {
        self.wait(slot, now, WaitKind::Held);
    }

    /// The upper switch answered about `slot` at `now` without its result (a pending
    /// notice): the uplink moves, and the answer times no round trip, being a wait for
    /// the other racks or the answer to a request.
    pub(super) fn noticed(&mut self, slot: u16, now: Instant) {
        self.timed[slot as usize] = None;
        self.last_answer = Some(now);
    }

    /// `slot`'s result came at `now`: its wait ends, its timeout is the base one again,
    /// and if it went up once only, its round trip is measured and every round that went
    /// up before it and is still queued is overtaken.
    pub(super) fn answered(&mut self, slot: u16, now: Instant) {
        let index = slot as usize;
        self.slots[index] = None;
        self.timeouts[index] = self.base_timeout;
        self.last_answer = Some(now);
        let Some(sent) = self.timed[index].take() else { return };
        let rtt = RttEstimate::sampled(self.rtt, now.saturating_duration_since(sent));
        self.rtt = Some(rtt);
        self.base_timeout = rtt.timeout(self.floor, self.ceiling);
        self.timeouts[index] = self.base_timeout;
        self.overtaken_before(sent, now, rtt);
    }

    /// Every queued round that went up before `answered` is lost unless its answer comes
    /// within the reorder allowance of `rtt` from `now`.
    fn overtaken_before(&mut self, answered: Instant, now: Instant, rtt: RttEstimate) {
        let mut walk = Overtaken::new(answered, now, rtt);
        // Each entry is checked against its slot's wait here, where the wait changes.
        while let Some((sending, lost_at)) = walk.next(&mut self.sendings, |_| true) {
            let slot = &mut self.slots[sending.slot as usize];
            let Some(wait) = slot.as_mut().filter(|wait| wait.waits_on(&sending)) else { continue };
            wait.kind = WaitKind::Overtaken;
            wait.deadline = lost_at;
            self.earliest = Some(self.earliest.map_or(lost_at, |earliest| earliest.min(lost_at)));
        }
    }

    /// No wait expires before this (a lower bound: [`Waits::expired`] may find that the
    /// wait it stood for was ended or moved, and then moves it on).
    pub(super) fn next_due(&self) -> Option<Instant> {
        self.earliest
    }

    /// The next slot whose wait has run out at `now`, its wait ended, its timeout
    /// doubled if it timed out (not if it was overtaken); `None` once none has.
    pub(super) fn expired(&mut self, now: Instant) -> Option<(u16, WaitKind)> {
        if self.earliest.is_none_or(|earliest| earliest > now) {
            return None;
        }
        let mut earliest: Option<Instant> = None;
        for (index, entry) in self.slots.iter_mut().enumerate() {
            let Some(wait) = entry else { continue };
            if wait.kind == WaitKind::Queued {
                // Answers came after it went up: it may be queued behind what they answered.
                if let Some(answer) = self.last_answer.filter(|&answer| answer > wait.since) {
                    wait.deadline = wait.deadline.max(answer + self.timeouts[index]);
                }
            }
            if wait.deadline > now {
                earliest = Some(earliest.map_or(wait.deadline, |at| at.min(wait.deadline)));
                continue;
            }
            let kind = wait.kind;
            *entry = None;
            self.timed[index] = None;
            if kind != WaitKind::Overtaken {
                self.timeouts[index] = (self.timeouts[index] * 2).min(self.ceiling.max(self.base_timeout));
            }
            // The slots after this one are looked at by the next call.
            return Some((index as u16, kind));
        }
        self.earliest = earliest;
        None
    }

    /// Starts `slot`'s queued wait at `now`, which later rounds' answers may overtake.
    fn queued(&mut self, slot: u16, now: Instant) {
        self.wait(slot, now, WaitKind::Queued);
        let slots = &self.slots;
        let cap = slots.len() * SENDINGS_PER_SLOT;
        self.sendings.forget_stale(cap, |sending| {
            slots[sending.slot as usize].is_some_and(|wait| wait.waits_on(sending))
        });
        self.sendings.push(Sending { sent: now, slot, tag: () });
    }

    /// Starts `slot`'s wait of `kind` at `now`, one timeout long.
    fn wait(&mut self, slot: u16, now: Instant, kind: WaitKind) {
        let deadline = now + self.timeouts[slot as usize];
        self.slots[slot as usize] = Some(Wait { since: now, deadline, kind });
        self.earliest = Some(self.earliest.map_or(deadline, |earliest| earliest.min(deadline)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOOR: Duration = Duration::from_millis(20);
    const CEILING: Duration = Duration::from_secs(1);

    fn ms(millis: u64) -> Duration {
        Duration::from_millis(millis)
    }

    /// Every slot that expires at `now`, in slot order.
    fn expired(waits: &mut Waits, now: Instant) -> Vec<(u16, WaitKind)> {
        std::iter::from_fn(|| waits.expired(now)).collect()
    }

    #[test]
    fn a_round_queued_behind_answered_rounds_does_not_time_out_while_answers_come() {
        let start = Instant::now();
        let mut waits = Waits::new(8, FLOOR, CEILING);
        // A burst of 8 rounds into a slow uplink: each answer comes 15 ms after the one
        // before, so the last round waits 120 ms, six times the 20 ms floor.
        for slot in 0..8 {
            waits.sent_first(slot, start + Duration::from_micros(u64::from(slot)));
        }
        for slot in 0..8u16 {
            let now = start + ms(15) * (u32::from(slot) + 1);
            assert_eq!(expired(&mut waits, now), [], "slot {slot}'s answer is next");
            waits.answered(slot, now);
        }
        assert_eq!(expired(&mut waits, start + ms(500)), []);
    }

    #[test]
    fn a_queued_round_times_out_one_timeout_after_the_latest_answer_and_backs_off() {
        let start = Instant::now();
        let mut waits = Waits::new(2, FLOOR, CEILING);
        waits.sent_first(0, start);
        waits.sent_first(1, start + ms(1));
        // Slot 0's answer is the last: slot 1 (a loss, or a lost answer) waits a timeout
        // from it, and it was sent within the reorder allowance of slot 0.
        waits.answered(0, start + ms(10));
        assert_eq!(expired(&mut waits, start + ms(29)), []);
        let rtt_timeout = RttEstimate::sampled(None, ms(10)).timeout(FLOOR, CEILING);
        assert_eq!(rtt_timeout, ms(30), "10 ms and 4 deviations of 5");
        // Slot 1's timeout was the floor when it went up, counted from the answer.
        assert_eq!(expired(&mut waits, start + ms(30)), [(1, WaitKind::Queued)]);
        waits.sent_again(1, start + ms(30));
        // Doubled: 40 ms from the request, the latest event of the uplink.
        assert_eq!(expired(&mut waits, start + ms(69)), []);
        assert_eq!(expired(&mut waits, start + ms(70)), [(1, WaitKind::Queued)]);
    }

    #[test]
    fn a_round_overtaken_by_a_later_round_s_answer_is_lost_after_the_reorder_allowance() {
        let start = Instant::now();
        let mut waits = Waits::new(4, FLOOR, CEILING);
        for slot in 0..4 {
            waits.sent_first(slot, start + ms(u64::from(slot)));
        }
        waits.answered(0, start + ms(10));
        // Slot 1 is lost: slot 2's answer comes, 10 ms after it went up. Round trips of
        // 10 ms and 10 ms: an allowance of 5 + 2 × 3.75 = 12.5 ms from that answer.
        waits.answered(2, start + ms(12));
        assert_eq!(expired(&mut waits, start + ms(24)), [], "within the allowance");
        assert_eq!(expired(&mut waits, start + ms(25)), [(1, WaitKind::Overtaken)]);
        // A loss found is no silence: its timeout, the floor when it went up, stays.
        assert_eq!(waits.timeouts[1], FLOOR);
        // Slot 3 went up after slot 2: queued still, a timeout from the latest answer.
        assert_eq!(expired(&mut waits, start + ms(31)), []);
        assert_eq!(expired(&mut waits, start + ms(32)), [(3, WaitKind::Queued)]);
    }

    #[test]
    fn the_answer_of_a_round_asked_after_overtakes_nothing() {
        let start = Instant::now();
        let mut waits = Waits::new(3, FLOOR, CEILING);
        // 10 ms round trips: a timeout of 30 ms, an allowance of 15.
        waits.sent_first(2, start);
        waits.answered(2, start + ms(10));
        waits.sent_first(0, start + ms(11));
        waits.sent_first(1, start + ms(12));
        // Slot 0 is asked after; the answer may be its first sending's, so slot 1, sent
        // before the request, may still be queued: it waits a timeout from that answer.
        waits.sent_again(0, start + ms(20));
        waits.answered(0, start + ms(21));
        assert_eq!(expired(&mut waits, start + ms(50)), []);
        assert_eq!(expired(&mut waits, start + ms(51)), [(1, WaitKind::Queued)]);
    }

    #[test]
    fn a_round_asked_after_is_overtaken_by_rounds_sent_after_the_request() {
        let start = Instant::now();
        let mut waits = Waits::new(4, FLOOR, CEILING);
        // 10 ms round trips: slot 0's timeout is 30 ms, and slot 1's answer takes it as
        // lost at 34.5 ms (an allowance of 12.5).
        waits.sent_first(1, start);
        waits.answered(1, start + ms(10));
        waits.sent_first(0, start + ms(11));
        waits.sent_first(1, start + ms(12));
        waits.answered(1, start + ms(22));
        assert_eq!(expired(&mut waits, start + ms(35)), [(0, WaitKind::Overtaken)]);
        // Asked after at 35 ms, and the request or its answer is lost. Slots 1-3 take
        // turns: a round goes up every 10 ms and is answered 10 ms later, so the latest
        // answer keeps moving; the first answer of a round sent after the request
        // overtakes it.
        waits.sent_again(0, start + ms(35));
        let due_by = ms(35) + waits.timeouts[0] + RttEstimate::sampled(None, ms(10)).reorder_allowance();
        let mut in_flight = None;
        let mut slot_0_expired = None;
        for tick in 36..300 {
            let now = start + ms(tick);
            if tick % 10 == 6 {
                if let Some(slot) = in_flight.take() {
                    waits.answered(slot, now);
                }
                let slot = 1 + (tick / 10 % 3) as u16;
                waits.sent_first(slot, now);
                in_flight = Some(slot);
            }
            let expired = expired(&mut waits, now);
            if !expired.is_empty() {
                assert_eq!(expired, [(0, WaitKind::Overtaken)], "at {tick} ms");
                slot_0_expired = Some(tick);
                break;
            }
        }
        // Within one timeout and an allowance of the request, not once answers stop.
        assert!(
            slot_0_expired.is_some_and(|tick| ms(tick) <= due_by),
            "slot 0 expired at {slot_0_expired:?} ms, not by {due_by:?}"
        );
    }

    #[test]
    fn sendings_no_answer_overtakes_are_forgotten_once_stale_or_at_the_cap() {
        let start = Instant::now();
        let mut waits = Waits::new(2, FLOOR, CEILING);
        // Slot 0's round stays queued at the front; slot 1 is asked after again and
        // again, and the answers, to requests, overtake nothing.
        waits.sent_first(0, start);
        let cap = 2 * SENDINGS_PER_SLOT;
        for tick in 1..cap as u64 {
            waits.sent_again(1, start + ms(tick));
            waits.noticed(1, start + ms(tick));
        }
        assert_eq!(waits.sendings.len(), cap);
        // At the cap slot 0's sending goes, left to its timer, and every stale one of
        // slot 1 behind it.
        waits.sent_again(1, start + ms(cap as u64));
        assert_eq!(waits.sendings.len(), 1);
        // A held round's sending is stale: the next sending drops it from the front.
        waits.sent_first(0, start + ms(20));
        waits.held(1, start + ms(21));
        waits.sent_again(0, start + ms(22));
        assert_eq!(waits.sendings.len(), 1);
    }

    #[test]
    fn a_held_round_times_out_from_its_wait_whatever_other_rounds_answers_say() {
        let start = Instant::now();
        let mut waits = Waits::new(3, FLOOR, CEILING);
        waits.sent_first(0, start);
        waits.sent_first(1, start + ms(1));
        waits.sent_first(2, start + ms(2));
        // The upper switch holds slot 0's round for the other rack; later rounds' answers
        // neither overtake nor postpone it.
        waits.noticed(0, start + ms(5));
        waits.held(0, start + ms(5));
        waits.answered(1, start + ms(10));
        waits.answered(2, start + ms(20));
        assert_eq!(expired(&mut waits, start + ms(24)), []);
        assert_eq!(expired(&mut waits, start + ms(25)), [(0, WaitKind::Held)]);
        assert_eq!(waits.timeouts[0], 2 * FLOOR, "a silence: doubled");
    }

    #[test]
    fn only_rounds_answered_after_one_sending_time_the_path() {
        let start = Instant::now();
        let mut waits = Waits::new(1, FLOOR, CEILING);
        waits.sent_first(0, start);
        waits.sent_again(0, start + ms(40));
        waits.answered(0, start + ms(45));
        assert!(waits.rtt.is_none(), "an answer to a round sent twice times nothing");
        waits.sent_first(0, start + ms(50));
        waits.noticed(0, start + ms(60));
        waits.held(0, start + ms(60));
        waits.answered(0, start + ms(100));
        assert!(waits.rtt.is_none(), "a held round's answer times the other racks");
        waits.sent_first(0, start + ms(100));
        waits.answered(0, start + ms(110));
        assert_eq!(waits.base_timeout, ms(30), "10 ms and 4 deviations of 5");
    }
}
