//! What an allreduce should take on given links: netagg through its switch, and the ring
//! that MPI and NCCL run, so that a time measured on emulated links can be read against
//! what the links allow. The benchmarks print it beside their measurements, and the
//! Python module (`netagg.model`) gives it to training scripts. What it cannot model (a
//! rate below 1 bit/s, a time past what a `Duration` holds) is a [`ModelError`].
//!
//! Each worker has a link of its own to the fabric, full duplex, at some rate each way
//! and with some one-way delay. Where the sums are made is [`Aggregators`]: a switch that
//! is the network (its ports run at line rate, so its link is never the bottleneck), or
//! switch processes on servers, each behind a link of its own, over which a session's
//! slots are sharded. Both models count every byte a link carries: payload, the
//! transport's headers and Ethernet's.
//!
//! - **netagg**: each worker sends its tensor once, in packets, and receives the sum
//!   once. The busiest link sets the pace, since every slot waits for every worker: with
//!   one ideal switch, the slowest worker link; with `K` switches on hosts of their own,
//!   each host's link carries `N/K` tensors each way (`N` workers' shares in, as many sums
//!   out), so `K < N` hosts on links of the workers' rate bind at `N/K` times a worker
//!   link's time; colocated (one switch on each of the `N` workers' hosts), each host's
//!   link carries `2(N−1)/N` tensors each way (its own shares to the others' switches and
//!   their sums back, and the others' shares of its switch's slots in and their sums out),
//!   a ring's bytes. On a network of racks ([`RackNetwork`]), a switch at the core takes
//!   each rack's tensors through the rack's uplink (as many as the rack has workers, each
//!   way); a two-level tree ([`Aggregators::Tree`]) sends one partial sum up each uplink
//!   and one result down, and a rack's switch on a server carries its workers' tensors and
//!   the upper switch's result each way, the upper switch's server one tensor per rack.
//!   A worker keeps at most its window of packets in flight, so it moves
//!   at most a window per round trip, each window's results back a round trip after it
//!   left. The job takes the longer of that and the busiest link's bytes at its rate plus
//!   the rest of one packet's round trip (its delays, and its serialisation on the other
//!   links of its path), which fills and drains the pipeline.
//! - **ring** (bandwidth-optimal, as MPI runs it for large tensors): 2(N−1) steps, in
//!   each of which every rank sends 1/N of the tensor to the next rank and receives 1/N
//!   from the previous one, over TCP. A step cannot start before the previous one's
//!   chunk has arrived, so each costs its chunk's time on the slowest link plus the
//!   chunk's path delay (its sender's link and its receiver's). On a network of racks of
//!   contiguous ranks, each uplink carries one ring edge each way (its rack's last rank
//!   to the next rack's first, and into its first rank), so a slower uplink sets the
//!   steps' pace as a slow worker link does.

use std::fmt;
use std::time::Duration;

/// Bytes Ethernet (14), IPv4 (20) and UDP (8) add to every netagg datagram, as a
/// shaping queue counts them.
pub const UDP_OVERHEAD_BYTES: u64 = 14 + 20 + 8;
/// netagg's own header and checksum: what a datagram carries besides its payload.
pub const NETAGG_HEADER_BYTES: u64 = netagg_wire::packet::datagram_len(0) as u64;
/// A TCP segment's payload on a 1500-byte MTU with timestamps, and what Ethernet, IPv4
/// and TCP (with timestamps) add to it.
pub const TCP_SEGMENT_BYTES: u64 = 1448;
pub const TCP_OVERHEAD_BYTES: u64 = 14 + 20 + 32;

/// One worker's link: rate each way, and one-way delay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    pub bits_per_second: f64,
    pub delay: Duration,
}

impl Link {
    fn seconds_for(&self, bytes: f64) -> f64 {
        bytes * 8.0 / self.bits_per_second
    }
}

/// Where a netagg session's sums are made.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Aggregators {
    /// One switch that is the network: its ports run at line rate.
    Ideal,
    /// `count` switch processes (shards) on hosts of their own, each behind `link`; each
    /// sums `1/count` of every job's slots.
    Dedicated { count: usize, link: Link },
    /// One switch on each worker's host, behind that worker's link (on a flat network).
    Colocated,
    /// A two-level tree on a network of racks: a switch per rack sums its rack's workers
    /// and sends one partial sum up its uplink to an upper switch at the core. Each
    /// switch is the network (`None`) or a process on a server behind `Some(link)`.
    Tree { switch_link: Option<Link> },
}

