//! Prints the collapse matrix of `tests/collapse.rs`: each job's time as a multiple of
//! the time the busiest link allows, with the drops and resends behind it.
//!
//! `cargo run -p netagg-aggregator --example collapse_matrix [jobs] [seeds] [case]`, a case
//! named as `dense-0.01-10-1000` (mode, loss, Mbit/s, queue bytes); a summary per mode and
//! job closes the output.

use std::time::Duration;

use netagg_aggregator::sim::{Cluster, ClusterConfig, RateLimit, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const WORKERS: u16 = 4;
const SLOTS: u16 = 128;
const PACKET_ELEMENTS: u16 = 128;
const LEN: usize = 32 * 1024;

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

fn base_config() -> ClusterConfig {
    let mut config = ClusterConfig::new(WORKERS, SLOTS, PACKET_ELEMENTS);
    config.uplink.latency = Duration::from_micros(50);
    config.downlink.latency = Duration::from_micros(50);
    config.retransmit_timeout = Duration::from_millis(10);
    config.max_retransmit_timeout = Duration::from_millis(640);
    config.job_timeout = Duration::from_secs(30);
    config
}

fn main() {
    let jobs: usize = std::env::args().nth(1).map_or(3, |arg| arg.parse().expect("jobs"));
    let seeds: u64 = std::env::args().nth(2).map_or(1, |arg| arg.parse().expect("seeds"));
    let only: Option<String> = std::env::args().nth(3);
    // Per mode and job: the sum of log ratios, their count, and the largest.
    let mut summary = std::collections::BTreeMap::<(bool, usize), (f64, u32, f64)>::new();
    let mut worst = 0.0f64;
    for seed in 0..seeds {
        for sparse in [false, true] {
            let inputs = inputs(if sparse { 0.25 } else { 1.0 }, 5);
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
                        let name = format!(
                            "{}-{loss}-{}-{queue_bytes}",
                            if sparse { "sparse" } else { "dense" },
                            bits_per_second / 1_000_000
                        );
                        if only.as_ref().is_some_and(|only| *only != name) {
                            continue;
                        }
                        config.seed = seed;
                        let mut cluster = Cluster::new(config).unwrap();
                        let mut line = format!(
                            "{:6} {:4} {:>3} Mbit/s {:>4} B |",
                            if sparse { "sparse" } else { "dense" },
                            loss,
                            bits_per_second / 1_000_000,
                            queue_bytes
                        );
                        for job in 0..jobs {
                            let report = cluster.allreduce(&inputs, sparse).unwrap();
                            let ratio = report.elapsed.as_secs_f64() / model.as_secs_f64();
                            worst = worst.max(ratio);
                            let entry = summary.entry((sparse, job)).or_default();
                            entry.0 += ratio.ln();
                            entry.1 += 1;
                            entry.2 = entry.2.max(ratio);
                            let resent: u64 = report.workers.iter().map(|w| w.retransmissions).sum();
                            let timeouts: u64 = report.workers.iter().map(|w| w.timeouts).sum();
                            let asked: u64 = report.workers.iter().map(|w| w.acks_sent).sum();
                            line += &format!(
                                " {ratio:6.2} ({} drop, {resent} re, {timeouts} to, {asked} ack)",
                                report.queue_drops
                            );
                        }
                        println!("{line}");
                    }
                }
            }
        }
    }
    for ((sparse, job), (logs, count, max)) in summary {
        let mode = if sparse { "sparse" } else { "dense" };
        println!(
            "{mode} job {job}: geometric mean {:.2}, max {max:.2} over {count}",
            (logs / count as f64).exp()
        );
    }
    println!("worst {worst:.2}");
}
