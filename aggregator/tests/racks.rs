//! The simulated network of racks: racks of workers behind uplinks of their own, with one
//! switch at the core (flat) or a switch per rack that sums its rack first and joins the
//! upper switch's session as one member (a two-level tree), each rack's switch running
//! the real engine with its uplink core.

use std::time::Duration;

use netagg_aggregator::sim::{
    Cluster, ClusterConfig, LinkFaults, Racks, RateLimit, Ring, TcpSegments, Tensor,
};
use netagg_wire::packet::datagram_len;

const PACKET_ELEMENTS: u16 = 64;
const OVERHEAD: u64 = 42;
const FRAME_BYTES: u64 = datagram_len(PACKET_ELEMENTS as usize) as u64 + OVERHEAD;

fn inputs(workers: u16, len: usize) -> Vec<Tensor> {
    (0..workers)
        .map(|rank| Tensor::Int32((0..len as i32).map(|i| (i ^ rank as i32).wrapping_mul(7919)).collect()))
        .collect()
}

fn expected(workers: u16, len: usize) -> Tensor {
    let sum =
        |i: i32| (0..workers as i32).fold(0i32, |sum, rank| sum.wrapping_add((i ^ rank).wrapping_mul(7919)));
    Tensor::Int32((0..len as i32).map(sum).collect())
}

/// `workers` workers in `racks` racks behind perfect 10 µs uplinks, frames counted with
/// their headers.
fn racked(workers: u16, racks: u16, tree: bool) -> ClusterConfig {
    let mut config = ClusterConfig::new(workers, 16, PACKET_ELEMENTS);
    config.frame_overhead_bytes = OVERHEAD;
    let uplink = LinkFaults::perfect(Duration::from_micros(10));
    config.racks = Some(Racks { count: racks, uplink, tree });
    config
}

#[test]
fn a_tree_of_racks_sums_int32_exactly_dense_and_sparse_over_several_jobs() {
    // Uneven racks (2, 2 and 1 workers... as rack_ranks splits 5 over 3) and a tensor
    // whose last packet is partial.
    for (workers, racks) in [(4, 2), (5, 3), (8, 4)] {
        let len = 64 * 20 + 17;
        let mut cluster = Cluster::new(racked(workers, racks, true)).unwrap();
        for job in 0..3 {
            let report = cluster.allreduce(&inputs(workers, len), job == 1).unwrap();
            for (rank, output) in report.outputs.iter().enumerate() {
                assert_eq!(
                    *output,
                    expected(workers, len),
                    "{workers} in {racks} racks, job {job}, rank {rank}"
                );
            }
            assert_eq!(report.racks.len(), usize::from(racks));
        }
    }
}

#[test]
fn no_racks_or_more_racks_than_workers_are_refused_naming_both() {
    for tree in [false, true] {
        for (workers, racks) in [(4, 0), (4, 5)] {
            let error = Cluster::new(racked(workers, racks, tree)).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!("racks.count {racks} with {workers} workers: give 1 to {workers} racks")
            );
        }
    }
    assert!(Cluster::new(racked(4, 4, true)).is_ok(), "a rack per worker");
}

#[test]
fn sparse_racks_send_their_blocks_up_and_not_the_others() {
    let (workers, racks, blocks) = (4u16, 2u16, 128usize);
    let len = blocks * usize::from(PACKET_ELEMENTS);
    // Rank r fills the blocks b with b % 4 == r: each rack 64 of the 128.
    let inputs: Vec<Tensor> = (0..workers)
        .map(|rank| {
            let value = |i: usize| if (i / 64) % 4 == usize::from(rank) { i as i32 + 1 } else { 0 };
            Tensor::Int32((0..len).map(value).collect())
        })
        .collect();
    let expected = Tensor::Int32((0..len as i32).map(|i| i + 1).collect());
    let mut cluster = Cluster::new(racked(workers, racks, true)).unwrap();
    let report = cluster.allreduce(&inputs, true).unwrap();
    assert!(report.outputs.iter().all(|output| *output == expected));
    for (rack, traffic) in report.racks.iter().enumerate() {
        let uplink = traffic.uplink.unwrap();
        // Its 64 blocks, and at most one start round of each of the 16 slots' streams
        // besides.
        assert!((64..=64 + 16).contains(&uplink.sent_up), "rack {rack}: {} sent up", uplink.sent_up);
        assert_eq!(uplink.resent_up, 0, "rack {rack}");
    }
}

