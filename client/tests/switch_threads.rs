//! A `netagg-switch` of several data-path threads (`--threads`), end to end: each thread
//! owns a share of every session's slots behind a port of its own, and the workers' threads
//! send each slot's packets to the port that owns it. Lanes drop packets for slots they do
//! not own, so a sum that comes out right was routed right.

mod common;

use std::time::{Duration, Instant};

use common::{contexts, run_verified, Switch};
use netagg::{Error, SparseMode};

/// How long the worker processes of one run may take.
const WITHIN: Duration = Duration::from_secs(120);

#[test]
fn two_switch_threads_sum_int32_exactly_and_float32_within_bound_with_loss_both_ways() {
    // Loss on the way down at the switch, on the way up at the workers.
    let switch = Switch::start(&["--threads", "2", "--faults", "send_drop=0.01,seed=3"]);
    // 3 worker threads: the middle one's slots straddle both switch threads.
    for threads in ["1", "2", "3"] {
        let env = [
            ("NETAGG_GENERAL__NUM_WORKER_THREADS", threads),
            ("NETAGG_GENERAL__MAX_OUTSTANDING_PACKETS", "48"),
            ("NETAGG_FAULTS__SEND_DROP", "0.01"),
            ("NETAGG_FAULTS__SEED", "11"),
            ("NETAGG_GENERAL__TIMEOUT", "2"),
        ];
        run_verified(&switch, 3, &env, &["--numel", "1,255,256,257,100000", "--jobs", "5"], WITHIN);
        let float = ["--type", "float32", "--numel", "100000", "--jobs", "2"];
        run_verified(&switch, 3, &env, &float, WITHIN);
    }
    let stats = switch.stop();
    let faults = stats.lines().find(|l| l.contains("faults injected")).expect("fault counters");
    assert!(common::counter(faults, "send dropped") > 10, "{faults}");
}

/// Rank `r` fills block `b` only where `(b + r) % 3 == 0`: a third of each rank's blocks,
/// none of block 2, 5, 8, ... from either of 2 ranks.
fn sparse_tensor(rank: usize, blocks: usize, packet: usize) -> Vec<i32> {
    (0..blocks * packet - 3)
        .map(|i| if (i / packet + rank) % 3 == 0 { (i as i32 % 997) - 400 + rank as i32 } else { 0 })
        .collect()
}

#[test]
fn two_switch_threads_sum_sparse_and_dense_tensors_exactly() {
    const PACKET: usize = 64;
    const BLOCKS: usize = 500;
    let switch = Switch::start(&["--threads", "2"]);
    for sparse in [SparseMode::Auto, SparseMode::Off] {
        let contexts = contexts(&switch, 2, |config| {
            config.general.packet_numel = PACKET as u16;
            config.general.sparse = sparse;
            config.general.num_worker_threads = 2;
            config.general.max_outstanding_packets = 16;
        });
        let sums: Vec<Vec<i32>> = std::thread::scope(|scope| {
            let ranks: Vec<_> = contexts
                .iter()
                .enumerate()
                .map(|(rank, context)| {
                    scope.spawn(move || {
                        let mut data = sparse_tensor(rank, BLOCKS, PACKET);
                        context.allreduce(&mut data).unwrap();
                        data
                    })
                })
                .collect();
            ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
        });
        let expected: Vec<i32> = sparse_tensor(0, BLOCKS, PACKET)
            .iter()
            .zip(sparse_tensor(1, BLOCKS, PACKET))
            .map(|(a, b)| a + b)
            .collect();
        for (rank, sum) in sums.iter().enumerate() {
            assert!(sum == &expected, "rank {rank}, {sparse:?}: sums differ");
        }
    }
}

#[test]
fn a_rank_that_leaves_mid_job_fails_the_others_at_once_on_every_switch_thread() {
    let switch = Switch::start(&["--threads", "2"]);
    let mut contexts = contexts(&switch, 3, |config| {
        config.general.num_worker_threads = 2;
        config.general.job_timeout = Duration::from_secs(30);
    });
    let leaver = contexts.pop().unwrap();
    let started = Instant::now();
    let errors: Vec<Error> = std::thread::scope(|scope| {
        // Ranks 0 and 1 start a job that needs rank 2 in every slot of both switch
        // threads; rank 2 leaves instead of contributing.
        let jobs: Vec<_> = contexts
            .iter()
            .map(|context| scope.spawn(move || context.allreduce(&mut vec![1i32; 1 << 20]).unwrap_err()))
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        drop(leaver);
        jobs.into_iter().map(|job| job.join().unwrap()).collect()
    });
    for error in errors {
        assert!(matches!(&error, Error::SessionLost(m) if m.contains("rank 2 left session")), "{error:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(5), "failed after {:?}, not at once", started.elapsed());
}
