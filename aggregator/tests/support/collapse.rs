//! The collapse matrix: windows many times their path's queue. 4 workers with windows of
//! 128 packets of 540 bytes behind links of 2 to 10 Mbit/s whose queues of 1 and 2 KB
//! hold one to three of them, dense and sparse, with and without 1 % random loss each
//! way, and a few links with a shaper's bucket. `tests/collapse.rs` bounds it;
//! `examples/collapse_matrix.rs` prints it.

use std::time::Duration;

use netagg_aggregator::sim::{Cluster, ClusterConfig, RateLimit, RunReport, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const WORKERS: u16 = 4;
const SLOTS: u16 = 128;
const PACKET_ELEMENTS: u16 = 128;
const LEN: usize = 32 * 1024;

/// The seed of every case's inputs; seeds of the links' losses vary.
const INPUT_SEED: u64 = 5;

/// One link of the matrix, with the mode of the stream offered to it.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub sparse: bool,
    /// The share of packets each link drops at random, each way.
    pub loss: f64,
    pub limit: RateLimit,
}

impl Case {
    /// Every case of one mode: losses of 0 and 1 % at 2, 5 and 10 Mbit/s behind queues
    /// of 1 and 2 KB, then the same queues at 2 and 10 Mbit/s behind a bucket of 8 KB,
    /// which lets a burst's survivors through faster than the link.
    pub fn all(sparse: bool) -> Vec<Case> {
        let links = [2_000_000, 5_000_000, 10_000_000].into_iter().flat_map(|bits_per_second| {
            [1000, 2000].map(|queue_bytes| RateLimit { bits_per_second, queue_bytes, burst_bytes: 0 })
        });
        let plain = [0.0, 0.01]
            .into_iter()
            .flat_map(|loss| links.clone().map(move |limit| Case { sparse, loss, limit }));
        let bucketed = [2_000_000, 10_000_000].into_iter().flat_map(|bits_per_second| {
            [1000, 2000].map(|queue_bytes| Case {
                sparse,
                loss: 0.0,
                limit: RateLimit { bits_per_second, queue_bytes, burst_bytes: 8000 },
            })
        });
        plain.chain(bucketed).collect()
    }

    /// Its name, as `dense-0.01-10-1000` (mode, loss, Mbit/s, queue bytes), with the
    /// bucket's bytes after a `b` where it has one: `sparse-0-2-2000-b8000`.
    pub fn name(&self) -> String {
        let mode = if self.sparse { "sparse" } else { "dense" };
        let RateLimit { bits_per_second, queue_bytes, burst_bytes } = self.limit;
        let bucket = if burst_bytes > 0 { format!("-b{burst_bytes}") } else { String::new() };
        format!("{mode}-{}-{}-{queue_bytes}{bucket}", self.loss, bits_per_second / 1_000_000)
    }

    /// Runs `jobs` jobs one after another on one cluster, whose links lose packets by
    /// `seed`, and gives each job's report with its time as a multiple of the time the
    /// busiest link allows. Panics, naming the case, if a job's sums are not exact.
    pub fn run(&self, seed: u64, jobs: usize) -> Vec<(RunReport, f64)> {
        let inputs = inputs(if self.sparse { 0.25 } else { 1.0 });
        let expected = exact_sum(&inputs);
        // The busiest link's bytes, from a run without rate limits or loss.
        let free = Cluster::new(base_config()).unwrap().allreduce(&inputs, self.sparse).unwrap();
        let busiest = free.workers.iter().map(|w| w.bytes_sent.max(w.bytes_received)).max().unwrap();
        let model = self.limit.serialization(busiest);
        let mut config = base_config().with_rate(self.limit);
        config.uplink.drop = self.loss;
        config.downlink.drop = self.loss;
        config.seed = seed;
        let mut cluster = Cluster::new(config).unwrap();
        (0..jobs)
            .map(|job| {
                let report = cluster.allreduce(&inputs, self.sparse).unwrap();
                let case = self.name();
                assert!(
                    report.outputs.iter().all(|output| *output == expected),
                    "{case}, seed {seed}, job {job}: sums"
                );
                let ratio = report.elapsed.as_secs_f64() / model.as_secs_f64();
                (report, ratio)
            })
            .collect()
    }
}

/// int32 tensors whose blocks are non-zero with probability `density`.
fn inputs(density: f64) -> Vec<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(INPUT_SEED);
    (0..WORKERS)
        .map(|_| {
            let mut values = vec![0i32; LEN];
            for chunk in values.chunks_mut(PACKET_ELEMENTS as usize) {
                if rng.gen_bool(density) {
                    chunk.iter_mut().for_each(|v| *v = rng.gen_range(-1000..1000) | 1);
                }
            }
            Tensor::Int32(values)
        })
        .collect()
}

fn exact_sum(inputs: &[Tensor]) -> Tensor {
    let mut sum = vec![0i32; LEN];
    for input in inputs {
        let Tensor::Int32(values) = input else { unreachable!("int32 inputs") };
        sum.iter_mut().zip(values).for_each(|(s, v)| *s = s.wrapping_add(*v));
    }
    Tensor::Int32(sum)
}

fn base_config() -> ClusterConfig {
    let mut config = ClusterConfig::new(WORKERS, SLOTS, PACKET_ELEMENTS);
    config.uplink.latency = Duration::from_micros(50);
    config.downlink.latency = Duration::from_micros(50);
    // The library's timeouts: a floor of 10 ms, doubling up to 64 times that.
    config.retransmit_timeout = Duration::from_millis(10);
    config.max_retransmit_timeout = Duration::from_millis(640);
    config.job_timeout = Duration::from_secs(30);
    config
}
