//! The ring allreduce that MPI and NCCL run for large tensors, over the links of a
//! simulated cluster, so that netagg and the ring are compared on the same network.
//!
//! A discrete model of the ring's traffic, not a protocol run: 2(N−1) steps, in each of
//! which every rank sends one chunk (1/N of the tensor) to the next rank, in TCP
//! segments, through its own link's queue, that link's latency, the receiver's link's
//! queue and its latency, each link at its rate. A rank starts a step once the previous
//! step's chunk has reached it, and its link sends its chunks in order. Each rank's
//! connection to the next keeps a congestion window: a segment leaves once the one a
//! window before it is acknowledged (its arrival, and the path back). The connection's
//! [`Congestion`] control moves the window:
//! - BBR (the default: the emulated runs' machine runs it, `net.ipv4.tcp_congestion_control
//!   = bbr`, and its network namespaces inherit it) opens the window as slow start does,
//!   by a segment per acknowledgement, up to twice the path's bandwidth-delay product
//!   (its slowest link's rate times its least round trip), and keeps it there through
//!   losses: BBR sends at the rate it sees delivered, which random loss does not lower.
//! - CUBIC grows the window by a segment per acknowledgement in slow start and by one
//!   per window's worth beyond it, and a loss cuts it to 0.7 of itself, once per window.
//!   At 1 % loss each way (2 % of the segments) that holds it near the path's
//!   bandwidth-delay product or below, and the link idles between acknowledgements.
//!
//! The links' faults drop segments at their `drop` rate, with the cluster's seed; a lost
//! segment is sent again once the sender learns of it: from the duplicate
//! acknowledgements of the three segments after it (fast retransmit, SACK's: each hole
//! on its own), or from a tail-loss probe two round trips after the chunk's last segment
//! when fewer follow it; a resent segment lost again is found two round trips after it
//! was sent (RACK's and the probe's detection). A step ends when its chunk's last
//! segment, resent or not, has arrived. The connections persist from one allreduce to
//! the next, so a warm-up allreduce opens their windows as MPI's warm-up jobs do. On a
//! network of racks (`ClusterConfig::racks`) a chunk between ranks of two racks also
//! crosses the sender's rack's uplink up and the receiver's down, each at its rate and
//! latency (the ranks in contiguous racks, as MPI's ring runs them: each uplink carries
//! one edge of the ring each way); the uplinks' own faults are not drawn.
//!
//! Left out, and so what a measured ring shows beyond this model. BBR's pacing (the
//! bottleneck's own queue spaces the segments here, in the same time while it stays
//! busy), its gain cycle and 1 % pacing margin (0.99 of the rate it measured, on
//! average), its start-up's exit and drain, its round of packet conservation after a
//! loss, and its RTT probe (a window of 4 segments for 0.2 s when 10 s pass without a
//! shorter round trip). CUBIC's window curve (a line instead, as CUBIC keeps on short
//! paths) and a queue's own drops (its window is taken never to overflow the queue;
//! BBR's overflows tbf's 100 ms only on round trips longer than that). For both:
//! Linux's 200 ms retransmission timeout, a resent segment's wait behind the segments
//! queued before it (its link time delays the link's next chunk instead),
//! acknowledgements' own bytes and their wait behind the receiver's own data on its
//! link, MPI's per-message costs, and the CPU.

use std::time::Duration;

use crate::faults::{FaultInjector, FaultRates};

use netagg_wire::control::rack_of;

use super::{ClusterConfig, LinkFaults, RateLimit};

/// What TCP puts on the wire for a stream of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSegments {
    /// Payload of a full segment.
    pub payload_bytes: u64,
    /// Bytes each segment's headers add on the link.
    pub overhead_bytes: u64,
}

impl TcpSegments {
    /// A 1500-byte MTU with TCP timestamps: 1448 bytes of payload, and Ethernet (14),
    /// IPv4 (20) and TCP with timestamps (32) around them.
    pub const ETHERNET: TcpSegments = TcpSegments { payload_bytes: 1448, overhead_bytes: 14 + 20 + 32 };
}

/// Later segments whose acknowledgements reveal a hole to the sender.
const DUPLICATE_ACKS: usize = 3;

/// What one simulated ring allreduce took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingReport {
    /// From the first rank's start until the last rank holds the sum.
    pub elapsed: Duration,
    /// Segments sent again.
    pub retransmissions: u64,
}

