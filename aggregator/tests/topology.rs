//! The simulated network's topology: frames counted with their headers, a switch on a
//! server behind a link of its own, shards on several, and the ring allreduce over the
//! same links.

use std::time::Duration;

use netagg_aggregator::sim::{
    Cluster, ClusterConfig, LinkFaults, Racks, RateLimit, Ring, SimError, TcpSegments, Tensor,
};
use netagg_wire::packet::datagram_len;

const PACKET_ELEMENTS: u16 = 256;
const FRAME_BYTES: u64 = datagram_len(256) as u64 + 42;

fn inputs(workers: u16, len: usize) -> Vec<Tensor> {
    (0..workers).map(|rank| Tensor::Int32((0..len as i32).map(|i| i ^ rank as i32).collect())).collect()
}

fn expected(workers: u16, len: usize) -> Tensor {
    Tensor::Int32((0..len as i32).map(|i| (0..workers as i32).map(|rank| i ^ rank).sum()).collect())
}

/// `workers` workers behind 100 Mbit/s links with 100 ms queues, 1 ms each way, whose
/// frames carry Ethernet's, IPv4's and UDP's headers, as netagg-run's links do.
fn emulated(workers: u16) -> ClusterConfig {
    let mut config = ClusterConfig::new(workers, 256, PACKET_ELEMENTS)
        .with_rate(RateLimit::new(100_000_000, Duration::from_millis(100)));
    config.uplink.latency = Duration::from_millis(1);
    config.downlink.latency = Duration::from_millis(1);
    config.frame_overhead_bytes = 42;
    config.retransmit_timeout = Duration::from_millis(10);
    config.max_retransmit_timeout = Duration::from_millis(640);
    config
}

#[test]
fn frames_count_their_headers_and_the_link_sets_the_time() {
    let len = 1 << 18;
    let config = emulated(4);
    let limit = config.uplink.rate.unwrap();
    let mut cluster = Cluster::new(config).unwrap();
    let report = cluster.allreduce(&inputs(4, len), false).unwrap();
    assert_eq!(report.outputs[0], expected(4, len));
    // Every frame once up and once down, then a round trip's latency.
    let model = limit.serialization(1024 * FRAME_BYTES) + Duration::from_millis(2);
    let ratio = report.elapsed.as_secs_f64() / model.as_secs_f64();
    assert!((1.0..1.02).contains(&ratio), "{:?} against {model:?}", report.elapsed);
}

/// A switch on a server whose link runs at the workers' rate carries N tensors in and
/// N out: N times the time of a switch that is the network.
#[test]
fn a_switch_behind_a_link_of_the_workers_rate_takes_n_times_as_long() {
    let len = 1 << 16;
    let mut ideal = Cluster::new(emulated(4)).unwrap();
    let ideal = ideal.allreduce(&inputs(4, len), false).unwrap().elapsed;
    let mut config = emulated(4);
    config.switch_link = config.uplink.rate;
    let limit = config.uplink.rate.unwrap();
    let mut server = Cluster::new(config).unwrap();
    let report = server.allreduce(&inputs(4, len), false).unwrap();
    assert!(report.outputs.iter().all(|output| *output == expected(4, len)));
    assert_eq!(report.queue_drops, 0);
    let model = limit.serialization(4 * 256 * FRAME_BYTES);
    let ratio = report.elapsed.as_secs_f64() / model.as_secs_f64();
    assert!((1.0..1.05).contains(&ratio), "{:?} against {model:?} (ideal {ideal:?})", report.elapsed);
    assert!(report.elapsed > 3 * ideal, "{:?} against {ideal:?}", report.elapsed);
}

