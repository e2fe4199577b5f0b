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

/// Runs a warmup and then `jobs` allreduces of 1 Mi int32 on `config`, checks every sum,
/// and gives each measured job's time over the link-rate model: every packet once,
/// with its frame, at 50 Mbit/s.
fn ratios_to_the_model(config: ClusterConfig, jobs: usize) -> Vec<f64> {
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
            report.elapsed.as_secs_f64() / model.as_secs_f64()
        })
        .skip(1)
        .collect()
}

/// 1.34 of the model, median, before losses were found in round trips of the path
/// (`worker/early_loss.rs`); 1.134 after (1.104-1.361). With lost results found as gaps
/// in the switch's numbering of its broadcasts (`worker/sequence.rs`), 1.120
/// (1.090-1.249): both bounds below fail without it. The goal, 1.1, is not met
/// yet: most of what is left is lost contributions, which no result reveals sooner.
#[test]
fn one_percent_loss_each_way_stays_within_1_13_times_the_link_rate_model() {
    let mut ratios: Vec<f64> =
        (1..=8).flat_map(|seed| ratios_to_the_model(lossy_row(0.01, seed), 2)).collect();
    ratios.sort_by(f64::total_cmp);
    let median = (ratios[7] + ratios[8]) / 2.0;
    eprintln!("1 % loss, jobs over the model: median {median:.3}, all {ratios:.3?}");
    assert!(median < 1.13, "median {median:.3} of the model: {ratios:.3?}");
    assert!(ratios[15] < 1.3, "slowest job {:.3} of the model: {ratios:.3?}", ratios[15]);
}
