//! RACK's rule (RFC 8985), which both cores apply to the answers they wait for: a packet
//! still unanswered when the answer to one sent after it has come is taken as lost once
//! a reorder allowance has passed, not at its slot's timeout.
//!
//! A worker's thread applies it to its contributions (`worker::early_loss`), a lower
//! switch of a tree to the rounds it sends up (`engine::uplink`). Each keeps the
//! sendings that may be overtaken in a [`Sendings`] queue, in the order they went out,
//! keyed by a clock that orders them (a count of packets, or the time); an answer
//! overtakes the ones before its own sending, and each is judged once. The caller says
//! whether a slot still waits on a sending: a slot that was answered, or has sent anew
//! since, has left a stale entry behind.

use std::time::Instant;

use crate::worker::RttEstimate;

/// A sending that a later one's answer may overtake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sending<T, Tag> {
    /// When it went out, on the caller's clock.
    pub(crate) sent: T,
    pub(crate) slot: u16,
    /// What else the caller checks a slot's wait against (a worker: the round).
    pub(crate) tag: Tag,
}

/// The sendings not yet judged, in the order they went out: a ring whose length is a
/// power of two, the `n`-th sending booked at `n` modulo the length, grown when full.
///
/// A ring of its own rather than a `VecDeque`, whose push a build of 16 codegen units
/// left a call (about 25 instructions a first sending, callgrind): a worker books one
/// per packet.
#[derive(Debug)]
pub(crate) struct Sendings<T, Tag> {
    ring: Vec<Sending<T, Tag>>,
    /// Sendings booked and judged since the start: the ring holds `judged..booked`.
    booked: usize,
    judged: usize,
}

impl<T: Ord + Copy, Tag: Copy> Default for Sendings<T, Tag> {
    fn default() -> Sendings<T, Tag> {
        Sendings::new()
    }
}

impl<T: Ord + Copy, Tag: Copy> Sendings<T, Tag> {
    pub(crate) fn new() -> Sendings<T, Tag> {
        Sendings { ring: Vec::new(), booked: 0, judged: 0 }
    }

    /// Books `sending`, which went out after every one booked before it.
    #[inline]
    pub(crate) fn push(&mut self, sending: Sending<T, Tag>) {
        if self.len() == self.ring.len() {
            self.grow(sending);
        }
        let at = self.booked & (self.ring.len() - 1);
        self.ring[at] = sending;
        self.booked += 1;
    }

    /// Doubles the ring (to 16 sendings at first), the booked ones kept in their order;
    /// `fill` stands in the places not yet booked.
    #[cold]
    fn grow(&mut self, fill: Sending<T, Tag>) {
        let mut ring = vec![fill; (self.ring.len() * 2).max(16)];
        let (new_mask, old_mask) = (ring.len() - 1, self.ring.len().wrapping_sub(1));
        for n in self.judged..self.booked {
            ring[n & new_mask] = self.ring[n & old_mask];
        }
        self.ring = ring;
    }

    pub(crate) fn clear(&mut self) {
        self.judged = self.booked;
    }

    /// The oldest sending not yet judged.
    #[inline]
    pub(crate) fn oldest(&self) -> Option<&Sending<T, Tag>> {
        (self.judged < self.booked).then(|| &self.ring[self.judged & (self.ring.len() - 1)])
    }

    /// Drops the oldest sending, which the caller knows no slot waits on.
    #[inline]
    pub(crate) fn forget_oldest(&mut self) {
        if self.judged < self.booked {
            self.judged += 1;
        }
    }

    /// How many sendings are booked and not yet judged.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.booked - self.judged
    }

    /// Drops the oldest sendings while no slot waits on them (`waits_on` says), or while
    /// `cap` or more are booked, so that one more fits: entries that only an answer would
    /// otherwise drop, when answers that overtake come seldom.
    pub(crate) fn forget_stale(&mut self, cap: usize, mut waits_on: impl FnMut(&Sending<T, Tag>) -> bool) {
        while let Some(oldest) = self.oldest() {
            if self.len() < cap && waits_on(oldest) {
                return;
            }
            self.forget_oldest();
        }
    }
}

/// One answer's walk over the sendings it overtakes: those that went out before the
/// answered one, which leave the queue.
#[derive(Debug)]
pub(crate) struct Overtaken<T> {
    answered: T,
    now: Instant,
    rtt: RttEstimate,
    /// Worked out at the first sending found overtaken: most answers find none, and a
    /// worker walks for every result.
    lost_at: Option<Instant>,
}

