//! Allreduces over rate-limited links, as `tbf` makes them: the time the link rate
//! predicts (the slowest link's, when one is slower), nothing sent twice for a queue's
//! delay, and the queueing delay a fixed window builds.

use std::time::Duration;

use netagg_aggregator::sim::{Cluster, ClusterConfig, RateLimit, Tensor};
use netagg_wire::packet::datagram_len;

/// Bytes of a datagram of 256 elements, the packets of these clusters.
const PACKET_BYTES: u64 = datagram_len(256) as u64;

/// Every worker's tensor: its rank mixed into the index, so that sums are checkable.
fn inputs(workers: u16, len: usize) -> Vec<Tensor> {
    (0..workers).map(|rank| Tensor::Int32((0..len as i32).map(|i| i ^ rank as i32).collect())).collect()
}

fn expected(workers: u16, len: usize) -> Tensor {
    Tensor::Int32((0..len as i32).map(|i| (0..workers as i32).map(|rank| i ^ rank).sum()).collect())
}

/// A cluster of 4 workers with a window of 128 packets of 256 elements, behind links of
/// `bits_per_second` with 50 µs of latency each way, whose queues hold a whole window:
/// the links set the pace, as `tbf ... latency 100ms` sets it.
fn behind_links(bits_per_second: u64) -> ClusterConfig {
    let window_bytes = 128 * PACKET_BYTES;
    let mut config = ClusterConfig::new(4, 128, 256).with_rate(RateLimit {
        bits_per_second,
        queue_bytes: 2 * window_bytes,
        burst_bytes: 0,
    });
    config.uplink.latency = Duration::from_micros(50);
    config.downlink.latency = Duration::from_micros(50);
    // The library's defaults: a floor of 10 ms, doubling up to 64 times that.
    config.retransmit_timeout = Duration::from_millis(10);
    config.max_retransmit_timeout = Duration::from_millis(640);
    config
}

/// Runs `jobs` allreduces of 1 Mi int32 on `config`'s 4 workers and checks each: exact,
/// within 1 % of the time `pace` (the slowest link) allows for every packet once, header
/// included, and nothing lost, resent or sent twice.
fn jobs_at_the_pace_of(config: ClusterConfig, pace: RateLimit, jobs: usize) {
    let len: usize = 1 << 20;
    let packets = len.div_ceil(256) as u64;
    let model = pace.serialization(packets * PACKET_BYTES);
    let mut cluster = Cluster::new(config).unwrap();
    let (inputs, expected) = (inputs(4, len), expected(4, len));
    for job in 0..jobs {
        let report = cluster.allreduce(&inputs, false).unwrap();
        assert!(report.outputs.iter().all(|output| *output == expected), "job {job}: sums");
        let ratio = report.elapsed.as_secs_f64() / model.as_secs_f64();
        let case = format!("{pace:?}, job {job}: {:?} against {model:?}", report.elapsed);
        assert!((1.0..1.01).contains(&ratio), "{case}");
        assert_eq!((report.queue_drops, report.switch.duplicates), (0, 0), "{case}");
        for counters in &report.workers {
            assert_eq!((counters.retransmissions, counters.duplicates), (0, 0), "{case}");
            assert_eq!(counters.data_sent, packets, "{case}");
        }
    }
}

#[test]
fn queueing_delay_is_not_taken_for_loss_and_the_links_set_the_time() {
    for rate in [200_000_000, 50_000_000] {
        let config = behind_links(rate);
        let limit = config.uplink.rate.unwrap();
        jobs_at_the_pace_of(config, limit, 3);
    }
}

#[test]
fn a_full_queue_drops_what_exceeds_it() {
    // A queue of four packets before a 1 Mbit/s link, offered a window of 16 at once.
    let mut config = ClusterConfig::new(2, 16, 256).with_rate(RateLimit {
        bits_per_second: 1_000_000,
        queue_bytes: 4 * PACKET_BYTES,
        burst_bytes: 0,
    });
    config.retransmit_timeout = Duration::from_millis(50);
    let mut cluster = Cluster::new(config).unwrap();
    let len = 16 * 256;
    let report = cluster.allreduce(&inputs(2, len), false).unwrap();
    assert_eq!(report.outputs[0], expected(2, len), "the losses were recovered");
    // Each worker's first window: the packet on the wire and four queued pass, eleven drop.
    assert!(report.queue_drops >= 2 * 11, "{} dropped", report.queue_drops);
    // On the way up: results leave the switch at the rate the rounds complete, which is
    // the uplinks' rate, and the downlinks carry it.
    assert_eq!(report.queue_drops_down, 0);
}

