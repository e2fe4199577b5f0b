//! The ring allreduce that MPI and NCCL run for large tensors, over the links of a
//! simulated cluster, so that netagg and the ring are compared on the same network.
//!
//! A discrete model of the ring's traffic, not a protocol run: 2(N−1) steps, in each of
//! which every rank sends one chunk (1/N of the tensor) to the next rank, in TCP
//! segments, through its own link's queue, that link's latency, the receiver's link's
//! queue and its latency, each link at its rate. A rank starts a step once the previous
//! step's chunk has reached it, and its link sends its chunks in order. Each rank's
//! connection to the next keeps a congestion window: a segment leaves once the one a
//! window before it is acknowledged (its arrival, and the path back); the window grows
//! by one segment per acknowledgement in slow start and by one per window's worth beyond
//! it, and a loss cuts it to 0.7 of itself (CUBIC's factor), once per window. The links'
//! faults drop segments at their `drop` rate, with the cluster's seed; a lost segment is
//! sent again once the sender learns of it: from the duplicate acknowledgements of the
//! three segments after it (fast retransmit), or from a tail-loss probe two round trips
//! after the chunk's last segment when fewer follow it; a resent segment lost again is
//! found two round trips after it was sent (RACK's and the probe's detection). The
//! connections persist from one allreduce to the next, so a warm-up allreduce opens
//! their windows as MPI's warm-up jobs do. On a network of racks (`ClusterConfig::racks`)
//! a chunk between ranks of two racks also crosses the sender's rack's uplink up and the
//! receiver's down, each at its rate and latency (the ranks in contiguous racks, as
//! MPI's ring runs them: each uplink carries one edge of the ring each way); the
//! uplinks' own faults are not drawn.
//!
//! Left out, and so what a measured ring shows beyond this model: CUBIC's window curve
//! (a line instead, as CUBIC keeps on short paths), Linux's 200 ms retransmission
//! timeout, a resent segment's wait behind the segments queued before it, a queue's own
//! drops (the window is taken never to overflow it), acknowledgements' own bytes, MPI's
//! per-message costs, and the CPU.

use std::time::Duration;

use crate::faults::{FaultInjector, FaultRates};

use netagg_wire::control::rack_of;

use super::{ClusterConfig, RateLimit};

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

/// One rank's link, one direction: its rate (if limited), and when it is next free.
#[derive(Debug, Clone, Copy)]
struct Hop {
    limit: Option<RateLimit>,
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

/// TCP's congestion window on one rank's connection to the next, in segments.
#[derive(Debug, Clone, Copy)]
struct Window {
    segments: f64,
    slow_start_threshold: f64,
    /// Segments sent on the connection.
    sent: u64,
    /// The last segment sent when the window was last cut: losses among the segments up
    /// to it are of the same event, and cut it no further.
    recovering_until: Option<u64>,
}

impl Window {
    /// Linux's initial window.
    const INITIAL: Window =
        Window { segments: 10.0, slow_start_threshold: f64::INFINITY, sent: 0, recovering_until: None };
    /// What a loss leaves of the window: CUBIC's factor, Linux's default.
    const CUT: f64 = 0.7;

    fn segments(&self) -> usize {
        self.segments as usize
    }

    /// Segment `sequence` acknowledged, or found lost: the window grows by a segment per
    /// acknowledgement in slow start and by one per window's worth beyond it, and a new
    /// loss cuts it.
    fn acknowledged(&mut self, sequence: u64, lost: bool) {
        if !lost {
            let growth = if self.segments < self.slow_start_threshold { 1.0 } else { 1.0 / self.segments };
            self.segments += growth;
        } else if self.recovering_until.is_none_or(|until| sequence > until) {
            self.segments = (self.segments * Self::CUT).max(2.0);
            self.slow_start_threshold = self.segments;
            self.recovering_until = Some(self.sent);
        }
    }
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
    /// Each rank's link towards the fabric and from it.
    uplinks: Vec<Hop>,
    downlinks: Vec<Hop>,
    /// Each rack's uplink up and down, on a network of racks.
    rack_uplinks: Vec<Hop>,
    rack_downlinks: Vec<Hop>,
    /// Each rank's connection to the next rank.
    windows: Vec<Window>,
    up_losses: FaultInjector<()>,
    down_losses: FaultInjector<()>,
    /// When the last allreduce ended; the next starts there.
    now: Duration,
}

impl Ring {
    pub fn new(config: ClusterConfig, segments: TcpSegments) -> Ring {
        let hops = |default| -> Vec<Hop> {
            (0..config.workers)
                .map(|rank| Hop { limit: config.rank_rate(rank, default), free_at: Duration::ZERO })
                .collect()
        };
        let losses = |drop, seed| FaultInjector::new(FaultRates { drop, ..FaultRates::NONE }, seed);
        let racks = config.racks.map_or(0, |racks| racks.count);
        let rack_hops = || -> Vec<Hop> {
            let limit = config.racks.and_then(|racks| racks.uplink.rate);
            (0..racks).map(|_| Hop { limit, free_at: Duration::ZERO }).collect()
        };
        Ring {
            uplinks: hops(config.uplink.rate),
            downlinks: hops(config.downlink.rate),
            rack_uplinks: rack_hops(),
            rack_downlinks: rack_hops(),
            windows: vec![Window::INITIAL; usize::from(config.workers)],
            up_losses: losses(config.uplink.drop, config.seed),
            down_losses: losses(config.downlink.drop, !config.seed),
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
                let receiver = (sender + 1) % ranks;
                let (arrival, resent) = self.send_chunk(sender, receiver, ready_at, &mut chunk);
                received[receiver] = arrival;
                retransmissions += resent;
            }
            ready = received;
        }
        self.now = ready.into_iter().max().unwrap_or(started);
        RingReport { elapsed: self.now - started, retransmissions }
    }