impl<T: Ord + Copy> Overtaken<T> {
    /// The walk of an answer, come at `now`, to the sending of `answered`, with the
    /// round trips measured so far.
    #[inline]
    pub(crate) fn new(answered: T, now: Instant, rtt: RttEstimate) -> Overtaken<T> {
        Overtaken { answered, now, rtt, lost_at: None }
    }

    /// The next sending before the answered one that its slot still waits on
    /// (`waits_on` says), and when it is lost: the reorder allowance after the answer.
    /// It and the stale entries before it leave `sendings`; `None` once none is left.
    #[inline]
    pub(crate) fn next<Tag: Copy>(
        &mut self,
        sendings: &mut Sendings<T, Tag>,
        mut waits_on: impl FnMut(&Sending<T, Tag>) -> bool,
    ) -> Option<(Sending<T, Tag>, Instant)> {
        while let Some(&sending) = sendings.oldest() {
            if sending.sent >= self.answered {
                return None;
            }
            sendings.forget_oldest();
            if waits_on(&sending) {
                let lost_at = *self.lost_at.get_or_insert_with(|| self.now + self.rtt.reorder_allowance());
                return Some((sending, lost_at));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn sending(sent: u64, slot: u16) -> Sending<u64, ()> {
        Sending { sent, slot, tag: () }
    }

    /// Sendings 1-5 of slots 1-5, and a round trip of 10 ms: an allowance of 15 ms.
    fn booked() -> (Sendings<u64, ()>, RttEstimate) {
        let mut sendings = Sendings::new();
        for slot in 1..=5 {
            sendings.push(sending(u64::from(slot), slot));
        }
        (sendings, RttEstimate::sampled(None, Duration::from_millis(10)))
    }

    #[test]
    fn an_answer_overtakes_the_waiting_sendings_before_its_own_each_once() {
        let (mut sendings, rtt) = booked();
        let now = Instant::now();
        let lost_at = now + Duration::from_millis(15);
        // Slot 2 was answered: its entry is stale.
        let waits_on = |s: &Sending<u64, ()>| s.slot != 2;
        let mut walk = Overtaken::new(4, now, rtt);
        assert_eq!(walk.next(&mut sendings, waits_on), Some((sending(1, 1), lost_at)));
        assert_eq!(walk.next(&mut sendings, waits_on), Some((sending(3, 3), lost_at)));
        assert_eq!(walk.next(&mut sendings, waits_on), None, "sending 4 is the answered one");
        assert_eq!(sendings.len(), 2);
        let mut again = Overtaken::new(4, now, rtt);
        assert_eq!(again.next(&mut sendings, waits_on), None, "judged once");
        let mut later = Overtaken::new(6, now, rtt);
        assert_eq!(later.next(&mut sendings, |_| false), None);
        assert_eq!(sendings.len(), 0);
    }

    #[test]
    fn sendings_keep_their_order_across_the_rings_wrap_and_growth() {
        let mut sendings = Sendings::new();
        let mut expected = std::collections::VecDeque::new();
        // Booked faster than judged, so that the ring wraps and then grows twice.
        for n in 0..60u64 {
            sendings.push(sending(n, n as u16));
            expected.push_back(sending(n, n as u16));
            if n % 3 == 0 {
                assert_eq!(sendings.oldest(), expected.front());
                sendings.forget_oldest();
                expected.pop_front();
            }
        }
        assert_eq!(sendings.len(), 40);
        while let Some(&oldest) = sendings.oldest() {
            assert_eq!(Some(oldest), expected.pop_front());
            sendings.forget_oldest();
        }
        assert!(expected.is_empty());
        sendings.push(sending(60, 0));
        sendings.clear();
        assert_eq!((sendings.len(), sendings.oldest()), (0, None));
    }

    #[test]
    fn stale_and_surplus_sendings_are_forgotten_from_the_oldest() {
        let (mut sendings, _) = booked();
        // Slot 1 was answered; slot 2 still waits: the walk stops there.
        sendings.forget_stale(10, |s| s.slot != 1 && s.slot != 3);
        assert_eq!(sendings.len(), 4);
        // At a cap of 3, live ones go too, oldest first, and then a stale one at the front.
        sendings.forget_stale(3, |s| s.slot != 3);
        assert_eq!(sendings.len(), 2);
        let mut walk = Overtaken::new(9, Instant::now(), RttEstimate::sampled(None, Duration::ZERO));
        assert_eq!(walk.next(&mut sendings, |_| true).map(|(s, _)| s), Some(sending(4, 4)));
    }
}