/// Racks of contiguous ranks, each behind an uplink of its own to the network's core.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RackNetwork {
    pub count: usize,
    /// Each rack's uplink (an unlimited one at an infinite rate).
    pub uplink: Link,
}

/// An allreduce and the network it runs on.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    /// Every worker's link, by rank.
    pub links: Vec<Link>,
    /// Where netagg's sums are made (the ring makes its own).
    pub aggregators: Aggregators,
    /// The racks, on a network of racks; `None`: every link meets at one core.
    pub racks: Option<RackNetwork>,
    pub tensor_bytes: u64,
    /// Payload bytes of one netagg packet (`packet_numel` × 4).
    pub packet_payload_bytes: u64,
    /// Packets one worker keeps in flight, over all its threads
    /// (`max_outstanding_packets`).
    pub window_packets: u64,
}

/// What bounded a predicted netagg allreduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// The slowest link's rate.
    LinkRate,
    /// The window: a round trip's worth of packets in flight was less than the link
    /// could carry in that time.
    Window,
}

/// Why the model cannot predict a scenario.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// A link's rate is below 1 bit/s, or not a number (infinite is an unlimited link).
    #[error("{link}: {bits_per_second} bit/s is not a rate of at least 1 bit/s")]
    Rate { link: LinkRole, bits_per_second: f64 },
    /// The predicted time does not fit a [`Duration`] (about 585 billion years).
    #[error(
        "{allreduce} of {tensor_bytes} bytes would take {seconds:e} s on these links, more than \
         a Duration holds: give a smaller tensor or faster links"
    )]
    TooLong { allreduce: &'static str, tensor_bytes: u64, seconds: f64 },
}

/// Which link of a [`Scenario`] an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkRole {
    /// The link of the worker of this rank.
    Worker(usize),
    /// The link of a switch host ([`Aggregators::Dedicated`] or [`Aggregators::Tree`]).
    Switch,
    /// The racks' uplink ([`RackNetwork`]).
    Uplink,
}

impl fmt::Display for LinkRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkRole::Worker(rank) => write!(f, "rank {rank}'s link"),
            LinkRole::Switch => f.write_str("the switch hosts' link"),
            LinkRole::Uplink => f.write_str("the racks' uplink"),
        }
    }
}

/// A predicted time, and what set it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    pub time: Duration,
    pub bound: Bound,
}

impl Scenario {
    /// The same links for `workers` workers.
    pub fn uniform(
        workers: usize,
        link: Link,
        tensor_bytes: u64,
        packet_payload_bytes: u64,
        window_packets: u64,
    ) -> Scenario {
        Scenario {
            links: vec![link; workers],
            aggregators: Aggregators::Ideal,
            racks: None,
            tensor_bytes,
            packet_payload_bytes,
            window_packets,
        }
    }

    fn slowest_rate(&self) -> f64 {
        self.links.iter().map(|link| link.bits_per_second).fold(f64::INFINITY, f64::min)
    }

    fn longest_delay(&self) -> Duration {
        self.links.iter().map(|link| link.delay).max().unwrap_or_default()
    }

    /// Every link's rate is one the model can divide by: at least 1 bit/s, or infinite.
    fn check_rates(&self) -> Result<(), ModelError> {
        let workers = self.links.iter().enumerate().map(|(rank, link)| (LinkRole::Worker(rank), link));
        let switch = match &self.aggregators {
            Aggregators::Dedicated { link, .. } | Aggregators::Tree { switch_link: Some(link) } => Some(link),
            _ => None,
        };
        let uplink = self.racks.as_ref().map(|racks| (LinkRole::Uplink, &racks.uplink));
        let mut links = workers.chain(switch.map(|link| (LinkRole::Switch, link))).chain(uplink);
        match links.find(|(_, link)| link.bits_per_second.is_nan() || link.bits_per_second < 1.0) {
            Some((role, link)) => Err(ModelError::Rate { link: role, bits_per_second: link.bits_per_second }),
            None => Ok(()),
        }
    }

    /// `seconds` of `allreduce` as a [`Duration`], or the error saying it does not fit.
    fn duration(&self, allreduce: &'static str, seconds: f64) -> Result<Duration, ModelError> {
        Duration::try_from_secs_f64(seconds).map_err(|_| ModelError::TooLong {
            allreduce,
            tensor_bytes: self.tensor_bytes,
            seconds,
        })
    }

