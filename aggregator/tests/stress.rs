//! Whole clusters of random shapes over lossy links, with ranks starting late: every job
//! ends with exact sums within the job timeout. Seeded, so a failure names its case.
//!
//! Two deadlocks between the probes of issue 15's waiting threads were found this way
//! (threads of more than 64 slots, each worker probing a slot the other's lost packet
//! did not lie in), and the timeout inflating when timed packets waited for a peer's
//! loss recovery.

use std::time::Duration;

use netagg_aggregator::sim::{Cluster, ClusterConfig, RateLimit, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Each worker's blocks of `packet` elements hold data with probability `density`.
fn inputs(rng: &mut ChaCha8Rng, workers: u16, len: usize, packet: usize, density: f64) -> Vec<Tensor> {
    (0..workers)
        .map(|_| {
            let mut values = vec![0i32; len];
            for block in values.chunks_mut(packet) {
                if rng.gen_bool(density) {
                    block.iter_mut().for_each(|v| *v = rng.gen_range(-1000..1000) | 1);
                }
            }
            Tensor::Int32(values)
        })
        .collect()
}

/// The element-wise sum of int32 `inputs` of `len` elements, wrapping as the switch does.
fn exact_sum(inputs: &[Tensor], len: usize) -> Tensor {
    let mut sum = vec![0i32; len];
    for input in inputs {
        let Tensor::Int32(values) = input else { unreachable!("int32 inputs") };
        sum.iter_mut().zip(values).for_each(|(sum, v)| *sum = sum.wrapping_add(*v));
    }
    Tensor::Int32(sum)
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    Dense,
    Sparse,
    Exponents,
}

#[test]
fn random_clusters_over_lossy_links_with_late_ranks_finish_exact() {
    let cases = if cfg!(debug_assertions) { 500 } else { 1500 };
    for seed in 0..cases {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let workers = rng.gen_range(1..=4u16);
        let slots = [1u16, 3, 8, 64, 65, 100, 130, 130][rng.gen_range(0..8)];
        let packet = rng.gen_range(1..=8u16);
        let mode = [Mode::Dense, Mode::Sparse, Mode::Exponents][rng.gen_range(0..3)];
        let loss = [0.0, 0.05, 0.1, 0.2, 0.3][rng.gen_range(0..5)];
        // Several rounds on every slot, and a short tail.
        let len = slots as usize * packet as usize * rng.gen_range(1..6) - rng.gen_range(0..packet as usize);
        let density = if matches!(mode, Mode::Sparse) { rng.gen_range(0.0..1.0) } else { 1.0 };
        let mut config = ClusterConfig::new(workers, slots, packet).with_faults(loss);
        config.depth = [2u8, 4, 8][rng.gen_range(0..3)];
        config.seed = seed;
        config.job_timeout = Duration::from_secs(2);
        config.max_steps = 3_000_000;
        let timeout = config.retransmit_timeout;
        config.start_delays = (0..workers)
            .map(|_| if rng.gen_bool(0.4) { timeout * rng.gen_range(0..80) } else { Duration::ZERO })
            .collect();
        let case =
            format!("seed {seed}: {workers} workers, {slots} slots of {packet}, {mode:?}, loss {loss}");
        let inputs = inputs(&mut rng, workers, len, packet as usize, density);
        let expected = exact_sum(&inputs, len);
        let mut cluster = Cluster::new(config).unwrap();
        for job in 0..3 {
            let report = match mode {
                Mode::Exponents => cluster.allreduce_with_exponents(&inputs),
                mode => cluster.allreduce(&inputs, matches!(mode, Mode::Sparse)),
            };
            let report = report.unwrap_or_else(|error| panic!("{case}, job {job}: {error}"));
            assert!(report.outputs.iter().all(|output| *output == expected), "{case}, job {job}: sums");
            // Jobs of at most a few hundred packets on 10 µs links: a timeout grown from
            // round trips that waited for a peer's recovery shows as a slow job.
            assert!(report.elapsed < Duration::from_millis(500), "{case}, job {job}: {:?}", report.elapsed);
        }
    }
}

/// The same behind rate-limited links whose queues are shorter than the window, with
/// loss and jitter on top: the pacer engages, holds sends and retransmissions back, and
/// every job still ends exact, within the job timeout and the step bound.
#[test]
fn random_clusters_behind_shallow_queues_finish_exact() {
    let cases = if cfg!(debug_assertions) { 150 } else { 1000 };
    for seed in 0..cases {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let workers = rng.gen_range(1..=4u16);
        let slots = [8u16, 64, 65, 130][rng.gen_range(0..4)];
        let packet = rng.gen_range(1..=64u16);
        let sparse = rng.gen_bool(0.5);
        let loss = [0.0, 0.01, 0.05][rng.gen_range(0..3)];
        let rate = [10_000_000u64, 50_000_000, 200_000_000][rng.gen_range(0..3)];
        let queue = Duration::from_micros(rng.gen_range(1000..5000));
        let burst = [0u64, 4096, 65536][rng.gen_range(0..3)];
        let len = slots as usize * packet as usize * rng.gen_range(2..8) - rng.gen_range(0..packet as usize);
        let density = if sparse { rng.gen_range(0.0..1.0) } else { 1.0 };
        let mut config = ClusterConfig::new(workers, slots, packet)
            .with_faults(loss)
            .with_rate(RateLimit::new(rate, queue).with_burst(burst));
        config.uplink.jitter = Duration::from_micros(rng.gen_range(0..100));
        config.downlink.jitter = config.uplink.jitter;
        config.depth = [2u8, 8][rng.gen_range(0..2)];
        config.seed = seed;
        // The library's timeouts: a floor of 10 ms, doubling up to 64 times that.
        config.retransmit_timeout = Duration::from_millis(10);
        config.max_retransmit_timeout = Duration::from_millis(640);
        config.job_timeout = Duration::from_secs(10);
        config.max_steps = 3_000_000;
        let case = format!(
            "seed {seed}: {workers} workers, {slots} slots of {packet}, sparse {sparse}, loss {loss}, {rate} bit/s, queue {queue:?}, burst {burst}"
        );
        let inputs = inputs(&mut rng, workers, len, packet as usize, density);
        let expected = exact_sum(&inputs, len);
        let mut cluster = Cluster::new(config).unwrap();
        for job in 0..3 {
            let report = cluster
                .allreduce(&inputs, sparse)
                .unwrap_or_else(|error| panic!("{case}, job {job}: {error}"));
            assert!(report.outputs.iter().all(|output| *output == expected), "{case}, job {job}: sums");
        }
    }
}