/// One link in one direction: its rate (if limited), its latency, and when it is next
/// free.
#[derive(Debug, Clone, Copy)]
struct Hop {
    limit: Option<RateLimit>,
    latency: Duration,
    free_at: Duration,
}

impl Hop {
    fn serialization(&self, bytes: u64) -> Duration {
        self.limit.map_or(Duration::ZERO, |limit| limit.serialization(bytes))
    }

    /// When `bytes` that reach the link at `at` have left it, after those before them.
    fn pass(&mut self, at: Duration, bytes: u64) -> Duration {
        self.free_at = self.free_at.max(at) + self.serialization(bytes);
        self.free_at
    }
}

/// How each rank's TCP connection sizes its congestion window: Linux's
/// `net.ipv4.tcp_congestion_control`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    /// BBR (Linux's `tcp_bbr`), the default of the machine the emulated runs were measured
    /// on, which its network namespaces inherit. It keeps about twice the path's
    /// bandwidth-delay product in flight, paced at the bottleneck's rate, and takes a
    /// random loss for no sign of congestion: the segment goes again, the window stays.
    Bbr,
    /// CUBIC, Linux's usual default: a loss cuts the window to 0.7 of itself, once per
    /// window, and it grows back by a segment per window's worth of acknowledgements (a
    /// line, as CUBIC's curve is on short paths).
    Cubic,
}

/// TCP's congestion window on one rank's connection to the next, in segments.
#[derive(Debug, Clone, Copy)]
struct Window {
    congestion: Congestion,
    segments: f64,
    /// The most the window grows to: BBR's twice the path's bandwidth-delay product;
    /// CUBIC's has no bound without losses.
    ceiling: f64,
    slow_start_threshold: f64,
    /// Segments sent on the connection.
    sent: u64,
    /// The last segment sent when the window was last cut: losses among the segments up
    /// to it are of the same event, and cut it no further.
    recovering_until: Option<u64>,
}

impl Window {
    /// Linux's initial window.
    const INITIAL_SEGMENTS: f64 = 10.0;
    /// What a loss leaves of CUBIC's window: its factor, Linux's default.
    const CUBIC_CUT: f64 = 0.7;
    /// BBR's window over the bandwidth-delay product (`bbr_cwnd_gain`), and its least.
    const BBR_GAIN: f64 = 2.0;
    const BBR_LEAST_SEGMENTS: f64 = 4.0;

    /// A fresh connection's window on a path whose bandwidth-delay product is
    /// `path_segments` (infinite on unlimited links).
    fn new(congestion: Congestion, path_segments: f64) -> Window {
        let ceiling = match congestion {
            Congestion::Bbr => (Self::BBR_GAIN * path_segments).max(Self::BBR_LEAST_SEGMENTS),
            Congestion::Cubic => f64::INFINITY,
        };
        Window {
            congestion,
            segments: Self::INITIAL_SEGMENTS.min(ceiling),
            ceiling,
            slow_start_threshold: f64::INFINITY,
            sent: 0,
            recovering_until: None,
        }
    }

    fn segments(&self) -> usize {
        self.segments as usize
    }

    /// Segment `sequence` acknowledged, or found lost: the window grows by a segment per
    /// acknowledgement in slow start (BBR's start-up, as its window refills) and by one
    /// per window's worth beyond it, up to its ceiling; a new loss cuts CUBIC's.
    fn acknowledged(&mut self, sequence: u64, lost: bool) {
        match (lost, self.congestion) {
            (false, _) => {
                let growth =
                    if self.segments < self.slow_start_threshold { 1.0 } else { 1.0 / self.segments };
                self.segments = (self.segments + growth).min(self.ceiling);
            }
            (true, Congestion::Bbr) => {}
            (true, Congestion::Cubic) => {
                if self.recovering_until.is_none_or(|until| sequence > until) {
                    self.segments = (self.segments * Self::CUBIC_CUT).max(2.0);
                    self.slow_start_threshold = self.segments;
                    self.recovering_until = Some(self.sent);
                }
            }
        }
    }
}

/// One rank's connection to the next rank: the hops its segments cross and its window.
#[derive(Debug)]
struct Connection {
    /// Indices into [`Ring::hops`], in the order a segment crosses them.
    route: Vec<usize>,
    window: Window,
}

/// One step's chunk: its segments' sizes on the wire, and for the chunk in flight, when
/// each arrives and whether it was lost.
#[derive(Debug)]
struct Chunk {
    segment_bytes: Vec<u64>,
    arrivals: Vec<Duration>,
    losses: Vec<bool>,
}