/// Lossless, each uplink carries one tensor each way in a tree (the rack's partial sums
/// up, the whole sums down), and a flat network's as many as the rack has workers.
#[test]
fn a_lossless_tree_puts_one_tensor_per_rack_on_each_uplink_each_way() {
    let (workers, racks, blocks) = (8u16, 2u16, 40u64);
    let len = blocks as usize * usize::from(PACKET_ELEMENTS);
    let tensor = blocks * FRAME_BYTES;
    let mut tree = Cluster::new(racked(workers, racks, true)).unwrap();
    let report = tree.allreduce(&inputs(workers, len), false).unwrap();
    assert!(report.outputs.iter().all(|output| *output == expected(workers, len)));
    for (rack, traffic) in report.racks.iter().enumerate() {
        assert_eq!((traffic.bytes_up, traffic.bytes_down), (tensor, tensor), "rack {rack}");
        let uplink = traffic.uplink.unwrap();
        assert_eq!((uplink.sent_up, uplink.results_down), (blocks, blocks), "rack {rack}");
        assert_eq!((uplink.resent_up, uplink.requests, uplink.acks), (0, 0, 0), "rack {rack}");
    }
    let mut flat = Cluster::new(racked(workers, racks, false)).unwrap();
    let report = flat.allreduce(&inputs(workers, len), false).unwrap();
    assert!(report.outputs.iter().all(|output| *output == expected(workers, len)));
    for (rack, traffic) in report.racks.iter().enumerate() {
        let rack_workers = u64::from(workers / racks);
        let each_way = rack_workers * tensor;
        assert_eq!((traffic.bytes_up, traffic.bytes_down), (each_way, each_way), "rack {rack}");
        assert_eq!(traffic.uplink, None, "one switch at the core: no rack has an upper switch");
    }
}

#[test]
fn losses_on_the_uplinks_are_recovered_by_the_racks_switches() {
    let (workers, racks) = (6u16, 2u16);
    let len = 64 * 60;
    let mut config = racked(workers, racks, true);
    config.seed = 11;
    let mut uplink = LinkFaults::lossy(0.05, Duration::from_micros(10));
    uplink.duplicate = 0.0;
    config.racks = Some(Racks { count: racks, uplink, tree: true });
    let mut cluster = Cluster::new(config).unwrap();
    let mut resent = 0;
    for job in 0..3 {
        let report = cluster.allreduce(&inputs(workers, len), false).unwrap();
        assert!(report.outputs.iter().all(|output| *output == expected(workers, len)), "job {job}");
        for traffic in &report.racks {
            let uplink = traffic.uplink.unwrap();
            resent += uplink.resent_up + uplink.requests;
            assert_eq!(uplink.sent_up, 60, "job {job}: each round went up once first");
        }
    }
    assert!(resent > 0, "5 % loss each way over 360 rounds lost some");
}

/// 2 racks of 2 workers at 40 Mbit/s behind 20 Mbit/s uplinks (4:1).
fn oversubscribed(tree: bool) -> ClusterConfig {
    let mut config = racked(4, 2, tree).with_rate(RateLimit::new(40_000_000, Duration::from_millis(100)));
    config.retransmit_timeout = Duration::from_millis(10);
    config.max_retransmit_timeout = Duration::from_millis(640);
    let racks = config.racks.as_mut().unwrap();
    racks.uplink.rate = Some(RateLimit::new(20_000_000, Duration::from_millis(100)));
    config
}