/// One worker behind a slower link than the others: the rounds need every worker, so
/// its link sets everyone's pace. Nothing is sent twice: the waits are taken for
/// queueing, not loss.
#[test]
fn one_slow_link_sets_the_pace_of_every_worker() {
    let window_bytes = 128 * PACKET_BYTES;
    let slow = RateLimit { bits_per_second: 50_000_000, queue_bytes: 2 * window_bytes, burst_bytes: 0 };
    jobs_at_the_pace_of(behind_links(200_000_000).with_rank_rate(3, slow), slow, 2);
}

/// What a fixed window does to a queue that can hold it, unpaced: the whole window waits
/// in the bottleneck's queue, a standing delay of about a window's bytes at the link rate
/// (5.5 ms at 200 Mbit/s for 128 packets of 1076 bytes). The queue towards the switch
/// holds it; the results, which the uplinks pace, never queue on downlinks of the same
/// rate.
#[test]
fn a_fixed_window_stands_in_the_queue_of_a_slower_link() {
    let mut config = behind_links(200_000_000);
    config.pacing.enabled = false;
    let limit = config.uplink.rate.unwrap();
    let window = limit.serialization(128 * PACKET_BYTES);
    let mut cluster = Cluster::new(config).unwrap();
    let len: usize = 1 << 20;
    for _ in 0..2 {
        let report = cluster.allreduce(&inputs(4, len), false).unwrap();
        assert_eq!(report.outputs[0], expected(4, len));
        let waits = report.longest_queue_wait;
        // The window is offered at once: all but one packet queue behind the first.
        let queued = limit.serialization(127 * PACKET_BYTES);
        assert_eq!(waits.up, queued, "against a window of {window:?}");
        assert_eq!(waits.down, Duration::ZERO, "results queue: {waits:?}");
    }

    // Without a rate limit, nothing queues.
    let mut unlimited = Cluster::new(ClusterConfig::new(4, 128, 256)).unwrap();
    let report = unlimited.allreduce(&inputs(4, 4096), false).unwrap();
    assert_eq!(report.longest_queue_wait, Default::default());
}

/// Links behind queues of 5 ms, shorter than the window, with tbf's default bucket of
/// 64 KiB: a fixed window overflows them at every job. Paced, from the second job on,
/// the links set the time within 10 %, and little reaches the switch twice (< 1.5 %:
/// up to 0.65 % while overflows whose losses came to light out of order went unseen, and
/// the delay rule paced every worker; up to 1.01 % since the first job's overflow gives
/// some workers a measured rate, whose jobs take 1.01-1.03 of the model against
/// 1.01-1.02).
#[test]
fn shallow_queues_lose_little_once_paced() {
    for rate in [200_000_000, 50_000_000] {
        let limit = RateLimit::new(rate, Duration::from_millis(5)).with_burst(64 * 1024);
        let mut config = behind_links(rate).with_rate(limit);
        config.seed = 7;
        let model = limit.serialization(4096 * PACKET_BYTES);
        let mut cluster = Cluster::new(config).unwrap();
        let len: usize = 1 << 20;
        for job in 0..5 {
            let report = cluster.allreduce(&inputs(4, len), false).unwrap();
            assert!(report.outputs.iter().all(|output| *output == expected(4, len)));
            let ratio = report.elapsed.as_secs_f64() / model.as_secs_f64();
            let case = format!(
                "{rate} bit/s, job {job}: {ratio:.3} of the model, {} dropped, {} twice",
                report.queue_drops, report.switch.duplicates
            );
            if job > 0 {
                assert!(ratio < 1.10, "{case}");
                assert!(report.switch.duplicates * 1000 < report.switch.contributions * 15, "{case}");
            }
        }
    }
}

/// Only a queue engages the pacer: lost packets and a late rank lengthen some round
/// trips, never all, and leave every worker unpaced.
#[test]
fn loss_and_a_late_rank_never_engage_the_pacer() {
    let len: usize = 1 << 18;
    let mut lossy = ClusterConfig::new(4, 128, 256).with_faults(0.02);
    lossy.seed = 3;
    let mut late = ClusterConfig::new(4, 128, 256);
    late.start_delays = vec![Duration::ZERO, Duration::ZERO, Duration::ZERO, Duration::from_millis(50)];
    for config in [lossy, late] {
        let mut cluster = Cluster::new(config).unwrap();
        for job in 0..4 {
            let report = cluster.allreduce(&inputs(4, len), false).unwrap();
            assert!(report.outputs.iter().all(|output| *output == expected(4, len)), "job {job}");
            assert!(
                report.workers.iter().all(|counters| counters.paced == 0),
                "job {job}: {:?}",
                report.workers
            );
        }
    }
}
