//! Connections destroyed on a thread of their own, so that no data path or shutdown waits
//! for the kernel.
//!
//! Destroying a queue pair can block in the kernel: on Soft-RoCE (rxe, Linux 6.1)
//! `rdma_destroy_qp` of a queue pair whose peer host vanished was seen to wait about 50 s.
//! Dropped inline, such a connection would stall a switch's lane, and every session it
//! serves, or hold up a worker's `Context::stop` long after its job had failed. A
//! [`Reaper`] takes what is to be destroyed over a channel and drops it on its own thread,
//! in the order handed over. At its end it waits a bounded time for what is still being
//! destroyed, then leaves that to finish in the background and says so: the process goes
//! on, though its exit may still wait in the kernel for the destruction to end.
//!
//! It is generic over what it drops so that its behaviour is tested with values whose
//! drop blocks for as long as a test says, which no verbs object can be made to do.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The name of every reaper's thread.
pub const THREAD_NAME: &str = "netagg-rdma-reaper";

/// How long a reaper's end waits for what it is still destroying: far more than
/// destroying a connection to a live peer takes (well under a millisecond on Soft-RoCE),
/// and short next to a job's timeout.
pub const FINISH_WAIT: Duration = Duration::from_secs(1);

/// A destruction that takes longer than this is logged: a peer that vanished, most likely.
const SLOW_DESTRUCTION: Duration = Duration::from_secs(1);

/// A thread that drops what it is handed, in order, until its owner ends it.
pub struct Reaper<T: Send + 'static> {
    /// `None` once ended: the thread then ends when it has dropped everything.
    to_drop: Option<mpsc::Sender<T>>,
    /// Disconnected when the thread ends, so that its end can be awaited with a timeout.
    ended: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
    /// Handed over and not yet dropped, for the word left at the end.
    pending: Arc<AtomicUsize>,
    /// What is dropped, plural, for the log: "RDMA connections".
    what: &'static str,
}

/// What became of what a reaper was handed when it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Everything was dropped, and the thread joined.
    Done,
    /// So many were still being dropped when the wait ran out: the thread goes on
    /// without an owner until it has dropped them.
    LeftBehind(usize),
}

impl<T: Send + 'static> Reaper<T> {
    /// Starts the thread; `what` names what it drops, plural, in its log lines.
    pub fn start(what: &'static str) -> io::Result<Reaper<T>> {
        let (to_drop, received) = mpsc::channel::<T>();
        let (ended_sender, ended) = mpsc::channel::<()>();
        let pending = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&pending);
        let thread = std::thread::Builder::new().name(THREAD_NAME.into()).spawn(move || {
            // Held until the thread ends: its disconnection is the end's signal.
            let _ended = ended_sender;
            for value in received {
                let started = Instant::now();
                drop(value);
                let took = started.elapsed();
                if took >= SLOW_DESTRUCTION {
                    tracing::info!(?took, "destroying one of the {what} took long: its peer vanished?");
                }
                counted.fetch_sub(1, Ordering::AcqRel);
            }
        })?;
        Ok(Reaper { to_drop: Some(to_drop), ended, thread: Some(thread), pending, what })
    }

    /// Hands `value` to the thread to drop; returns at once.
    pub fn reap(&self, value: T) {
        let Some(to_drop) = &self.to_drop else { return drop(value) };
        self.pending.fetch_add(1, Ordering::AcqRel);
        // The thread ends only once the sender is gone, so it is there to receive;
        // were it gone (a panic in a drop), the value comes back and is dropped here.
        if let Err(mpsc::SendError(value)) = to_drop.send(value) {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            drop(value);
        }
    }

    /// Ends the reaper: waits up to `wait` for everything handed over to be dropped, and
    /// otherwise leaves the thread to finish alone, saying so in the log.
    pub fn finish(mut self, wait: Duration) -> Ending {
        self.end(wait)
    }

    fn end(&mut self, wait: Duration) -> Ending {
        let Some(thread) = self.thread.take() else { return Ending::Done };
        self.to_drop = None;
        match self.ended.recv_timeout(wait) {
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // Ended, or ending: joining takes no time.
                let _ = thread.join();
                Ending::Done
            }
            // Nothing is ever sent: only the timeout is left.
            Ok(()) | Err(mpsc::RecvTimeoutError::Timeout) => {
                let left = self.pending.load(Ordering::Acquire);
                if left == 0 {
                    // The last drop ended as the wait did: the thread is leaving.
                    let _ = thread.join();
                    return Ending::Done;
                }
                tracing::warn!(
                    "{left} {} still being destroyed after {wait:?}: left to finish in the background \
                     (a queue pair to a peer host that vanished can take about 50 s to destroy); \
                     the process's exit may wait for them",
                    self.what
                );
                Ending::LeftBehind(left)
            }
        }
    }
}

/// Drops `values` on a reaper of their own, waiting at most [`FINISH_WAIT`] for them: for
/// an owner that lets go of all its connections at once. With none, no thread is started;
/// with no thread to be had, they are dropped here.
pub fn reap_all<T: Send + 'static>(values: impl IntoIterator<Item = T>, what: &'static str) -> Ending {
    let mut values = values.into_iter().peekable();
    if values.peek().is_none() {
        return Ending::Done;
    }
    match Reaper::start(what) {
        Ok(reaper) => {
            values.for_each(|value| reaper.reap(value));
            reaper.finish(FINISH_WAIT)
        }
        Err(error) => {
            tracing::warn!(%error, "cannot start a thread to destroy {what}: destroying them here");
            values.for_each(drop);
            Ending::Done
        }
    }
}

