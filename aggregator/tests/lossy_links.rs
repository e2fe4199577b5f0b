//! Allreduces over the emulated 1 % loss row's network (issue 29, item 4): 4 workers of
//! 256 slots behind 50 Mbit/s links with 100 ms queues, 1 ms each way, 1 % of packets
//! lost each way. A lost packet stalls its slot's round for every worker until it is
//! found and repaired, so how fast that happens sets how far the time is from the
//! link-rate model.

use std::time::Duration;

use netagg_aggregator::sim::{Cluster, ClusterConfig, LinkFaults, RateLimit, Tensor};
use netagg_aggregator::worker::WorkerCounters;
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

/// The link-rate model of one job of `len` int32: every packet once, with its frame, at
/// `config`'s rate.
fn model(config: &ClusterConfig, len: usize) -> Duration {
    let packets = len.div_ceil(PACKET_ELEMENTS as usize) as u64;
    let packet_bytes = datagram_len(PACKET_ELEMENTS.into()) as u64 + FRAME_OVERHEAD;
    config.uplink.rate.unwrap().serialization(packets * packet_bytes)
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

impl JobFigures {
    /// A job that took `ratio` of the model, with the workers' counters `workers` and the
    /// switch's `duplicates` and `results_resent` over it.
    fn new(ratio: f64, workers: WorkerCounters, duplicates: u64, results_resent: u64) -> JobFigures {
        JobFigures {
            ratio,
            retransmissions: workers.retransmissions,
            lost_notices: workers.lost_notices,
            duplicates,
            results_resent,
            timeouts: workers.timeouts,
            probes: workers.probes,
        }
    }
}

/// Runs a warmup and then `jobs` allreduces of 1 Mi int32 on `config`, checks every sum,
/// and gives each measured job's time over the link-rate model (every packet once, with
/// its frame, at 50 Mbit/s) and its recovery counts.
fn jobs_against_the_model(config: ClusterConfig, jobs: usize) -> Vec<JobFigures> {
    let len: usize = 1 << 20;
    let model = model(&config, len);
    let seed = config.seed;
    let mut cluster = Cluster::new(config).unwrap();
    (0..=jobs)
        .map(|job| {
            let (inputs, expected) = inputs(len, seed * 10 + job as u64);
            let report = cluster.allreduce(&inputs, false).unwrap();
            assert!(report.outputs.iter().all(|output| *output == expected), "seed {seed}, job {job}: sums");
            let ratio = report.elapsed.as_secs_f64() / model.as_secs_f64();
            let workers = report.workers.iter().fold(WorkerCounters::default(), |total, w| total + *w);
            JobFigures::new(ratio, workers, report.switch.duplicates, report.switch.results_resent)
        })
        .skip(1)
        .collect()
}

/// The median of `values`, an even count of them.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    (values[values.len() / 2 - 1] + values[values.len() / 2]) / 2.0
}

/// Prints the figures of `jobs` under `title`: their ratios to the model, and their
/// recoveries' medians per job; gives the ratios, sorted, and their median.
fn report(title: &str, jobs: &[JobFigures]) -> (Vec<f64>, f64) {
    let mut ratios: Vec<f64> = jobs.iter().map(|job| job.ratio).collect();
    ratios.sort_by(f64::total_cmp);
    let median_ratio = median(ratios.clone());
    let per_job = |count: fn(&JobFigures) -> u64| median(jobs.iter().map(|job| count(job) as f64).collect());
    eprintln!(
        "{title}: median {median_ratio:.3}, all {ratios:.3?}; per job, median: \
         {} retransmissions, {} on lost notices, {} duplicates at the switch, {} results sent again, \
         {} timeouts, {} probes",
        per_job(|job| job.retransmissions),
        per_job(|job| job.lost_notices),
        per_job(|job| job.duplicates),
        per_job(|job| job.results_resent),
        per_job(|job| job.timeouts),
        per_job(|job| job.probes),
    );
    (ratios, median_ratio)
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
    let (ratios, median_ratio) = report("1 % loss, jobs over the model", &jobs);
    assert!(median_ratio < 1.1, "median {median_ratio:.3} of the model: {ratios:.3?}");
    assert!(ratios[15] < 1.2, "slowest job {:.3} of the model: {ratios:.3?}", ratios[15]);
}