/// A ring of `config.workers` ranks on `config`'s links (their rates, per-rank rates,
/// latencies, drop rates, start delays and seed), whose TCP connections persist from one
/// allreduce to the next, as MPI's do.
#[derive(Debug)]
pub struct Ring {
    config: ClusterConfig,
    segments: TcpSegments,
    /// Every link, one direction each: each rank's towards the fabric, each rank's from
    /// it, then on a network of racks each rack's uplink up and each one's down.
    hops: Vec<Hop>,
    /// Each rank's connection to the next rank.
    connections: Vec<Connection>,
    losses: Losses,
    /// When the last allreduce ended; the next starts there.
    now: Duration,
}

impl Ring {
    /// A ring whose connections run BBR, as the emulated runs' did.
    pub fn new(config: ClusterConfig, segments: TcpSegments) -> Ring {
        Ring::with_congestion(config, segments, Congestion::Bbr)
    }

    /// A ring whose connections run `congestion`.
    pub fn with_congestion(config: ClusterConfig, segments: TcpSegments, congestion: Congestion) -> Ring {
        let ranks = usize::from(config.workers);
        let rank_hops = |link: LinkFaults| {
            let config = &config;
            (0..config.workers).map(move |rank| Hop {
                limit: config.rank_rate(rank, link.rate),
                latency: link.latency,
                free_at: Duration::ZERO,
            })
        };
        let racks = config.racks.map_or(0, |racks| racks.count);
        let rack_hop = Hop {
            limit: config.racks.and_then(|racks| racks.uplink.rate),
            latency: config.racks.map_or(Duration::ZERO, |racks| racks.uplink.latency),
            free_at: Duration::ZERO,
        };
        let hops: Vec<Hop> = rank_hops(config.uplink)
            .chain(rank_hops(config.downlink))
            .chain(std::iter::repeat_n(rack_hop, 2 * usize::from(racks)))
            .collect();
        let rack = |rank: usize| rack_of(rank as u16, racks, config.workers).map(usize::from);
        let connections = (0..ranks)
            .map(|sender| {
                let receiver = (sender + 1) % ranks;
                let mut route = vec![sender];
                if let (Some(from), Some(to)) = (rack(sender), rack(receiver)) {
                    if from != to {
                        let rack_uplinks = 2 * ranks;
                        route.extend([rack_uplinks + from, rack_uplinks + usize::from(racks) + to]);
                    }
                }
                route.push(ranks + receiver);
                let window = Window::new(congestion, bandwidth_delay_segments(&hops, &route, segments));
                Connection { route, window }
            })
            .collect();
        let losses = |drop, seed| FaultInjector::new(FaultRates { drop, ..FaultRates::NONE }, seed);
        Ring {
            hops,
            connections,
            losses: Losses {
                up: losses(config.uplink.drop, config.seed),
                down: losses(config.downlink.drop, !config.seed),
            },
            now: Duration::ZERO,
            segments,
            config,
        }
    }

    /// Sums a tensor of `tensor_bytes` on every rank.
    pub fn allreduce(&mut self, tensor_bytes: u64) -> RingReport {
        let ranks = usize::from(self.config.workers);
        if ranks < 2 {
            return RingReport { elapsed: Duration::ZERO, retransmissions: 0 };
        }
        let chunk = tensor_bytes.div_ceil(ranks as u64).max(1);
        let payload = self.segments.payload_bytes.max(1);
        let segment_bytes: Vec<u64> = (0..chunk.div_ceil(payload))
            .map(|index| (chunk - index * payload).min(payload) + self.segments.overhead_bytes)
            .collect();
        let started = self.now;
        // When each rank holds the chunk it forwards next: its start, then each step's
        // arrival.
        let mut ready: Vec<Duration> = (0..ranks)
            .map(|rank| started + self.config.start_delays.get(rank).copied().unwrap_or_default())
            .collect();
        let mut chunk = Chunk {
            arrivals: vec![Duration::ZERO; segment_bytes.len()],
            losses: vec![false; segment_bytes.len()],
            segment_bytes,
        };
        let mut retransmissions = 0;
        for _step in 0..2 * (ranks - 1) {
            let mut received = vec![Duration::ZERO; ranks];
            for (sender, &ready_at) in ready.iter().enumerate() {
                let (arrival, resent) = self.send_chunk(sender, ready_at, &mut chunk);
                received[(sender + 1) % ranks] = arrival;
                retransmissions += resent;
            }
            ready = received;
        }
        self.now = ready.into_iter().max().unwrap_or(started);
        RingReport { elapsed: self.now - started, retransmissions }
    }

