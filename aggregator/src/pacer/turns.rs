//! How a worker's threads share the turns of their pacer's schedule.
//!
//! Every rank cuts a job into one contiguous share per thread (`worker::thread_blocks`),
//! and a job ends only when its last thread does. Turns taken as they come go to
//! whichever thread asks first, and under loss a thread whose slots wait on recoveries
//! falls behind and stays behind: in `tests/lossy_links.rs` one thread of a worker ended
//! its share 76-231 ms before the other, and the one left alone, its slots half parked on
//! recoveries, kept the link at 4-36 Mbit/s of its 50. So a due turn goes first to the
//! thread that has the most first sendings of its share left and holds one back; the
//! others take it once it has gone untaken for [`QUANTUM`], so that a thread slow to
//! wake costs the link that long at most. Retransmissions are not ordered: they repair
//! rounds every worker waits on.

use super::QUANTUM;
use std::time::Instant;

/// One thread's standing.
#[derive(Debug, Clone, Copy, Default)]
struct Standing {
    /// First sendings of its dense share still to make; `None` in a sparse job, whose
    /// shares hold unequal counts of blocks to send.
    left: Option<u32>,
    /// It holds a data packet back for the pacer.
    holding: bool,
}

/// The standing of each thread that shares a pacer, by the turn index it joined with.
#[derive(Debug, Clone, Default)]
pub(crate) struct Turns {
    threads: Vec<Standing>,
}

impl Turns {
    /// A thread joins; its index names it from now on.
    pub(super) fn join(&mut self) -> usize {
        self.threads.push(Standing::default());
        self.threads.len() - 1
    }

    /// Thread `thread` has `left` first sendings of its share still to make.
    pub(super) fn set_left(&mut self, thread: usize, left: Option<u32>) {
        if let Some(standing) = self.threads.get_mut(thread) {
            standing.left = left;
        }
    }

    /// Thread `thread` holds, or no longer holds, a data packet back.
    pub(super) fn set_holding(&mut self, thread: usize, holding: bool) {
        if let Some(standing) = self.threads.get_mut(thread) {
            standing.holding = holding;
        }
    }

    /// Whether thread `thread` leaves a turn due at `due` to another, at `now`: one holding
    /// a packet back with more of its share left, while the turn is fresh.
    pub(super) fn yields(&self, thread: usize, due: Instant, now: Instant) -> bool {
        now < due + QUANTUM && self.behind(thread)
    }

    /// Whether a thread holding a packet back has more of its share left than `thread`.
    pub(super) fn behind(&self, thread: usize) -> bool {
        let Some(mine) = self.threads.get(thread).and_then(|standing| standing.left) else {
            return false;
        };
        self.threads.iter().enumerate().any(|(other, standing)| {
            other != thread && standing.holding && standing.left.is_some_and(|left| left > mine)
        })
    }
}
