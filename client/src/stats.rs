//! Counters of a context: jobs, and the packets of every worker thread.

use std::fmt;

use netagg_aggregator::worker::WorkerCounters;

/// What a context has done since it started or its stats were reset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    pub jobs_submitted: u64,
    pub jobs_finished: u64,
    pub jobs_failed: u64,
    pub elements_submitted: u64,
    /// Per worker thread: packets, acks, retransmissions, results, duplicates, timeouts.
    pub threads: Vec<WorkerCounters>,
}

impl Stats {
    pub(crate) fn new(threads: usize) -> Stats {
        Stats {
            jobs_submitted: 0,
            jobs_finished: 0,
            jobs_failed: 0,
            elements_submitted: 0,
            threads: vec![WorkerCounters::default(); threads],
        }
    }

    /// All threads' counters added up.
    pub fn total(&self) -> WorkerCounters {
        self.threads.iter().fold(WorkerCounters::default(), |sum, thread| sum + *thread)
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "jobs: {} submitted, {} finished, {} failed; {} elements",
            self.jobs_submitted, self.jobs_finished, self.jobs_failed, self.elements_submitted
        )?;
        for (thread, c) in self.threads.iter().enumerate() {
            writeln!(
                f,
                "thread {thread}: sent {} packets, {} bytes ({} data, {} acks, {} retransmitted), received {} results, {} bytes ({} duplicates, {} stale, {} rejected), {} timeouts",
                c.packets_sent,
                c.bytes_sent,
                c.data_sent,
                c.acks_sent,
                c.retransmissions,
                c.results_received,
                c.bytes_received,
                c.duplicates,
                c.stale,
                c.rejected,
                c.timeouts
            )?;
        }
        Ok(())
    }
}
