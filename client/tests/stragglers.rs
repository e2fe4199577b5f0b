//! Retransmissions only for real loss, through a real switch on loopback: a session's
//! first job, the next session's, and jobs with a rank that starts late by many timeouts
//! resend nothing; a late rank costs the others a few header-only probes per thread.

mod common;

use std::time::Duration;

use common::{contexts, Switch};
use netagg::{Context, ThreadCounters};

const NUMEL: usize = 1 << 20;

/// One allreduce on every context; rank `late` submits `delay` after the others. Checks
/// the sums.
fn allreduce_with_late_rank(contexts: &[Context], late: usize, delay: Duration) {
    let ranks = contexts.len() as i32;
    std::thread::scope(|scope| {
        for (rank, context) in (0..).zip(contexts) {
            scope.spawn(move || {
                if rank as usize == late {
                    std::thread::sleep(delay);
                }
                let mut data: Vec<i32> = (0..NUMEL as i32).map(|i| i ^ rank).collect();
                context.allreduce(&mut data).unwrap();
                let expected = |i: i32| (0..ranks).map(|r| i ^ r).fold(0i32, i32::wrapping_add);
                let wrong = (0..NUMEL as i32).zip(&data).filter(|&(i, &v)| v != expected(i)).count();
                assert_eq!(wrong, 0, "rank {rank}: {wrong} sums wrong");
            });
        }
    });
}

fn threads(context: &Context) -> Vec<ThreadCounters> {
    context.stats().threads
}

#[test]
fn the_first_job_of_a_session_and_of_the_next_on_the_same_switch_resend_nothing() {
    let switch = Switch::start(&[]);
    for session in 0..2 {
        let contexts = contexts(&switch, 4, |config| config.general.num_worker_threads = 2);
        allreduce_with_late_rank(&contexts, usize::MAX, Duration::ZERO);
        for (rank, context) in contexts.iter().enumerate() {
            for (thread, counters) in threads(context).iter().enumerate() {
                let blocks = counters.results_received;
                assert_eq!(
                    (counters.retransmissions, counters.data_sent),
                    (0, blocks),
                    "session {session}, rank {rank}, thread {thread}: every block sent once"
                );
            }
        }
    }
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "a debug switch takes longer than a timeout to serve a window, which the waiting ranks rightly probe: scripts/test runs this file with cargo test --release"
)]
fn a_rank_late_by_many_timeouts_costs_the_others_a_few_probes_per_thread() {
    let switch = Switch::start(&[]);
    let contexts = contexts(&switch, 4, |config| config.general.num_worker_threads = 2);
    let timeout = netagg::Config::default().general.timeout;
    // Late by 20 timeouts, in each of three jobs; a different rank each time.
    for job in 0..3 {
        allreduce_with_late_rank(&contexts, job + 1, timeout * 20);
    }
    for (rank, context) in contexts.iter().enumerate() {
        for (thread, counters) in threads(context).iter().enumerate() {
            let case = format!("rank {rank}, thread {thread}");
            assert_eq!(counters.retransmissions, 0, "{case}: {counters:?}");
            assert_eq!(counters.data_sent, counters.results_received, "{case}: every block sent once");
            // A probe per 64 slots (two for a thread's 128) per doubling of the timeout:
            // 10, 30, 70 and 150 ms into a wait of 200, in each of the jobs this rank
            // waited in.
            assert!(counters.probes <= 3 * 5 * 2, "{case}: {} probes", counters.probes);
            assert_eq!(counters.packets_sent, counters.data_sent + counters.acks_sent + counters.probes);
            assert_eq!(counters.acks_sent, 0, "{case}: no ack in a dense job, only probes");
        }
        let waited = threads(context).iter().map(|counters| counters.probes).sum::<u64>();
        assert!(waited > 0, "rank {rank} waited for a late rank and probed");
    }
}
