//! Windows many times their path's queue: 4 workers with windows of 128 packets of 540
//! bytes behind links of 2 to 10 Mbit/s whose queues of 1 and 2 KB hold one to three of
//! them, dense and sparse, with and without 1 % random loss each way. The delay such a
//! queue adds stays below the pacer's target, so only loss can engage it; before it did
//! (issue 31, item 4), such jobs took up to 626 times the time the link allows.

use std::time::Duration;

use netagg_aggregator::sim::{Cluster, ClusterConfig, RateLimit, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const WORKERS: u16 = 4;
const SLOTS: u16 = 128;
const PACKET_ELEMENTS: u16 = 128;
const LEN: usize = 32 * 1024;

/// int32 tensors whose blocks are non-zero with probability `density`.
fn inputs(density: f64, seed: u64) -> Vec<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
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

/// Every case's jobs end exact. Dense, every job within 50 times the time the busiest
/// link allows and the third within 12 (before the loss rules: up to 626 and 371); sparse
/// behind 2 KB queues, the third within 4 (before: up to 45). Sparse behind 1 KB queues,
/// whose losses are mostly results on the way down, which no first sending's run shows,
/// still takes 8 to 192 times the link's time: only the sums are checked there.
#[test]
fn windows_far_above_tiny_queues_converge_instead_of_collapsing() {
    for sparse in [false, true] {
        let inputs = inputs(if sparse { 0.25 } else { 1.0 }, 5);
        let expected = exact_sum(&inputs);
        // The busiest link's bytes, from a run without rate limits or loss.
        let free = Cluster::new(base_config()).unwrap().allreduce(&inputs, sparse).unwrap();
        let busiest = free.workers.iter().map(|w| w.bytes_sent.max(w.bytes_received)).max().unwrap();
        for loss in [0.0, 0.01] {
            for bits_per_second in [2_000_000, 5_000_000, 10_000_000] {
                for queue_bytes in [1000, 2000] {
                    let limit = RateLimit { bits_per_second, queue_bytes, burst_bytes: 0 };
                    let model = limit.serialization(busiest);
                    let mut config = base_config().with_rate(limit);
                    config.uplink.drop = loss;
                    config.downlink.drop = loss;
                    let mut cluster = Cluster::new(config).unwrap();
                    let case =
                        format!("sparse {sparse}, loss {loss}, {bits_per_second} bit/s, queue {queue_bytes}");
                    for job in 0..3 {
                        let report = cluster.allreduce(&inputs, sparse).unwrap();
                        assert!(report.outputs.iter().all(|output| *output == expected), "{case}: sums");
                        let ratio = report.elapsed.as_secs_f64() / model.as_secs_f64();
                        let bound = match (sparse, queue_bytes, job) {
                            (false, _, 2) => 12.0,
                            (false, _, _) => 50.0,
                            (true, 2000, 2) => 4.0,
                            _ => f64::INFINITY,
                        };
                        assert!(ratio < bound, "{case}, job {job}: {ratio:.2} of the model");
                    }
                }
            }
        }
    }
}