    /// Sends `chunk` from `sender` to the next rank, from `ready` on: when its last byte
    /// has arrived, and how many segments went again.
    fn send_chunk(&mut self, sender: usize, ready: Duration, chunk: &mut Chunk) -> (Duration, u64) {
        let Connection { route, window } = &mut self.connections[sender];
        let hops = &mut self.hops;
        // One way over the path: data one way, its acknowledgements the other.
        let path: Duration = route.iter().map(|&hop| hops[hop].latency).sum();
        let first = window.sent;
        // Acknowledgements (or the duplicates that reveal a loss) reach the sender a path
        // after the segment reached the receiver.
        let mut acknowledged = 0;
        for (index, &bytes) in chunk.segment_bytes.iter().enumerate() {
            // The segment leaves once the window has room: after the acknowledgements
            // that came back by then.
            let mut at = ready;
            loop {
                while acknowledged < index && chunk.arrivals[acknowledged] + path <= at {
                    window.acknowledged(first + acknowledged as u64, chunk.losses[acknowledged]);
                    acknowledged += 1;
                }
                if index - acknowledged < window.segments() {
                    break;
                }
                at = chunk.arrivals[acknowledged] + path;
            }
            chunk.arrivals[index] =
                route.iter().fold(at, |reached, &hop| hops[hop].pass(reached, bytes) + hops[hop].latency);
            chunk.losses[index] = !self.losses.survives();
            window.sent += 1;
        }
        for (index, &lost) in chunk.losses.iter().enumerate().skip(acknowledged) {
            window.acknowledged(first + index as u64, lost);
        }
        let last_departure = hops[route[0]].free_at;
        let mut arrival = chunk.arrivals.iter().copied().max().unwrap_or_default();
        let mut resent = 0;
        for index in (0..chunk.losses.len()).filter(|&index| chunk.losses[index]) {
            let bytes = chunk.segment_bytes[index];
            // The receiver's duplicate acknowledgements travel back over the path;
            // without enough segments after it, a tail-loss probe finds it.
            let mut resend_at = match chunk.arrivals.get(index + DUPLICATE_ACKS) {
                Some(&revealed) => revealed + path,
                None => last_departure + 4 * path,
            };
            loop {
                resent += 1;
                // Its bytes occupy every link of the path, though it goes ahead of the
                // queue.
                let mut crossing = Duration::ZERO;
                for &hop in route.iter() {
                    let serialization = hops[hop].serialization(bytes);
                    hops[hop].free_at += serialization;
                    crossing += serialization;
                }
                if self.losses.survives() {
                    arrival = arrival.max(resend_at + crossing + path);
                    break;
                }
                // Lost again: found by a probe, or by acknowledgements of segments sent
                // after it (RACK), about two round trips on.
                resend_at += 4 * path;
            }
        }
        (arrival, resent)
    }
}

/// The bandwidth-delay product of `route` over `hops`, in full segments: its slowest
/// link's rate times the least round trip (both ways' latencies, and a full segment's
/// serialisation on each link); infinite if no link limits the rate.
fn bandwidth_delay_segments(hops: &[Hop], route: &[usize], segments: TcpSegments) -> f64 {
    let full_segment = segments.payload_bytes + segments.overhead_bytes;
    let route = || route.iter().map(|&hop| hops[hop]);
    let Some(bottleneck) = route().filter_map(|hop| hop.limit).map(|limit| limit.bits_per_second).min()
    else {
        return f64::INFINITY;
    };
    let round_trip: Duration = route().map(|hop| 2 * hop.latency + hop.serialization(full_segment)).sum();
    bottleneck as f64 * round_trip.as_secs_f64() / (8 * full_segment) as f64
}

/// The faults of the ranks' links, towards the fabric and from it, with the cluster's
/// seed.
#[derive(Debug)]
struct Losses {
    up: FaultInjector<()>,
    down: FaultInjector<()>,
}

