//! How a thread that polls a queue waits while nothing comes.

use std::time::{Duration, Instant};

/// How long a queue must be idle before a napping poller naps, and how long each nap is.
const SPIN_BEFORE_NAPS: Duration = Duration::from_micros(100);
const NAP: Duration = Duration::from_micros(50);

/// How a DPDK endpoint waits for frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollMode {
    /// Polls the queue without pause: the lowest latency, a core per polling thread.
    Busy,
    /// Polls without pause while frames come, naps between polls once the queue has
    /// been idle a while: for cores shared with other work.
    Adaptive,
}

/// One wait for frames, up to a timeout, in a [`PollMode`].
pub struct IdleWait {
    start: Instant,
    timeout: Duration,
    naps: bool,
}

impl IdleWait {
    pub fn new(timeout: Duration, mode: PollMode) -> IdleWait {
        IdleWait { start: Instant::now(), timeout, naps: mode == PollMode::Adaptive }
    }

    /// Pauses before the next poll; false once the timeout has passed.
    pub fn pause(&self) -> bool {
        let waited = self.start.elapsed();
        if waited >= self.timeout {
            return false;
        }
        if self.naps && waited >= SPIN_BEFORE_NAPS {
            std::thread::sleep(NAP.min(self.timeout - waited));
        } else {
            std::hint::spin_loop();
        }
        true
    }
}
