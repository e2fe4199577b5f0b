//! Which of a simulated cluster's worker threads to poll after an event, and when each
//! one's next timer is due.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

/// Which worker threads an event reached since they were last polled, and when each
/// thread's next timer is due (threads by their index in `Cluster::workers`).
#[derive(Debug)]
pub(super) struct Agenda {
    touched: Vec<usize>,
    is_touched: Vec<bool>,
    /// Each thread's armed deadline; entries of `timers` that disagree are stale.
    deadlines: Vec<Option<Instant>>,
    timers: BinaryHeap<Reverse<(Instant, usize)>>,
}

impl Agenda {
    pub(super) fn new(threads: usize) -> Agenda {
        Agenda {
            touched: Vec::new(),
            is_touched: vec![false; threads],
            deadlines: vec![None; threads],
            timers: BinaryHeap::new(),
        }
    }

    pub(super) fn touch(&mut self, thread: usize) {
        if !std::mem::replace(&mut self.is_touched[thread], true) {
            self.touched.push(thread);
        }
    }

    /// The threads touched since the last call, in index order (the order in which a
    /// poll of every thread would meet them, so that runs stay as they were).
    pub(super) fn take_touched(&mut self) -> Vec<usize> {
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable();
        for &thread in &touched {
            self.is_touched[thread] = false;
        }
        touched
    }

    /// Records `thread`'s next deadline, as its `poll_timeout` gives it.
    pub(super) fn arm(&mut self, thread: usize, deadline: Option<Instant>) {
        if self.deadlines[thread] != deadline {
            self.deadlines[thread] = deadline;
            if let Some(at) = deadline {
                self.timers.push(Reverse((at, thread)));
            }
        }
    }

    pub(super) fn next_timer(&mut self) -> Option<Instant> {
        self.drop_stale();
        self.timers.peek().map(|Reverse((at, _))| *at)
    }

    /// A thread whose deadline has come by `now`, touched so that it is polled again.
    pub(super) fn pop_due(&mut self, now: Instant) -> Option<usize> {
        self.drop_stale();
        let &Reverse((at, thread)) = self.timers.peek()?;
        if at > now {
            return None;
        }
        self.timers.pop();
        self.deadlines[thread] = None;
        self.touch(thread);
        Some(thread)
    }

    fn drop_stale(&mut self) {
        while let Some(&Reverse((at, thread))) = self.timers.peek() {
            if self.deadlines[thread] == Some(at) {
                break;
            }
            self.timers.pop();
        }
    }
}
