//! Windows many times their path's queue: 4 workers with windows of 128 packets of 540
//! bytes behind links of 2 to 10 Mbit/s whose queues of 1 and 2 KB hold one to three of
//! them, dense and sparse, with and without 1 % random loss each way. The delay such a
//! queue adds stays below the pacer's target, so only loss can engage it; before it did
//! (issue 31, item 4), such jobs took up to 626 times the time the link allows. The
//! issue's target, 1.5 times, is met by most later dense jobs, not by every case.

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

/// The median of `ratios`.
fn median(mut ratios: Vec<f64>) -> f64 {
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// Every case's jobs end exact, on two seeds of the links' losses. The bounds leave about
/// twice the largest ratio measured on four seeds (`examples/collapse_matrix.rs`; before
/// the probe paced by delivery, issue 31 item 4, later dense jobs reached 157 times the
/// model): dense, every job within 50 times the time the busiest link allows (measured
/// up to 24) and every later one within 15 (7.1), their median within 2.5 (1.5); sparse,
/// every third job within 30 (16), the later jobs behind 2 KB queues within 25 (13). Sparse
/// first jobs behind 1 KB queues still take up to 155 times the model: their losses are
/// mostly results on the way down, which no first sending's run shows.
#[test]
fn windows_far_above_tiny_queues_converge_instead_of_collapsing() {
    let mut dense_later = Vec::new();
    for sparse in [false, true] {
        let inputs = inputs(if sparse { 0.25 } else { 1.0 }, 5);
        let expected = exact_sum(&inputs);
        // The busiest link's bytes, from a run without rate limits or loss.
        let free = Cluster::new(base_config()).unwrap().allreduce(&inputs, sparse).unwrap();
        let busiest = free.workers.iter().map(|w| w.bytes_sent.max(w.bytes_received)).max().unwrap();
        for (seed, loss) in [0, 1].into_iter().flat_map(|seed| [(seed, 0.0), (seed, 0.01)]) {
            for bits_per_second in [2_000_000, 5_000_000, 10_000_000] {
                for queue_bytes in [1000, 2000] {
                    let limit = RateLimit { bits_per_second, queue_bytes, burst_bytes: 0 };
                    let model = limit.serialization(busiest);
                    let mut config = base_config().with_rate(limit);
                    config.uplink.drop = loss;
                    config.downlink.drop = loss;
                    config.seed = seed;
                    let mut cluster = Cluster::new(config).unwrap();
                    let case = format!(
                        "sparse {sparse}, seed {seed}, loss {loss}, {bits_per_second} bit/s, queue {queue_bytes}"
                    );
                    for job in 0..3 {
                        let report = cluster.allreduce(&inputs, sparse).unwrap();
                        assert!(report.outputs.iter().all(|output| *output == expected), "{case}: sums");
                        let ratio = report.elapsed.as_secs_f64() / model.as_secs_f64();
                        if !sparse && job > 0 {
                            dense_later.push(ratio);
                        }
                        let bound = match (sparse, queue_bytes, job) {
                            (false, _, 0) => 50.0,
                            (false, _, _) => 15.0,
                            (true, 2000, 1 | 2) => 25.0,
                            (true, _, 2) => 30.0,
                            _ => f64::INFINITY,
                        };
                        assert!(ratio < bound, "{case}, job {job}: {ratio:.2} of the model");
                    }
                }
            }
        }
    }
    let median = median(dense_later);
    assert!(median < 2.5, "dense later jobs: median {median:.2} of the model");
}