    /// Sends `chunk` from `sender` to `receiver`, from `ready` on: when its last byte has
    /// arrived, and how many segments went again.
    fn send_chunk(
        &mut self,
        sender: usize,
        receiver: usize,
        ready: Duration,
        chunk: &mut Chunk,
    ) -> (Duration, u64) {
        let (up_latency, down_latency) = (self.config.uplink.latency, self.config.downlink.latency);
        let racks = self.crossing(sender, receiver);
        let rack_latency = self.config.racks.map_or(Duration::ZERO, |racks| racks.uplink.latency);
        // One way over the path, sender's link and receiver's (and two uplinks between
        // racks): data one way, its acknowledgements the other.
        let path =
            up_latency + down_latency + if racks.is_some() { 2 * rack_latency } else { Duration::ZERO };
        let first = self.windows[sender].sent;
        // Acknowledgements (or the duplicates that reveal a loss) reach the sender a path
        // after the segment reached the receiver.
        let mut acknowledged = 0;
        for (index, &bytes) in chunk.segment_bytes.iter().enumerate() {
            // The segment leaves once the window has room: after the acknowledgements
            // that came back by then.
            let mut at = ready;
            loop {
                let window = &mut self.windows[sender];
                while acknowledged < index && chunk.arrivals[acknowledged] + path <= at {
                    window.acknowledged(first + acknowledged as u64, chunk.losses[acknowledged]);
                    acknowledged += 1;
                }
                if index - acknowledged < window.segments() {
                    break;
                }
                at = chunk.arrivals[acknowledged] + path;
            }
            let mut reached = self.uplinks[sender].pass(at, bytes) + up_latency;
            if let Some((from, to)) = racks {
                reached = self.rack_uplinks[from].pass(reached, bytes) + rack_latency;
                reached = self.rack_downlinks[to].pass(reached, bytes) + rack_latency;
            }
            chunk.arrivals[index] = self.downlinks[receiver].pass(reached, bytes) + down_latency;
            chunk.losses[index] = !self.survives();
            self.windows[sender].sent += 1;
        }
        for (index, &lost) in chunk.losses.iter().enumerate().skip(acknowledged) {
            self.windows[sender].acknowledged(first + index as u64, lost);
        }
        let last_departure = self.uplinks[sender].free_at;
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
                let mut hops = vec![&mut self.uplinks[sender]];
                if let Some((from, to)) = racks {
                    hops.extend([&mut self.rack_uplinks[from], &mut self.rack_downlinks[to]]);
                }
                hops.push(&mut self.downlinks[receiver]);
                // Its bytes occupy every link of the path, though it goes ahead of the
                // queue.
                let mut crossing = Duration::ZERO;
                for hop in hops {
                    let serialization = hop.serialization(bytes);
                    hop.free_at += serialization;
                    crossing += serialization;
                }
                if self.survives() {
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

    /// The racks of `sender` and `receiver`, if they differ: the uplinks their chunks
    /// cross.
    fn crossing(&self, sender: usize, receiver: usize) -> Option<(usize, usize)> {
        let racks = self.rack_uplinks.len() as u16;
        let rack = |rank: usize| rack_of(rank as u16, racks, self.config.workers);
        let (from, to) = (rack(sender)?, rack(receiver)?);
        (from != to).then_some((usize::from(from), usize::from(to)))
    }

    /// Whether a segment crosses both links, drawn from their faults.
    fn survives(&mut self) -> bool {
        // This model keeps its own time; the injectors hold nothing back, so any instant
        // serves.
        let epoch = std::time::Instant::now();
        let mut delivered = 0;
        for injector in [&mut self.up_losses, &mut self.down_losses] {
            injector.push(epoch, (), &[], |_, _| delivered += 1);
        }
        delivered == 2
    }
}