/// The tree takes twice a worker link's time for the tensor (one tensor at half the rate
/// through each uplink), one switch at the core four times (two tensors through each),
/// and the ring's 2(N−1) steps each cross an uplink: six quarters of the tensor at the
/// uplink's rate.
#[test]
fn on_oversubscribed_uplinks_the_tree_takes_half_the_flat_switch_s_time_and_the_ring_crosses_the_uplinks() {
    let len = 64 * 400;
    let time = |tree: bool| {
        let mut cluster = Cluster::new(oversubscribed(tree)).unwrap();
        let report = cluster.allreduce(&inputs(4, len), false).unwrap();
        assert!(report.outputs.iter().all(|output| *output == expected(4, len)));
        report.elapsed.as_secs_f64()
    };
    let one_tensor =
        RateLimit::new(40_000_000, Duration::ZERO).serialization(400 * FRAME_BYTES).as_secs_f64();
    let (tree, flat) = (time(true), time(false));
    assert!((tree / (2.0 * one_tensor) - 1.0).abs() < 0.05, "tree {tree} s against {}", 2.0 * one_tensor);
    assert!((flat / (4.0 * one_tensor) - 1.0).abs() < 0.05, "flat {flat} s against {}", 4.0 * one_tensor);

    let mut ring = Ring::new(oversubscribed(false), TcpSegments::ETHERNET);
    let tensor_bytes = 4 * len as u64;
    ring.allreduce(tensor_bytes);
    let ring = ring.allreduce(tensor_bytes).elapsed.as_secs_f64();
    // A quarter of the tensor in 18 segments, 66 bytes of headers each, at 20 Mbit/s.
    let step =
        RateLimit::new(20_000_000, Duration::ZERO).serialization(tensor_bytes / 4 + 18 * 66).as_secs_f64();
    assert!((ring / (6.0 * step) - 1.0).abs() < 0.05, "ring {ring} s against {}", 6.0 * step);
    let mut flat_ring =
        Ring::new(ClusterConfig { racks: None, ..oversubscribed(false) }, TcpSegments::ETHERNET);
    flat_ring.allreduce(tensor_bytes);
    let flat_ring = flat_ring.allreduce(tensor_bytes).elapsed.as_secs_f64();
    assert!(flat_ring < 0.6 * ring, "without racks the ring runs at the workers' 40 Mbit/s: {flat_ring} s");
}

/// Switches on servers behind links of the workers' rate, uplinks unlimited: a rack's
/// switch takes its 2 workers' tensors and the upper switch's result in, and sends its
/// partial sum up and the result to its 2 workers out: 3 tensors each way on its link,
/// 3 times a worker link's time. One switch at the core on a server carries all 4.
#[test]
fn a_tree_of_switches_on_servers_binds_on_the_rack_switch_s_link() {
    let len = 64 * 400;
    let limit = RateLimit::new(40_000_000, Duration::from_millis(100));
    let time = |tree: bool| {
        let mut config = racked(4, 2, tree).with_rate(limit);
        config.switch_link = Some(limit);
        config.retransmit_timeout = Duration::from_millis(10);
        config.max_retransmit_timeout = Duration::from_millis(640);
        let mut cluster = Cluster::new(config).unwrap();
        let report = cluster.allreduce(&inputs(4, len), false).unwrap();
        assert!(report.outputs.iter().all(|output| *output == expected(4, len)));
        assert_eq!(report.queue_drops, 0);
        report.elapsed.as_secs_f64()
    };
    let one_tensor = limit.serialization(400 * FRAME_BYTES).as_secs_f64();
    let (tree, flat) = (time(true), time(false));
    assert!((tree / (3.0 * one_tensor) - 1.0).abs() < 0.05, "tree {tree} s against {}", 3.0 * one_tensor);
    assert!((flat / (4.0 * one_tensor) - 1.0).abs() < 0.05, "flat {flat} s against {}", 4.0 * one_tensor);
}