    /// netagg through its switch, or its switches.
    pub fn netagg(&self) -> Result<Prediction, ModelError> {
        self.check_rates()?;
        let packets = self.tensor_bytes.div_ceil(self.packet_payload_bytes.max(1));
        // Byte counts in floating point: a tensor near u64's range overflows it with its
        // headers, and the model's figures need no more than f64's precision.
        let overhead = (NETAGG_HEADER_BYTES + UDP_OVERHEAD_BYTES) as f64;
        let packet_bytes = self.packet_payload_bytes as f64 + overhead;
        let wire_bytes = self.tensor_bytes as f64 + packets as f64 * overhead;
        let slowest = Link { bits_per_second: self.slowest_rate(), delay: self.longest_delay() };
        let workers = self.links.len() as f64;
        // The links a packet's round trip crosses (up and down each, with its delay and
        // its own serialisation), and the tensors (of `wire_bytes` each) each link on the
        // way carries each way: the busiest sets the time.
        let (mut path, mut loads): (Vec<Link>, Vec<(Link, f64)>) = match self.aggregators {
            Aggregators::Ideal => (vec![slowest], vec![(slowest, 1.0)]),
            Aggregators::Dedicated { count, link } => {
                (vec![slowest, link], vec![(slowest, 1.0), (link, workers / count.max(1) as f64)])
            }
            // A packet to another worker's switch crosses two worker links each way.
            Aggregators::Colocated => {
                (vec![slowest, slowest], vec![(slowest, 2.0 * (workers - 1.0) / workers)])
            }
            Aggregators::Tree { switch_link } => {
                let (racks, uplink) =
                    self.racks.map_or((1.0, None), |racks| (racks.count as f64, Some(racks.uplink)));
                let mut path = vec![slowest];
                let mut loads = vec![(slowest, 1.0)];
                path.extend(uplink);
                loads.extend(uplink.map(|uplink| (uplink, 1.0)));
                if let Some(link) = switch_link {
                    // The rack's switch's server link twice each way (in from the workers,
                    // out up the uplink, and back), and the upper switch's once.
                    path.extend([link, link, link]);
                    loads.extend([(link, self.largest_rack() + 1.0), (link, racks)]);
                }
                (path, loads)
            }
        };
        // A switch at the core takes each rack's workers' tensors through its uplink.
        if let (Some(racks), false) = (self.racks, matches!(self.aggregators, Aggregators::Tree { .. })) {
            path.push(racks.uplink);
            loads.push((racks.uplink, self.largest_rack()));
        }
        let hop = |link: &Link| 2.0 * link.delay.as_secs_f64() + 2.0 * link.seconds_for(packet_bytes);
        let round_trip: f64 = path.iter().map(hop).sum();
        let (busiest_seconds, busiest) =
            loads.iter().map(|(link, tensors)| (link.seconds_for(tensors * wire_bytes), link)).fold(
                (0.0, None),
                |busiest, (seconds, link)| {
                    if seconds > busiest.0 {
                        (seconds, Some(link))
                    } else {
                        busiest
                    }
                },
            );
        // The last packet's serialisation on the busiest link is among its bytes already,
        // and only once in the job; the busiest link is always on the packets' path.
        let last_packet = busiest.map_or(0.0, |link| link.seconds_for(packet_bytes));
        let at_link_rate = busiest_seconds + round_trip - last_packet;
        let rounds = packets.div_ceil(self.window_packets.max(1)) as f64;
        let at_window = rounds * round_trip;
        let (seconds, bound) = if at_window > at_link_rate {
            (at_window, Bound::Window)
        } else {
            (at_link_rate, Bound::LinkRate)
        };
        Ok(Prediction { time: self.duration("netagg's allreduce", seconds)?, bound })
    }

    /// The most workers a rack holds: racks of contiguous ranks split as evenly as may be.
    fn largest_rack(&self) -> f64 {
        let racks = self.racks.map_or(1, |racks| racks.count.max(1));
        self.links.len().div_ceil(racks) as f64
    }

