//! Counters of a context: jobs, and the packets of every worker thread.

use std::fmt;
use std::ops::Add;

use netagg_aggregator::worker::WorkerCounters;

/// What a context has done since it started or its stats were reset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    pub jobs_submitted: u64,
    pub jobs_finished: u64,
    pub jobs_failed: u64,
    pub elements_submitted: u64,
    /// Per worker thread: packets, acks, retransmissions, results, duplicates, timeouts.
    pub threads: Vec<ThreadCounters>,
}

impl Stats {
    pub(crate) fn new(threads: usize) -> Stats {
        Stats {
            jobs_submitted: 0,
            jobs_finished: 0,
            jobs_failed: 0,
            elements_submitted: 0,
            threads: vec![ThreadCounters::default(); threads],
        }
    }

    /// Adds what worker thread `thread`'s protocol counted since it last reported.
    pub(crate) fn add_thread(&mut self, thread: usize, counted: &WorkerCounters) {
        self.threads[thread] = self.threads[thread] + ThreadCounters::from(counted);
    }

    /// All threads' counters added up.
    pub fn total(&self) -> ThreadCounters {
        self.threads.iter().fold(ThreadCounters::default(), |sum, thread| sum + *thread)
    }
}

/// Declares [`ThreadCounters`] with, field by field, `since`, `+` and the conversion from
/// the protocol's counters (the one place the protocol's type becomes the client's).
macro_rules! thread_counters {
    ($(#[$meta:meta])* pub struct ThreadCounters { $($(#[$field_meta:meta])* pub $field:ident: u64,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct ThreadCounters { $($(#[$field_meta])* pub $field: u64,)* }

        impl ThreadCounters {
            /// The events counted since the snapshot `earlier`.
            pub fn since(&self, earlier: &ThreadCounters) -> ThreadCounters {
                ThreadCounters { $($field: self.$field - earlier.$field,)* }
            }

            /// Each counter with its field's name, in declaration order.
            pub fn named(&self) -> impl Iterator<Item = (&'static str, u64)> {
                [$((stringify!($field), self.$field),)*].into_iter()
            }
        }

        impl Add for ThreadCounters {
            type Output = ThreadCounters;
            fn add(self, other: ThreadCounters) -> ThreadCounters {
                ThreadCounters { $($field: self.$field + other.$field,)* }
            }
        }

        impl From<&WorkerCounters> for ThreadCounters {
            fn from(counters: &WorkerCounters) -> ThreadCounters {
                ThreadCounters { $($field: counters.$field,)* }
            }
        }
    };
}

thread_counters! {
    /// What one worker thread sent and received.
    pub struct ThreadCounters {
        /// Datagrams sent: data packets, acks and probes.
        pub packets_sent: u64,
        /// Bytes of the datagrams sent, headers included.
        pub bytes_sent: u64,
        /// Data packets sent, retransmissions included.
        pub data_sent: u64,
        /// Acks sent: which results a slot holds, or a request for one it lacks.
        pub acks_sent: u64,
        /// Data packets sent again: after a timeout with evidence of their loss, or when
        /// the switch said it lacked them.
        pub retransmissions: u64,
        /// Header-only probes sent while every slot of the thread waited (for a late peer,
        /// or results lost at a job's end), asking where up to 64 slots stand, instead of
        /// resending the window.
        pub probes: u64,
        /// Data packets the pacer held back before their first sending, to space them at
        /// the rate the path carries.
        pub paced: u64,
        /// Results received that were new.
        pub results_received: u64,
        /// Bytes of the new results received, headers included.
        pub bytes_received: u64,
        /// Results received that this thread already held.
        pub duplicates: u64,
        /// Results of another job, or for a slot not in use.
        pub stale: u64,
        /// Datagrams refused: malformed, or not a result for this thread (another session,
        /// rank, slot or block, or outside the slot's window of rounds).
        pub rejected: u64,
        /// Datagrams whose checksum did not match: corrupted on their way, dropped, and
        /// recovered as lost.
        pub corrupt: u64,
        /// Pending notices received: the switch held a round open, waiting for a peer, or
        /// (with `LOST`) found one of this thread's first sendings lost.
        pub pending: u64,
        /// Progress reports received, each the switch's answer to a probe.
        pub progress_reports: u64,
        /// Requests for a result sent at once because a gap in the switch's numbering of
        /// its broadcasts showed one lost, rather than after a timeout.
        pub gap_requests: u64,
        /// Contributions sent again at once because the switch's notice (`LOST`) named
        /// their first sending missing, rather than after a timeout.
        pub lost_notices: u64,
        /// Slot timers that fired and sent a retransmission, a request or a probe.
        pub timeouts: u64,
        /// Slices of jobs completed.
        pub jobs_done: u64,
        /// Slices of jobs failed.
        pub jobs_failed: u64,
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
                "thread {thread}: sent {} packets, {} bytes ({} data, {} acks, {} retransmitted, {} probes, {} paced, {} gap requests, {} resent on lost notices), received {} results, {} bytes ({} duplicates, {} stale, {} rejected, {} corrupt, {} pending, {} progress reports), {} timeouts",
                c.packets_sent,
                c.bytes_sent,
                c.data_sent,
                c.acks_sent,
                c.retransmissions,
                c.probes,
                c.paced,
                c.gap_requests,
                c.lost_notices,
                c.results_received,
                c.bytes_received,
                c.duplicates,
                c.stale,
                c.rejected,
                c.corrupt,
                c.pending,
                c.progress_reports,
                c.timeouts
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_s_report_adds_to_its_own_counters_and_the_total() {
        let counted =
            WorkerCounters { packets_sent: 3, bytes_received: 96, jobs_failed: 1, ..Default::default() };
        let mut stats = Stats::new(2);
        stats.add_thread(1, &counted);
        stats.add_thread(1, &counted);
        let expected =
            ThreadCounters { packets_sent: 6, bytes_received: 192, jobs_failed: 2, ..Default::default() };
        assert_eq!(stats.threads, [ThreadCounters::default(), expected]);
        assert_eq!(stats.total(), expected);
        assert_eq!(expected.since(&ThreadCounters::from(&counted)), ThreadCounters::from(&counted));
    }

    #[test]
    fn the_recovery_without_timeouts_is_counted_by_name_and_in_the_text() {
        let counted = WorkerCounters { gap_requests: 3, lost_notices: 2, timeouts: 1, ..Default::default() };
        let mut stats = Stats::new(1);
        stats.add_thread(0, &counted);
        let named: Vec<(&str, u64)> = stats.total().named().filter(|&(_, count)| count > 0).collect();
        assert_eq!(named, [("gap_requests", 3), ("lost_notices", 2), ("timeouts", 1)]);
        let text = stats.to_string();
        assert!(text.contains(", 3 gap requests, 2 resent on lost notices), received"), "{text}");
    }
}