impl<T: Send + 'static> Drop for Reaper<T> {
    /// Ends the reaper as [`Reaper::finish`] does, waiting [`FINISH_WAIT`].
    fn drop(&mut self) {
        self.end(FINISH_WAIT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value whose drop waits until its gate opens (or is dropped), then says on which
    /// thread it was dropped. Never more than ten seconds: a reaper that dropped it inline
    /// fails the test rather than hangs it.
    struct Gated {
        gate: mpsc::Receiver<()>,
        dropped: mpsc::Sender<(usize, String)>,
        index: usize,
    }

    impl Drop for Gated {
        fn drop(&mut self) {
            let _ = self.gate.recv_timeout(Duration::from_secs(10));
            let thread = std::thread::current().name().unwrap_or_default().to_string();
            let _ = self.dropped.send((self.index, thread));
        }
    }

    /// Where a [`Gated`] value says it was dropped: its index and the thread's name.
    type Told = mpsc::Receiver<(usize, String)>;

    /// `count` gated values, their gates' keys, and where their drops are told.
    fn gated(count: usize) -> (Vec<Gated>, Vec<mpsc::Sender<()>>, Told) {
        let (dropped, told) = mpsc::channel();
        let (values, keys) = (0..count)
            .map(|index| {
                let (key, gate) = mpsc::channel();
                (Gated { gate, dropped: dropped.clone(), index }, key)
            })
            .unzip();
        (values, keys, told)
    }

    #[test]
    fn what_is_reaped_is_dropped_in_order_on_the_reaper_s_thread_and_the_end_joins_it() {
        let (values, keys, told) = gated(3);
        // Open gates: each drop returns at once.
        drop(keys);
        let reaper = Reaper::start("values").unwrap();
        for value in values {
            reaper.reap(value);
        }
        assert_eq!(reaper.finish(Duration::from_secs(60)), Ending::Done);
        let drops: Vec<(usize, String)> = told.try_iter().collect();
        let expected: Vec<(usize, String)> = (0..3).map(|index| (index, THREAD_NAME.to_string())).collect();
        assert_eq!(drops, expected);
    }

    /// The mechanism that keeps a data path serving: handing over a value whose drop
    /// blocks returns at once, and so does handing over the next one, queued behind it.
    #[test]
    fn reaping_never_waits_for_a_drop_that_blocks() {
        let (mut values, keys, told) = gated(2);
        let reaper = Reaper::start("values").unwrap();
        let second = values.pop().unwrap();
        reaper.reap(values.pop().unwrap());
        reaper.reap(second);
        // Both handed over, and neither dropped: the first drop waits for its key.
        assert_eq!(told.recv_timeout(Duration::from_millis(50)), Err(mpsc::RecvTimeoutError::Timeout));
        assert_eq!(reaper.pending.load(Ordering::Acquire), 2);
        for key in &keys {
            key.send(()).unwrap();
        }
        assert_eq!(told.recv().unwrap().0, 0);
        assert_eq!(told.recv().unwrap().0, 1);
        assert_eq!(reaper.finish(Duration::from_secs(60)), Ending::Done);
    }

    /// An end whose drops block returns once its wait is over, with how many were left
    /// behind; the thread goes on alone and drops them once they unblock.
    #[test]
    fn an_end_waits_its_bound_then_leaves_blocked_drops_to_finish_alone() {
        let (values, keys, told) = gated(2);
        let reaper = Reaper::start("values").unwrap();
        for value in values {
            reaper.reap(value);
        }
        let wait = Duration::from_millis(100);
        let started = Instant::now();
        assert_eq!(reaper.finish(wait), Ending::LeftBehind(2));
        assert!(started.elapsed() >= wait);
        assert_eq!(told.try_recv(), Err(mpsc::TryRecvError::Empty));
        // Opened later, the gates let the orphaned thread drop both, on its own thread.
        for key in keys {
            key.send(()).unwrap();
        }
        for index in 0..2 {
            assert_eq!(told.recv().unwrap(), (index, THREAD_NAME.to_string()));
        }
    }

    /// Letting go of everything at once: each dropped on a reaper's thread, and nothing
    /// started for nothing.
    #[test]
    fn reaping_all_drops_each_on_a_reaper_s_thread_and_none_needs_no_thread() {
        assert_eq!(reap_all(Vec::<Gated>::new(), "values"), Ending::Done);
        let (values, keys, told) = gated(2);
        drop(keys);
        assert_eq!(reap_all(values, "values"), Ending::Done);
        let drops: Vec<(usize, String)> = told.try_iter().collect();
        assert_eq!(drops, [(0, THREAD_NAME.to_string()), (1, THREAD_NAME.to_string())]);
    }

    /// Dropping a reaper ends it as finishing does: what was handed over is dropped.
    #[test]
    fn a_dropped_reaper_drops_what_it_was_handed() {
        let (values, keys, told) = gated(1);
        drop(keys);
        let reaper = Reaper::start("values").unwrap();
        reaper.reap(values.into_iter().next().unwrap());
        drop(reaper);
        assert_eq!(told.try_recv(), Ok((0, THREAD_NAME.to_string())));
    }
}