    /// A bandwidth-optimal ring over TCP.
    pub fn ring(&self) -> Result<Duration, ModelError> {
        self.check_rates()?;
        let workers = self.links.len() as u64;
        if workers < 2 {
            return Ok(Duration::ZERO);
        }
        let chunk = self.tensor_bytes.div_ceil(workers);
        let segments = chunk.div_ceil(TCP_SEGMENT_BYTES);
        let chunk_wire_bytes = chunk as f64 + (segments * TCP_OVERHEAD_BYTES) as f64;
        let slowest = Link { bits_per_second: self.slowest_rate(), delay: self.longest_delay() };
        let mut step = slowest.seconds_for(chunk_wire_bytes) + 2.0 * slowest.delay.as_secs_f64();
        // Between racks a step's chunk also crosses an uplink up and another down.
        if let Some(racks) = self.racks.filter(|racks| racks.count > 1) {
            let crossing =
                racks.uplink.seconds_for(chunk_wire_bytes) + 2.0 * racks.uplink.delay.as_secs_f64();
            step = step.max(crossing + 2.0 * slowest.delay.as_secs_f64());
        }
        self.duration("the ring's allreduce", 2.0 * (workers - 1) as f64 * step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(mbit: f64, delay_ms: u64) -> Link {
        Link { bits_per_second: mbit * 1e6, delay: Duration::from_millis(delay_ms) }
    }

    fn close(actual: Duration, expected_seconds: f64) -> bool {
        (actual.as_secs_f64() - expected_seconds).abs() < 1e-9 * expected_seconds.max(1.0)
    }

    #[test]
    fn netagg_at_the_link_rate_counts_every_header() {
        // 16 MiB in 1 KiB packets at 200 Mbit/s, no delay, a window that never binds:
        // 16384 packets of 1024 + 52 + 42 bytes up, then the last one's sum down.
        let scenario = Scenario::uniform(4, link(200.0, 0), 16 << 20, 1024, 1 << 20);
        let prediction = scenario.netagg().unwrap();
        let packet = 1024.0 + 94.0;
        let expected = 16384.0 * packet * 8.0 / 200e6 + packet * 8.0 / 200e6;
        assert_eq!(prediction.bound, Bound::LinkRate);
        assert!(close(prediction.time, expected), "{:?} against {expected}", prediction.time);
    }

    #[test]
    fn a_small_window_on_a_long_path_binds_netagg() {
        // 256 packets in flight, 10 ms each way: at most 256 packets per 20 ms round
        // trip, about 110 Mbit/s of 1 KiB packets, below the 1 Gbit/s link.
        let scenario = Scenario::uniform(4, link(1000.0, 10), 16 << 20, 1024, 256);
        let prediction = scenario.netagg().unwrap();
        assert_eq!(prediction.bound, Bound::Window);
        let round_trip = 0.020 + 2.0 * 1118.0 * 8.0 / 1e9;
        assert!(close(prediction.time, 64.0 * round_trip), "{:?}", prediction.time);
    }

    #[test]
    fn shards_on_hosts_of_the_workers_rate_bind_at_n_over_k_tensors_each_way() {
        // 4 workers at 200 Mbit/s, no delay: the ideal switch's time is one tensor on a
        // worker link; one switch host on a link of the same rate carries 4 tensors each
        // way, 2 hosts 2, 4 hosts 1 (the workers' links bind as much).
        let ideal = Scenario::uniform(4, link(200.0, 0), 16 << 20, 1024, 1 << 20);
        let with = |aggregators| Scenario { aggregators, ..ideal.clone() }.netagg().unwrap();
        let one_tensor = ideal.netagg().unwrap().time.as_secs_f64();
        for (count, tensors) in [(1, 4.0), (2, 2.0), (4, 1.0), (8, 1.0)] {
            let prediction = with(Aggregators::Dedicated { count, link: link(200.0, 0) });
            let ratio = prediction.time.as_secs_f64() / one_tensor;
            // Less the round trip that fills the pipeline, counted once in each.
            assert!((ratio - tensors).abs() < 0.01, "{count} hosts: {ratio} tensors");
            assert_eq!(prediction.bound, Bound::LinkRate);
        }
        // Hosts on links twice as fast halve their share.
        let fast = with(Aggregators::Dedicated { count: 2, link: link(400.0, 0) }).time.as_secs_f64();
        assert!((fast / one_tensor - 1.0).abs() < 0.01, "{}", fast / one_tensor);
    }

    #[test]
    fn colocated_shards_carry_a_rings_bytes_and_cross_two_worker_links() {
        let ideal = Scenario::uniform(4, link(200.0, 5), 16 << 20, 1024, 1 << 20);
        let colocated = Scenario { aggregators: Aggregators::Colocated, ..ideal.clone() };
        let packet_bits = 1118.0 * 8.0;
        let one_tensor = ideal.netagg().unwrap().time.as_secs_f64() - (0.010 + packet_bits / 200e6);
        let round_trip = 2.0 * (0.010 + 2.0 * packet_bits / 200e6);
        let expected = 1.5 * one_tensor + round_trip - packet_bits / 200e6;
        assert!(
            close(colocated.netagg().unwrap().time, expected),
            "{:?} against {expected}",
            colocated.netagg().unwrap().time
        );
        // A small window on the longer round trip binds sooner than with one switch.
        let windowed = Scenario { window_packets: 256, ..colocated.clone() };
        assert_eq!(windowed.netagg().unwrap().bound, Bound::Window);
        assert_eq!(Scenario { window_packets: 256, ..ideal }.netagg().unwrap().bound, Bound::LinkRate);
    }

    #[test]
    fn on_racks_behind_four_to_one_uplinks_a_tree_carries_one_tensor_up_each_and_beats_the_ring() {
        // 2 racks of 2 workers at 40 Mbit/s, each uplink at 20 Mbit/s (2 × 40 / 4), no
        // delay: 16384 packets of 1118 bytes are 18317312 bytes, 3.6634624 s at 40 Mbit/s.
        let racks = RackNetwork { count: 2, uplink: link(20.0, 0) };
        let flat =
            Scenario { racks: Some(racks), ..Scenario::uniform(4, link(40.0, 0), 16 << 20, 1024, 1 << 20) };
        let tree = |switch_link| {
            Scenario { aggregators: Aggregators::Tree { switch_link }, ..flat.clone() }.netagg().unwrap()
        };
        let one_tensor = 3.6634624;
        let (worker_hop, uplink_hop) = (2.0 * 1118.0 * 8.0 / 40e6, 2.0 * 1118.0 * 8.0 / 20e6);
        // The tree: one tensor up each uplink, at half a worker link's rate, the last
        // packet's serialisation on the uplink counted once.
        let ideal_tree = tree(None);
        let expected = 2.0 * one_tensor + worker_hop + uplink_hop / 2.0;
        assert!(close(ideal_tree.time, expected), "{:?} against {expected}", ideal_tree.time);
        assert_eq!(ideal_tree.bound, Bound::LinkRate);
        // One switch at the core: both of a rack's tensors through its uplink.
        let core = flat.netagg().unwrap().time;
        assert!(close(core, 4.0 * one_tensor + worker_hop + uplink_hop / 2.0), "{core:?}");
        // Switches on servers at the workers' rate: a rack's switch carries its 2
        // workers' tensors and the upper switch's result each way, 3 tensors; a packet
        // crosses its worker's link, its rack switch's server link twice and the upper
        // switch's once.
        let server_tree = tree(Some(link(40.0, 0)));
        let expected = 3.0 * one_tensor + 3.5 * worker_hop + uplink_hop;
        assert!(close(server_tree.time, expected), "{:?} against {expected}", server_tree.time);
        // The ring: 6 steps of a 4 MiB chunk in 2897 segments, each crossing an uplink.
        let ring_step = ((4u64 << 20) as f64 + 2897.0 * 66.0) * 8.0 / 20e6;
        assert!(
            close(flat.ring().unwrap(), 6.0 * ring_step),
            "{:?} against {}",
            flat.ring().unwrap(),
            6.0 * ring_step
        );
        // One rack is a flat network: its uplink carries nothing of the ring's.
        let one_rack = Scenario { racks: Some(RackNetwork { count: 1, ..racks }), ..flat.clone() };
        let no_racks = Scenario { racks: None, ..flat.clone() };
        assert_eq!(one_rack.ring().unwrap(), no_racks.ring().unwrap());
    }

    #[test]
    fn a_tensor_near_u64s_range_is_modelled_or_refused_naming_it() {
        // Its headers took the wire bytes past u64 (a panic in debug builds); at 1 Tbit/s
        // it takes about five years, at 1 bit/s more than a Duration holds.
        let fast = Scenario::uniform(4, link(1e6, 0), u64::MAX, 1024, 1 << 20);
        let expected = u64::MAX as f64 * 1118.0 / 1024.0 * 8.0 / 1e12;
        let time = fast.netagg().unwrap().time.as_secs_f64();
        assert!((time / expected - 1.0).abs() < 1e-9, "{time} against {expected}");
        assert!(fast.ring().unwrap() > fast.netagg().unwrap().time);
        let slow = Scenario::uniform(4, link(1e-6, 0), u64::MAX, 1024, 1 << 20);
        let error = slow.netagg().unwrap_err();
        assert!(
            matches!(
                error,
                ModelError::TooLong { allreduce: "netagg's allreduce", tensor_bytes: u64::MAX, .. }
            ),
            "{error:?}"
        );
        assert!(
            error.to_string().starts_with("netagg's allreduce of 18446744073709551615 bytes would take 1.6"),
            "{error}"
        );
        let error = slow.ring().unwrap_err().to_string();
        assert!(error.starts_with("the ring's allreduce of 18446744073709551615 bytes"), "{error}");
    }

    #[test]
    fn a_rate_below_one_bit_per_second_is_refused_naming_its_link() {
        let mut scenario = Scenario::uniform(4, link(200.0, 1), 16 << 20, 1024, 256);
        scenario.links[2].bits_per_second = 0.0;
        let error = scenario.netagg().unwrap_err();
        assert_eq!(error.to_string(), "rank 2's link: 0 bit/s is not a rate of at least 1 bit/s");
        assert_eq!(scenario.ring().unwrap_err(), error);
        scenario.links[2].bits_per_second = 200e6;
        scenario.aggregators = Aggregators::Dedicated { count: 2, link: link(f64::NAN, 0) };
        let error = scenario.netagg().unwrap_err().to_string();
        assert_eq!(error, "the switch hosts' link: NaN bit/s is not a rate of at least 1 bit/s");
        // An unlimited uplink is an infinite rate; a negative one is none.
        scenario.aggregators = Aggregators::Ideal;
        scenario.racks = Some(RackNetwork { count: 2, uplink: link(f64::INFINITY, 0) });
        assert!(scenario.netagg().is_ok());
        scenario.racks = Some(RackNetwork { count: 2, uplink: link(-5.0, 0) });
        let error = scenario.ring().unwrap_err().to_string();
        assert_eq!(error, "the racks' uplink: -5000000 bit/s is not a rate of at least 1 bit/s");
    }

    #[test]
    fn the_slowest_link_sets_both_paces() {
        let mut scenario = Scenario::uniform(4, link(200.0, 1), 16 << 20, 1024, 1 << 20);
        let even = (scenario.netagg().unwrap().time, scenario.ring().unwrap());
        scenario.links[3] = link(20.0, 1);
        let uneven = (scenario.netagg().unwrap().time, scenario.ring().unwrap());
        assert!(uneven.0.as_secs_f64() > 9.0 * even.0.as_secs_f64());
        assert!(uneven.1.as_secs_f64() > 9.0 * even.1.as_secs_f64());
    }

    #[test]
    fn the_ring_moves_two_n_minus_one_nths_of_the_tensor_and_pays_a_delay_per_step() {
        // 4 workers, 16 MiB at 200 Mbit/s, 1 ms each way: 6 steps of 4 MiB (in 2897
        // segments) plus 2 ms each.
        let scenario = Scenario::uniform(4, link(200.0, 1), 16 << 20, 1024, 256);
        let chunk_bytes = (4u64 << 20) as f64 + 2897.0 * 66.0;
        let expected = 6.0 * (chunk_bytes * 8.0 / 200e6 + 0.002);
        assert!(
            close(scenario.ring().unwrap(), expected),
            "{:?} against {expected}",
            scenario.ring().unwrap()
        );
        // Against netagg on the same links, without delay: 2(N-1)/N = 1.5 times the
        // bytes per worker, less the difference in headers.
        let no_delay = Scenario::uniform(4, link(200.0, 0), 16 << 20, 1024, 1 << 20);
        let ratio = no_delay.ring().unwrap().as_secs_f64() / no_delay.netagg().unwrap().time.as_secs_f64();
        assert!((1.4..1.5).contains(&ratio), "{ratio}");
        assert_eq!(Scenario::uniform(1, link(200.0, 1), 1 << 20, 1024, 256).ring().unwrap(), Duration::ZERO);
    }
}
