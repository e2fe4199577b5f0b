//! Runs of a thread's first sendings found lost, which show a queue's overflow.

use super::OVERFLOW_RUN;

/// A thread's first sendings of data, numbered in the order they left, and the run of
/// them found lost last. A queue that overflows drops the tail of every burst offered
/// to it: a window many times the queue, sent at once, loses all but its first few
/// packets, in a row. Random loss drops packets apart. A queue too short to show delay
/// (a packet or two, less than the target) so still engages the pacer, and a worker
/// whose round trips are nearly all lost, and so seldom timed, leaves its collapse.
#[derive(Debug, Default)]
pub(crate) struct LossRuns {
    /// First sendings so far.
    pub(super) sent: u64,
    /// The pacer's cuts of its rate when the thread last looked, and its first sending
    /// after the last of them: losses of earlier ones say nothing of the rate now.
    pub(super) cuts_seen: u64,
    pub(super) since: u64,
    /// The latest first sending found lost.
    pub(super) last_lost: Option<u64>,
    /// Its run: first sendings found lost up to it, one after another.
    pub(super) run: u32,
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
    /// sending found lost again, or after a later one, is counted already or breaks no
    /// run.
    pub(crate) fn lost(&mut self, number: u64) -> bool {
        match self.last_lost {
            Some(last) if number <= last => return false,
            Some(last) if number == last + 1 => self.run += 1,
            _ => self.run = 1,
        }
        self.last_lost = Some(number);
        self.run >= OVERFLOW_RUN
    }

    /// The pacer took the run as an overflow: a further one takes another full run.
    pub(crate) fn overflow_taken(&mut self) {
        self.run = 0;
    }
}
