//! Workers of several threads in the simulator, as the client runs them: each thread its
//! own protocol over a share of the worker's slots and of every job's blocks, all sharing
//! the worker's link and pacer; and jobs run back to back, each rank starting its next as
//! soon as its own last one ended.

use std::time::Duration;

use netagg_aggregator::sim::{Cluster, ClusterConfig, SimError, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Every rank's int32 tensor of `len` elements, every `zero_every`-th block of
/// `block` elements zero on every rank (0: none), and their exact sum.
fn inputs(workers: u16, len: usize, block: usize, zero_every: usize, seed: u64) -> (Vec<Tensor>, Tensor) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let zero = |i: usize| zero_every > 0 && (i / block) % zero_every == 0;
    let inputs: Vec<Vec<i32>> = (0..workers)
        .map(|_| (0..len).map(|i| if zero(i) { 0 } else { rng.gen_range(-1_000_000..1_000_000) }).collect())
        .collect();
    let sum = (0..len).map(|i| inputs.iter().map(|input| input[i]).sum()).collect();
    (inputs.into_iter().map(Tensor::Int32).collect(), Tensor::Int32(sum))
}

#[test]
fn threads_of_a_worker_sum_exactly_dense_sparse_and_in_series_over_lossy_links() {
    // 61 blocks of 8: the threads' shares differ by one block.
    let len = 61 * 8 - 3;
    for threads in [2u16, 3] {
        for seed in 1..=4 {
            let config = ClusterConfig { threads, seed, ..ClusterConfig::new(3, 12, 8).with_faults(0.05) };
            let mut cluster = Cluster::new(config).unwrap();
            for (sparse, zero_every) in [(false, 0), (true, 3)] {
                let (inputs, sum) = inputs(3, len, 8, zero_every, seed);
                let report = cluster.allreduce(&inputs, sparse).unwrap();
                assert!(report.outputs.iter().all(|output| *output == sum), "{threads} threads, seed {seed}");
                // Every block went out at least once from every rank, through its threads.
                let blocks = if sparse { 61 - 61usize.div_ceil(3) } else { 61 } as u64;
                assert!(report.workers.iter().all(|w| w.data_sent >= blocks), "{:?}", report.workers);
            }
            let jobs: Vec<(Vec<Tensor>, Tensor)> =
                (0..3).map(|job| inputs(3, len, 8, 0, seed * 10 + job)).collect();
            let series =
                cluster.allreduce_series(&jobs.iter().map(|(i, _)| i.clone()).collect::<Vec<_>>(), false);
            let series = series.unwrap();
            for ((outputs, (_, sum)), ranks) in series.outputs.iter().zip(&jobs).zip(&series.jobs) {
                assert!(outputs.iter().all(|output| output == sum), "{threads} threads, seed {seed}: series");
                assert!(ranks
                    .iter()
                    .all(|rank| rank.elapsed <= series.elapsed && rank.counters.jobs_done == threads as u64));
            }
        }
    }
}

#[test]
fn threads_must_divide_the_slots_on_one_switch() {
    for (threads, slots) in [(0u16, 8u16), (3, 8), (16, 8)] {
        let config = ClusterConfig { threads, ..ClusterConfig::new(2, slots, 4) };
        assert_eq!(Cluster::new(config).unwrap_err(), SimError::Threads { threads, slots });
    }
    let sharded = ClusterConfig { threads: 2, shards: 2, ..ClusterConfig::new(2, 8, 4) };
    let error = Cluster::new(sharded).unwrap_err();
    assert_eq!(
        error.to_string(),
        "2 worker threads for 8 slots: give a number of threads that divides the slots (more than 1 \
         only with one switch and no racks)"
    );
}

/// How much longer a job of 17 blocks of 4 elements on 2 lossless workers of 8 slots
/// takes when rank 0 loses the result of block 8 once: with 2 threads, thread 0's last
/// block (its share is blocks 0-8, thread 1's 9-16, each numbered from 0), which no later
/// packet of its own reveals; with 1 thread, a block in mid-job, whose loss the later
/// results' numbers show.
fn cost_of_losing_block_8(threads: u16) -> Duration {
    let config = ClusterConfig { threads, ..ClusterConfig::new(2, 8, 4) };
    let (inputs, sum) = inputs(2, 17 * 4, 4, 0, 7);
    let lossless = Cluster::new(config.clone()).unwrap().allreduce(&inputs, false).unwrap();
    let mut lossy = Cluster::new(ClusterConfig { lost_results: vec![(0, 8)], ..config }).unwrap();
    let report = lossy.allreduce(&inputs, false).unwrap();
    assert!(report.outputs.iter().all(|output| *output == sum));
    report.elapsed - lossless.elapsed
}

#[test]
fn each_thread_has_a_tail_of_its_own() {
    let timeout = ClusterConfig::new(2, 8, 4).retransmit_timeout;
    let one_thread = cost_of_losing_block_8(1);
    let two_threads = cost_of_losing_block_8(2);
    assert!(one_thread < timeout, "mid-job, found by the gap in the numbers: {one_thread:?}");
    assert!(two_threads >= timeout, "thread 0's tail, found by a timer: {two_threads:?}");
}
