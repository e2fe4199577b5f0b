//! Runs of a thread's first sendings found lost, which show a queue's overflow.

use super::OVERFLOW_RUN;

/// First sendings, counted back from the latest found lost, whose losses are kept: more
/// than a window of slots, so that a burst's losses found in any order fall within it.
const LOST_SPAN: u64 = 256;

/// A thread's first sendings of data, numbered in the order they left, and which of the
/// latest [`LOST_SPAN`] of them were found lost. A queue that overflows drops the tail of
/// every burst offered to it: a window many times the queue, sent at once, loses all but
/// its first few packets, in a row. Random loss drops packets apart. A queue too short to
/// show delay (a packet or two, less than the target) so still engages the pacer, and a
/// worker whose round trips are nearly all lost, and so seldom timed, leaves its collapse.
///
/// A run is found whatever order its losses come to light in: behind a shaper's bucket
/// the survivors' next blocks, sent after the burst, are found lost before the burst's
/// own tail, whose slots time out later. Taken in the order found, such losses broke
/// every run, and the pacer never engaged (dense jobs behind an 8 KB bucket and a 2 KB
/// queue at 10 Mbit/s took 22-31 times the link's time).
#[derive(Debug, Default)]
pub(crate) struct LossRuns {
    /// First sendings so far.
    pub(super) sent: u64,
    /// The pacer's cuts of its rate when the thread last looked, and its first sending
    /// after the last of them: losses of earlier ones say nothing of the rate now.
    pub(super) cuts_seen: u64,
    pub(super) since: u64,
    /// The latest first sending found lost.
    latest: u64,
    /// Which of the [`LOST_SPAN`] first sendings up to `latest` were found lost, and not
    /// yet taken in an overflow: bit `number % LOST_SPAN`.
    lost: [u64; (LOST_SPAN / 64) as usize],
}

impl LossRuns {
    /// Numbers a first sending.
    pub(crate) fn first_sending(&mut self) -> u64 {
        self.sent += 1;
        self.sent
    }

    /// Notes that first sending `number` was found lost; true while that makes a run of
    /// at least [`OVERFLOW_RUN`] not yet taken as an overflow: the pacer takes one at most
    /// once a round trip, and one it put off shows again with the run's next loss. A
    /// sending found lost again is counted already; one more than [`LOST_SPAN`] before
    /// the latest found is too old to tell.
    pub(crate) fn lost(&mut self, number: u64) -> bool {
        if number + LOST_SPAN <= self.latest {
            return false;
        }
        if number > self.latest {
            // The span moves up: what it leaves behind was sent too long ago.
            for forgotten in (self.latest + 1..=number).take(LOST_SPAN as usize) {
                self.set(forgotten, false);
            }
            self.latest = number;
        }
        if self.is_lost(number) {
            return false;
        }
        self.set(number, true);
        let oldest = self.latest.saturating_sub(LOST_SPAN - 1);
        let limit = OVERFLOW_RUN as u64;
        let below =
            (1..=limit).take_while(|&back| number >= oldest + back && self.is_lost(number - back)).count();
        let above = (1..=limit)
            .take_while(|&ahead| number + ahead <= self.latest && self.is_lost(number + ahead))
            .count();
        below + 1 + above >= OVERFLOW_RUN as usize
    }

    /// The pacer took the run as an overflow: a further one takes another full run.
    pub(crate) fn overflow_taken(&mut self) {
        self.lost = Default::default();
    }

    fn is_lost(&self, number: u64) -> bool {
        let bit = number % LOST_SPAN;
        self.lost[(bit / 64) as usize] & (1 << (bit % 64)) != 0
    }

    fn set(&mut self, number: u64, lost: bool) {
        let bit = number % LOST_SPAN;
        let word = &mut self.lost[(bit / 64) as usize];
        if lost {
            *word |= 1 << (bit % 64);
        } else {
            *word &= !(1 << (bit % 64));
        }
    }
}
