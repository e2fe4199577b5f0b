//! Allreduces over the emulated 1 % loss row's network (issue 29, item 4): 4 workers of
//! 256 slots behind 50 Mbit/s links with 100 ms queues, 1 ms each way, 1 % of packets
//! lost each way. A lost packet stalls its slot's round for every worker until it is
//! found and repaired, so how fast that happens sets how far the time is from the
//! link-rate model.

use std::time::Duration;

use netagg_aggregator::sim::{Cluster, ClusterConfig, LinkFaults, RateLimit, Tensor};
use netagg_wire::packet::datagram_len;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Elements of a packet, as the library's default.
const PACKET_ELEMENTS: u16 = 256;
/// Ethernet, IPv4 and UDP bytes around each datagram, which the links carry too.
const FRAME_OVERHEAD: u64 = 42;

/// The row's network, losing `drop` of the packets each way; the library's timeouts.
fn lossy_row(drop: f64, seed: u64) -> ClusterConfig {
    let limit = RateLimit::new(50_000_000, Duration::from_millis(100));
    let mut config = ClusterConfig::new(4, 256, PACKET_ELEMENTS).with_rate(limit);
    for link in [&mut config.uplink, &mut config.downlink] {
        *link = LinkFaults { drop, rate: Some(limit), ..LinkFaults::perfect(Duration::from_millis(1)) };
    }
    config.frame_overhead_bytes = FRAME_OVERHEAD;
    config.retransmit_timeout = Duration::from_millis(10);
    config.max_retransmit_timeout = Duration::from_millis(640);
    config.seed = seed;
    config
}

/// Every rank's int32 tensor of `len` elements, and their exact sum.
fn inputs(len: usize, seed: u64) -> (Vec<Tensor>, Tensor) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let inputs: Vec<Vec<i32>> =
        (0..4).map(|_| (0..len).map(|_| rng.gen_range(-1_000_000..1_000_000)).collect()).collect();
    let sum = (0..len).map(|i| inputs.iter().map(|input| input[i]).sum()).collect();
    (inputs.into_iter().map(Tensor::Int32).collect(), Tensor::Int32(sum))
}

/// One measured job: its time over the link-rate model, and what recovery cost.
#[derive(Debug, Clone, Copy)]
struct JobFigures {
    ratio: f64,
    /// Contributions sent again, all workers together.
    retransmissions: u64,
    /// Of them, sent on the switch's notice that their first sending was lost.
    lost_notices: u64,
    /// Contributions the switch already held.
    duplicates: u64,
    /// Results the switch sent again to one worker, answering a request or a repeated
    /// contribution.
    results_resent: u64,
    /// Slot timers that fired and sent something, all workers together.
    timeouts: u64,
    /// Probes of every kind, all workers together.
    probes: u64,
}

/// Runs a warmup and then `jobs` allreduces of 1 Mi int32 on `config`, checks every sum,
/// and gives each measured job's time over the link-rate model (every packet once, with
/// its frame, at 50 Mbit/s) and its recovery counts.
fn jobs_against_the_model(config: ClusterConfig, jobs: usize) -> Vec<JobFigures> {
    let len: usize = 1 << 20;
    let limit = config.uplink.rate.unwrap();
    let packets = len.div_ceil(PACKET_ELEMENTS as usize) as u64;
    let packet_bytes = datagram_len(PACKET_ELEMENTS.into()) as u64 + FRAME_OVERHEAD;
    let model = limit.serialization(packets * packet_bytes);
    let seed = config.seed;
    let mut cluster = Cluster::new(config).unwrap();
    (0..=jobs)
        .map(|job| {
            let (inputs, expected) = inputs(len, seed * 10 + job as u64);
            let report = cluster.allreduce(&inputs, false).unwrap();
            assert!(report.outputs.iter().all(|output| *output == expected), "seed {seed}, job {job}: sums");
            JobFigures {
                ratio: report.elapsed.as_secs_f64() / model.as_secs_f64(),
                retransmissions: report.workers.iter().map(|w| w.retransmissions).sum(),
                lost_notices: report.workers.iter().map(|w| w.lost_notices).sum(),
                duplicates: report.switch.duplicates,
                results_resent: report.switch.results_resent,
                timeouts: report.workers.iter().map(|w| w.timeouts).sum(),
                probes: report.workers.iter().map(|w| w.probes).sum(),
            }
        })
        .skip(1)
        .collect()
}

/// The median of `values`, an even count of them.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    (values[values.len() / 2 - 1] + values[values.len() / 2]) / 2.0
}

/// 1.34 of the model, median, before losses were found in round trips of the path
/// (`worker/early_loss.rs`); 1.134 after (1.104-1.361). With lost results found as gaps
/// in the switch's numbering of its broadcasts (`worker/sequence.rs`), 1.120
/// (1.090-1.249); with lost contributions found as gaps in the workers' numbering of
/// their first sendings (`engine/first_sendings.rs`), 1.091 (1.064-1.137), the issue's
/// goal. Both bounds below fail without it.
#[test]
fn one_percent_loss_each_way_stays_within_1_1_times_the_link_rate_model() {
    let jobs: Vec<JobFigures> =
        (1..=8).flat_map(|seed| jobs_against_the_model(lossy_row(0.01, seed), 2)).collect();
    let mut ratios: Vec<f64> = jobs.iter().map(|job| job.ratio).collect();
    ratios.sort_by(f64::total_cmp);
    let median_ratio = median(ratios.clone());
    let per_job = |count: fn(&JobFigures) -> u64| median(jobs.iter().map(|job| count(job) as f64).collect());
    eprintln!(
        "1 % loss, jobs over the model: median {median_ratio:.3}, all {ratios:.3?}; per job, median: \
         {} retransmissions, {} on lost notices, {} duplicates at the switch, {} results sent again, \
         {} timeouts, {} probes",
        per_job(|job| job.retransmissions),
        per_job(|job| job.lost_notices),
        per_job(|job| job.duplicates),
        per_job(|job| job.results_resent),
        per_job(|job| job.timeouts),
        per_job(|job| job.probes),
    );
    assert!(median_ratio < 1.1, "median {median_ratio:.3} of the model: {ratios:.3?}");
    assert!(ratios[15] < 1.2, "slowest job {:.3} of the model: {ratios:.3?}", ratios[15]);
}