impl Losses {
    /// Whether a segment crosses both links, drawn from their faults.
    fn survives(&mut self) -> bool {
        // This model keeps its own time; the injectors hold nothing back, so any instant
        // serves.
        let epoch = std::time::Instant::now();
        let mut delivered = 0;
        for injector in [&mut self.up, &mut self.down] {
            injector.push(epoch, (), &[], |_, _| delivered += 1);
        }
        delivered == 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `netagg-run --link rate=50mbit,delay=1ms,loss=...` with 4 ranks: the emulated
    /// lossy run's network (tbf's 100 ms queue).
    fn emulated(drop: f64) -> ClusterConfig {
        let limit = RateLimit::new(50_000_000, Duration::from_millis(100));
        let mut config = ClusterConfig::new(4, 256, 256).with_rate(limit);
        for link in [&mut config.uplink, &mut config.downlink] {
            link.latency = Duration::from_millis(1);
            link.drop = drop;
        }
        config
    }

    /// A 4 MiB tensor's second allreduce on a fresh ring, and the ring.
    fn warm(config: ClusterConfig, congestion: Congestion) -> (RingReport, Ring) {
        let mut ring = Ring::with_congestion(config, TcpSegments::ETHERNET, congestion);
        ring.allreduce(4 << 20);
        (ring.allreduce(4 << 20), ring)
    }

    #[test]
    fn bbr_s_window_is_twice_the_path_s_bandwidth_delay_product() {
        // 1 ms each way on both links, and a 1514-byte frame's 242.24 µs on each: a least
        // round trip of 4.48448 ms, in which 50 Mbit/s carries 18.51 such frames.
        let path_segments = 50e6 * 4.484_48e-3 / (8.0 * 1514.0);
        let ring = Ring::new(emulated(0.0), TcpSegments::ETHERNET);
        for connection in &ring.connections {
            assert!((connection.window.ceiling - 2.0 * path_segments).abs() < 1e-9);
            assert_eq!(connection.window.segments, Window::INITIAL_SEGMENTS);
        }
        let mut unlimited = emulated(0.0);
        unlimited.uplink.rate = None;
        unlimited.downlink.rate = None;
        let ring = Ring::new(unlimited, TcpSegments::ETHERNET);
        assert!(ring.connections.iter().all(|connection| connection.window.ceiling == f64::INFINITY));
        let cubic = Ring::with_congestion(emulated(0.0), TcpSegments::ETHERNET, Congestion::Cubic);
        assert!(cubic.connections.iter().all(|connection| connection.window.ceiling == f64::INFINITY));
    }

    /// The same segments lost under both: BBR's window stays at its ceiling and its links
    /// busy, so the ring pays only the resent segments' link time; CUBIC's, cut every
    /// fifty segments or so, stays near the 18.5-segment bandwidth-delay product, and its
    /// links idle for a fifth to two fifths of each step.
    #[test]
    fn under_random_loss_bbr_keeps_the_links_busy_and_cubic_does_not() {
        let (lossless, _) = warm(emulated(0.0), Congestion::Bbr);
        let (bbr, bbr_ring) = warm(emulated(0.01), Congestion::Bbr);
        let (cubic, cubic_ring) = warm(emulated(0.01), Congestion::Cubic);
        assert_eq!(bbr.retransmissions, cubic.retransmissions, "the same losses");
        assert!((200..450).contains(&bbr.retransmissions), "{}", bbr.retransmissions);
        let ratio = |report: RingReport| report.elapsed.as_secs_f64() / lossless.elapsed.as_secs_f64();
        assert!((1.0..1.03).contains(&ratio(bbr)), "BBR at {:.3} of the lossless ring", ratio(bbr));
        assert!(ratio(cubic) > 1.3, "CUBIC at {:.3} of the lossless ring", ratio(cubic));
        for (bbr, cubic) in bbr_ring.connections.iter().zip(&cubic_ring.connections) {
            assert_eq!(bbr.window.segments, bbr.window.ceiling);
            assert!(cubic.window.segments < bbr.window.ceiling, "{}", cubic.window.segments);
        }
    }

    /// Without losses both windows outgrow the path, so the links set the time: BBR's
    /// ceiling never holds a segment back once the warm-up has opened it.
    #[test]
    fn without_losses_bbr_and_cubic_take_the_same_time() {
        for (workers, latency) in
            [(2, Duration::ZERO), (4, Duration::from_millis(1)), (8, Duration::from_millis(5))]
        {
            let mut config = emulated(0.0);
            config.workers = workers;
            config.uplink.latency = latency;
            config.downlink.latency = latency;
            let (bbr, _) = warm(config.clone(), Congestion::Bbr);
            let (cubic, _) = warm(config, Congestion::Cubic);
            assert_eq!(bbr, cubic, "N = {workers}, {latency:?}");
        }
    }
}