/// Shards on switch hosts of the workers' rate, as `netagg-run --switches K` runs them:
/// each host's link carries N/K tensors each way, so that N shards take the time of a
/// switch that is the network. Each switch's results judge only the sendings to it: on
/// lossless links nothing is resent or asked after, though the shards answer behind
/// queues of their own (taken as evidence about each other's sendings, they had the
/// workers resend up to a seventh of their packets).
#[test]
fn shards_on_hosts_of_the_workers_rate_carry_n_over_k_tensors_and_resend_nothing() {
    let len = 1 << 20;
    let mut times = Vec::new();
    for shards in [1, 2, 4] {
        let mut config = emulated(4);
        config.switch_link = config.uplink.rate;
        config.shards = shards;
        let limit = config.uplink.rate.unwrap();
        let report = Cluster::new(config).unwrap().allreduce(&inputs(4, len), false).unwrap();
        assert!(report.outputs.iter().all(|output| *output == expected(4, len)), "{shards} shards");
        assert_eq!(report.queue_drops, 0, "{shards} shards");
        for worker in &report.workers {
            let recoveries = (worker.retransmissions, worker.gap_requests, worker.timeouts);
            assert_eq!(recoveries, (0, 0, 0), "{shards} shards: {worker:?}");
        }
        assert_eq!(report.switch.results_resent, 0, "{shards} shards");
        // 4,096 frames of each worker's through the switch hosts' links.
        let model = limit.serialization(4 * 4096 * FRAME_BYTES / u64::from(shards));
        let ratio = report.elapsed.as_secs_f64() / model.as_secs_f64();
        // The first window's sendings reach the shards in runs of their slot ranges, so
        // that one host's link queues them while the others idle: about 20 ms a job at 4
        // shards (the emulated network, whose workers are not in lockstep, measured
        // 1.02-1.04 of its model there).
        assert!((1.0..1.07).contains(&ratio), "{shards} shards: {:?} against {model:?}", report.elapsed);
        times.push(report.elapsed);
    }
    assert!(times[2] * 3 < times[0], "{times:?}");
}

#[test]
fn shards_are_refused_without_slots_for_each_or_beside_racks() {
    for (shards, slots, racks) in [(0, 256, None), (5, 4, None), (2, 256, Some(2))] {
        let mut config = ClusterConfig::new(4, slots, PACKET_ELEMENTS);
        config.shards = shards;
        config.racks =
            racks.map(|count| Racks { count, uplink: LinkFaults::perfect(Duration::ZERO), tree: false });
        let error = Cluster::new(config).unwrap_err();
        let racks = racks.unwrap_or(0);
        assert_eq!(error, SimError::Shards { shards, slots, racks });
        let text = format!(
            "{shards} shards for {slots} slots and {racks} racks: give 1 to {slots} shards, without racks"
        );
        assert_eq!(error.to_string(), text);
    }
}

fn ring(config: ClusterConfig) -> Ring {
    Ring::new(config, TcpSegments::ETHERNET)
}

/// Each of the ring's 2(N−1) steps moves a chunk through the sender's and the
/// receiver's links: all its segments at the rate, the last one again on the second
/// link, and both latencies, once the window has opened.
#[test]
fn a_lossless_ring_takes_its_steps_at_the_link_rate() {
    let config = emulated(4);
    let limit = config.uplink.rate.unwrap();
    // Chunks of 700 whole segments.
    let tensor_bytes = 4 * 700 * 1448;
    let mut ring = ring(config);
    let warm_up = ring.allreduce(tensor_bytes);
    let report = ring.allreduce(tensor_bytes);
    let step = limit.serialization(700 * 1514) + limit.serialization(1514) + Duration::from_millis(2);
    assert_eq!(report.elapsed, 6 * step);
    assert_eq!(report.retransmissions, 0);
    // The first waited for its windows to open from 10 segments.
    assert!(warm_up.elapsed > report.elapsed + Duration::from_millis(4), "{:?}", warm_up.elapsed);
    assert_eq!(Ring::new(emulated(1), TcpSegments::ETHERNET).allreduce(tensor_bytes).elapsed, Duration::ZERO);
}

/// Two allreduces on a fresh ring; the second's report.
fn warm(config: ClusterConfig, tensor_bytes: u64) -> netagg_aggregator::sim::RingReport {
    let mut ring = ring(config);
    ring.allreduce(tensor_bytes);
    ring.allreduce(tensor_bytes)
}

#[test]
fn the_ring_waits_for_a_late_rank_and_for_its_lost_segments() {
    let tensor_bytes = 1 << 20;
    let on_time = warm(emulated(4), tensor_bytes).elapsed;
    let mut late = emulated(4);
    late.start_delays = vec![Duration::ZERO, Duration::ZERO, Duration::from_millis(50)];
    let late = warm(late, tensor_bytes).elapsed;
    assert!(late >= on_time + Duration::from_millis(45) && late <= on_time + Duration::from_millis(50));

    let mut lossy = emulated(4);
    lossy.uplink.drop = 0.01;
    lossy.downlink.drop = 0.01;
    let report = warm(lossy.clone(), tensor_bytes);
    // 6 steps of 4 chunks of 182 segments, each lost with about 2 % chance.
    assert!((40..140).contains(&report.retransmissions), "{}", report.retransmissions);
    assert!(
        report.elapsed > on_time && report.elapsed < on_time * 3,
        "{:?} against {on_time:?}",
        report.elapsed
    );
    assert_eq!(report, warm(lossy, tensor_bytes), "seeded");
}