/// Runs a warmup and then `jobs` allreduces of 1 Mi int32 on `config` as the emulated
/// row's benchmark does: each rank submits its next job when its own last one ended, and
/// times it from there. Checks every sum; gives the slowest rank's median job over the
/// link-rate model (the benchmark's figure; an even count of jobs), and each measured
/// job's figures, its time
/// the slowest rank's and its counters all ranks' together.
fn series_against_the_model(config: ClusterConfig, jobs: usize) -> (f64, Vec<JobFigures>) {
    let len: usize = 1 << 20;
    let model = model(&config, len);
    let seed = config.seed;
    let mut cluster = Cluster::new(config).unwrap();
    let (inputs, sums): (Vec<Vec<Tensor>>, Vec<Tensor>) =
        (0..=jobs).map(|job| inputs(len, seed * 10 + job as u64)).unzip();
    let series = cluster.allreduce_series(&inputs, false).unwrap();
    for (job, (outputs, sum)) in series.outputs.iter().zip(&sums).enumerate() {
        assert!(outputs.iter().all(|output| output == sum), "seed {seed}, job {job}: sums");
    }
    let measured = &series.jobs[1..];
    let slowest_rank_median = (0..4)
        .map(|rank| median(measured.iter().map(|ranks| ranks[rank].elapsed.as_secs_f64()).collect()))
        .fold(0.0, f64::max);
    // The switch's counters are the series'; each job is given an equal share.
    let (duplicates, results_resent) = (
        series.switch.duplicates / series.jobs.len() as u64,
        series.switch.results_resent / series.jobs.len() as u64,
    );
    let figures = measured.iter().map(|ranks| {
        let slowest = ranks.iter().map(|rank| rank.elapsed).max().unwrap();
        let workers = ranks.iter().fold(WorkerCounters::default(), |total, rank| total + rank.counters);
        JobFigures::new(slowest.as_secs_f64() / model.as_secs_f64(), workers, duplicates, results_resent)
    });
    (slowest_rank_median / model.as_secs_f64(), figures.collect())
}

/// The emulated row as the client runs it: 2 worker threads of 128 slots per worker,
/// sharing its link and pacer, and each rank starting its next job when its own last one
/// ended, 2 measured jobs after a warmup, the slowest rank's mean over the model per
/// seed (the benchmark's 5 jobs and median cost more than the rest of this file in a
/// debug build). Each thread has a tail of its own that no later packet of its own
/// reveals, and a rank that finished late starts its next job late: 1.169 (1.109-1.288),
/// where the emulated row measures 1.12-1.14.
#[test]
fn one_percent_loss_with_two_threads_and_ranks_starting_on_their_own() {
    let runs: Vec<(f64, Vec<JobFigures>)> = (1..=8)
        .map(|seed| series_against_the_model(ClusterConfig { threads: 2, ..lossy_row(0.01, seed) }, 2))
        .collect();
    let per_run = median(runs.iter().map(|(ratio, _)| *ratio).collect());
    let jobs: Vec<JobFigures> = runs.iter().flat_map(|(_, jobs)| jobs.iter().copied()).collect();
    let (ratios, _) = report("1 % loss, 2 threads, ranks on their own, slowest rank's jobs", &jobs);
    let mut runs: Vec<f64> = runs.iter().map(|(ratio, _)| *ratio).collect();
    runs.sort_by(f64::total_cmp);
    eprintln!("  runs (slowest rank's median job): median {per_run:.3}, all {runs:.3?}");
    assert!(per_run < 1.2, "median run {per_run:.3} of the model: {runs:.3?}, jobs {ratios:.3?}");
}
