//! An in-memory cluster: N workers running [`WorkerProtocol`], one [`Engine`] whose
//! session they open through a control [`Registry`], and links that drop, duplicate,
//! reorder and delay packets from a seeded RNG, on a virtual clock.
//! The faults are those of [`FaultInjector`], the one the client and switch shells use;
//! the links add their latency to it.
//!
//! [`Ring`] runs the ring allreduce over the same links, for comparison.
//!
//! Runs are deterministic for a seed and bounded in steps, so a livelock fails instead of
//! hanging. The tests, property tests and benches drive the protocol through it.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use netagg_wire::{ControlMessage, ElementType, MessageType, Packet, ValueEncoding, MAX_DATAGRAM_LEN};

use crate::control::{Action, ControlLimits, OpenError, Opened, Registry};
use crate::engine::{Engine, EngineLimits, Recipient, SessionCounters, SessionId, Verdict};
use crate::faults::{FaultInjector, FaultRates};
use crate::pacer::PacingConfig;
use crate::worker::{
    BlockIo, JobSpec, JobStatus, Layout, SessionKey, SessionKeys, WorkerConfig, WorkerCounters,
    WorkerProtocol,
};
use crate::zero_scan::nonzero_blocks;

mod ring;

pub use ring::{Ring, RingReport, TcpSegments};

/// Faults and timing of one direction of every worker's link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkFaults {
    /// Probability that a packet is lost.
    pub drop: f64,
    /// Probability that a packet arrives twice.
    pub duplicate: f64,
    /// Probability that a packet is held back by up to four latencies, overtaken by others.
    pub reorder: f64,
    pub latency: Duration,
    /// Uniform extra delay of up to this much.
    pub jitter: Duration,
    /// Each worker's link in this direction carries at most this rate, behind a queue.
    pub rate: Option<RateLimit>,
}

/// A link's bottleneck, as `tbf` makes one: packets leave one after another at
/// `bits_per_second`, waiting in a queue of at most `queue_bytes`; a packet that finds
/// the queue full is dropped. A bucket of `burst_bytes` fills at the rate while the link
/// is idle, and lets that many bytes through at once, unqueued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub bits_per_second: u64,
    pub queue_bytes: u64,
    pub burst_bytes: u64,
}

impl RateLimit {
    /// A link of `bits_per_second` whose queue holds `queue` of its traffic, with no
    /// burst.
    pub fn new(bits_per_second: u64, queue: Duration) -> RateLimit {
        let link = RateLimit { bits_per_second, queue_bytes: 0, burst_bytes: 0 };
        RateLimit { queue_bytes: link.bytes_in(queue), ..link }
    }

    /// Bytes the link carries in `time` at its rate.
    pub fn bytes_in(&self, time: Duration) -> u64 {
        (time.as_nanos() * self.bits_per_second as u128 / 8 / 1_000_000_000).min(u64::MAX as u128) as u64
    }

    /// The same link with a bucket of `burst_bytes`.
    pub fn with_burst(self, burst_bytes: u64) -> RateLimit {
        RateLimit { burst_bytes, ..self }
    }

    /// How long `bytes` take to leave the link.
    pub fn serialization(&self, bytes: u64) -> Duration {
        Duration::from_nanos((bytes * 8 * 1_000_000_000).div_ceil(self.bits_per_second))
    }
}

/// The state of one worker's link in one direction under a [`RateLimit`].
#[derive(Debug, Clone)]
struct Bottleneck {
    limit: RateLimit,
    /// When the last packet admitted has left the link.
    free_at: Instant,
    /// Bytes in the bucket when it left.
    tokens: u64,
    /// The longest a packet admitted since the last reset waited in the queue.
    longest_wait: Duration,
}

impl Bottleneck {
    fn new(limit: RateLimit, now: Instant) -> Bottleneck {
        Bottleneck { limit, free_at: now, tokens: limit.burst_bytes, longest_wait: Duration::ZERO }
    }

    /// When a packet of `bytes` offered at `now` has left the link; `None` if the queue
    /// ahead of it is full and it is dropped.
    fn admit(&mut self, now: Instant, bytes: u64) -> Option<Instant> {
        let start = self.free_at.max(now);
        let backlog = self.limit.bytes_in(start - now);
        if backlog + bytes > self.limit.queue_bytes {
            return None;
        }
        // The bucket refilled while the link idled: what it holds leaves at once, the
        // rest at the rate.
        let tokens =
            self.tokens.saturating_add(self.limit.bytes_in(start - self.free_at)).min(self.limit.burst_bytes);
        let (departure, tokens) = match bytes.checked_sub(tokens) {
            None | Some(0) => (start, tokens - bytes),
            Some(lacking) => (start + self.limit.serialization(lacking), 0),
        };
        // The wait before its own bytes go out at the rate.
        let wait = (departure - now).saturating_sub(self.limit.serialization(bytes));
        self.longest_wait = self.longest_wait.max(wait);
        self.free_at = departure;
        self.tokens = tokens;
        Some(departure)
    }
}

impl LinkFaults {
    /// The faults of the link, for the injector; a reordered packet is held back by up
    /// to four latencies.
    fn rates(&self) -> FaultRates {
        FaultRates {
            drop: self.drop,
            duplicate: self.duplicate,
            reorder: self.reorder,
            corrupt: 0.0,
            delay: self.jitter,
            reorder_hold: self.latency * 4,
        }
    }

    /// A link that delivers everything, in order, after `latency`.
    pub const fn perfect(latency: Duration) -> LinkFaults {
        LinkFaults { drop: 0.0, duplicate: 0.0, reorder: 0.0, latency, jitter: Duration::ZERO, rate: None }
    }

    /// A link that loses, duplicates and reorders the given fraction of packets each.
    pub const fn lossy(rate: f64, latency: Duration) -> LinkFaults {
        LinkFaults { drop: rate, duplicate: rate, reorder: rate, latency, jitter: latency, rate: None }
    }
}

/// Shape of a simulated cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    pub workers: u16,
    /// Slots (the window) of every worker.
    pub slots: u16,
    /// Elements of 4 bytes in a packet; 16-bit packets carry twice as many.
    pub packet_elements: u16,
    pub depth: u8,
    pub uplink: LinkFaults,
    pub downlink: LinkFaults,
    pub retransmit_timeout: Duration,
    pub max_retransmit_timeout: Duration,
    pub job_timeout: Duration,
    /// The workers' pacing.
    pub pacing: PacingConfig,
    pub seed: u64,
    /// Per rank, how long after the first its every job starts (a straggler); missing
    /// ranks start at once.
    pub start_delays: Vec<Duration>,
    /// Ranks whose link carries another rate than `uplink.rate` and `downlink.rate`,
    /// both ways (a slow link).
    pub rank_rates: Vec<(u16, RateLimit)>,
    /// Events (deliveries and timer firings) one allreduce may take before it counts as a
    /// livelock.
    pub max_steps: u64,
    /// Bytes the links count for each packet beyond its datagram, as a shaping queue
    /// counts frames: Ethernet, IPv4 and UDP add 42.
    pub frame_overhead_bytes: u64,
    /// The switch host's own link, each way, when the switch runs on a server behind a
    /// NIC: it carries every worker's packets in and a copy of every result to each
    /// worker out. `None`: the switch is the network, its ports at line rate.
    pub switch_link: Option<RateLimit>,
    /// Results lost on the way down the first time the switch sends them, as
    /// `(rank, block)`: a loss placed where random faults would rarely put it, such as
    /// the last results of a job.
    pub lost_results: Vec<(u16, u32)>,
}

impl ClusterConfig {
    /// A lossless cluster with 10 µs links.
    pub fn new(workers: u16, slots: u16, packet_elements: u16) -> ClusterConfig {
        let latency = Duration::from_micros(10);
        ClusterConfig {
            workers,
            slots,
            packet_elements,
            depth: 8,
            uplink: LinkFaults::perfect(latency),
            downlink: LinkFaults::perfect(latency),
            retransmit_timeout: Duration::from_micros(200),
            max_retransmit_timeout: Duration::from_millis(5),
            job_timeout: Duration::from_secs(10),
            pacing: PacingConfig::DEFAULT,
            seed: 1,
            start_delays: Vec::new(),
            rank_rates: Vec::new(),
            max_steps: 10_000_000,
            frame_overhead_bytes: 0,
            switch_link: None,
            lost_results: Vec::new(),
        }
    }

    /// Every worker's link carries `limit` each way.
    pub fn with_rate(mut self, limit: RateLimit) -> ClusterConfig {
        self.uplink.rate = Some(limit);
        self.downlink.rate = Some(limit);
        self
    }

    /// Worker `rank`'s link carries `limit` each way, whatever the others carry.
    pub fn with_rank_rate(mut self, rank: u16, limit: RateLimit) -> ClusterConfig {
        self.rank_rates.retain(|&(other, _)| other != rank);
        self.rank_rates.push((rank, limit));
        self
    }

    /// The rate of worker `rank`'s link: its own, if it has one, else `default` (the
    /// uplinks' or downlinks' rate).
    pub fn rank_rate(&self, rank: u16, default: Option<RateLimit>) -> Option<RateLimit> {
        let own = self.rank_rates.iter().find(|&&(other, _)| other == rank).map(|&(_, limit)| limit);
        own.or(default)
    }

    /// Both directions lose, duplicate and reorder `rate` of the packets.
    pub fn with_faults(mut self, rate: f64) -> ClusterConfig {
        self.uplink = LinkFaults::lossy(rate, self.uplink.latency);
        self.downlink = LinkFaults::lossy(rate, self.downlink.latency);
        self
    }
}

/// A tensor of one worker.
#[derive(Debug, Clone, PartialEq)]
pub enum Tensor {
    Int32(Vec<i32>),
    Float32(Vec<f32>),
    Float16(Vec<f16>),
    BFloat16(Vec<bf16>),
}

impl Tensor {
    pub fn len(&self) -> usize {
        match self {
            Tensor::Int32(v) => v.len(),
            Tensor::Float32(v) => v.len(),
            Tensor::Float16(v) => v.len(),
            Tensor::BFloat16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn element_type(&self) -> ElementType {
        match self {
            Tensor::Int32(_) => ElementType::Int32,
            Tensor::Float32(_) => ElementType::Float32,
            Tensor::Float16(_) => ElementType::Float16,
            Tensor::BFloat16(_) => ElementType::BFloat16,
        }
    }

    fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            Tensor::Int32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Tensor::Float32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Tensor::Float16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Tensor::BFloat16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    fn from_le_bytes(element_type: ElementType, bytes: &[u8]) -> Tensor {
        let words = bytes.chunks_exact(4).map(|b| [b[0], b[1], b[2], b[3]]);
        let halves = bytes.chunks_exact(2).map(|b| [b[0], b[1]]);
        match element_type {
            ElementType::Int32 => Tensor::Int32(words.map(i32::from_le_bytes).collect()),
            ElementType::Float32 => Tensor::Float32(words.map(f32::from_le_bytes).collect()),
            ElementType::Float16 => Tensor::Float16(halves.map(f16::from_le_bytes).collect()),
            ElementType::BFloat16 => Tensor::BFloat16(halves.map(bf16::from_le_bytes).collect()),
        }
    }
}

/// Why a simulated cluster could not open its session, or an allreduce did not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    #[error("inputs disagree on length or element type")]
    Inputs,
    #[error("no event left to run, but worker {rank} has not finished")]
    Stuck { rank: u16 },
    #[error("still running after {steps} steps: livelock")]
    Livelock { steps: u64 },
    #[error("worker {rank} failed: {reason}")]
    Failed { rank: u16, reason: String },
    #[error("the switch refused the session: {0}")]
    Refused(String),
}

/// What one allreduce cost.
#[derive(Debug, Clone, PartialEq)]
pub struct RunReport {
    pub outputs: Vec<Tensor>,
    /// Per worker, the agreed exponent each block was loaded and stored with (block
    /// floating point runs; `None` elsewhere).
    pub block_exponents: Vec<Vec<Option<i8>>>,
    /// Counters of each worker, for this allreduce alone.
    pub workers: Vec<WorkerCounters>,
    /// The session's counters, for this allreduce alone.
    pub switch: SessionCounters,
    pub steps: u64,
    /// Packets the links' full queues dropped.
    pub queue_drops: u64,
    /// The longest any packet waited in a link's queue, each direction: the queueing
    /// delay the senders built.
    pub longest_queue_wait: QueueWaits,
    /// Virtual time the allreduce took.
    pub elapsed: Duration,
}

/// The longest wait in the workers' links' queues, towards the switch and back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueWaits {
    pub up: Duration,
    pub down: Duration,
}

/// Where a packet in flight arrives next: its destination, or a hop of its path where
/// it joins another link's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Endpoint {
    Switch,
    Worker(u16),
    /// The switch host's link towards the switch.
    SwitchIngress,
    /// Worker `rank`'s link, from the switch host's link.
    WorkerEgress(u16),
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: Instant,
    sequence: u64,
    to: Endpoint,
    bytes: Vec<u8>,
}

/// The simulated cluster.
#[derive(Debug)]
pub struct Cluster {
    config: ClusterConfig,
    engine: Engine,
    session: SessionId,
    workers: Vec<WorkerProtocol>,
    /// Faults of each direction, addressed by the worker whose link a packet takes.
    uplink: FaultInjector<u16>,
    downlink: FaultInjector<u16>,
    now: Instant,
    wire: Wire,
    next_job: u32,
    /// Of `config.lost_results`, those not yet lost.
    results_to_lose: Vec<(u16, u32)>,
}

/// The packets on their way, and the workers' links' bottlenecks.
#[derive(Debug)]
struct Wire {
    in_flight: BinaryHeap<Reverse<InFlight>>,
    sequence: u64,
    uplinks: Vec<Option<Bottleneck>>,
    downlinks: Vec<Option<Bottleneck>>,
    /// The switch host's link, in and out, if it has one of its own.
    switch_in: Option<Bottleneck>,
    switch_out: Option<Bottleneck>,
    uplink_latency: Duration,
    downlink_latency: Duration,
    frame_overhead_bytes: u64,
    /// Packets dropped by full queues at the bottlenecks.
    queue_drops: u64,
}

#[derive(Debug, Clone, Copy)]
enum Direction {
    Up,
    Down,
}

/// One of the links of the cluster's topology.
#[derive(Debug, Clone, Copy)]
enum LinkSlot {
    /// Worker `rank`'s link towards the fabric.
    Up(u16),
    /// Worker `rank`'s link from the fabric.
    Down(u16),
    SwitchIn,
    SwitchOut,
}

impl Wire {
    fn new(config: &ClusterConfig, now: Instant) -> Wire {
        let links = |rate: Option<RateLimit>| {
            (0..config.workers)
                .map(|rank| config.rank_rate(rank, rate).map(|limit| Bottleneck::new(limit, now)))
                .collect()
        };
        Wire {
            in_flight: BinaryHeap::new(),
            sequence: 0,
            uplinks: links(config.uplink.rate),
            downlinks: links(config.downlink.rate),
            switch_in: config.switch_link.map(|limit| Bottleneck::new(limit, now)),
            switch_out: config.switch_link.map(|limit| Bottleneck::new(limit, now)),
            uplink_latency: config.uplink.latency,
            downlink_latency: config.downlink.latency,
            frame_overhead_bytes: config.frame_overhead_bytes,
            queue_drops: 0,
        }
    }

    /// The longest queue waits since the last call, which starts the next count.
    fn take_longest_waits(&mut self) -> QueueWaits {
        let longest = |links: &mut Vec<Option<Bottleneck>>| {
            let waits = links.iter_mut().flatten().map(|link| std::mem::take(&mut link.longest_wait));
            waits.max().unwrap_or_default()
        };
        let switch =
            |link: &mut Option<Bottleneck>| link.as_mut().map(|link| std::mem::take(&mut link.longest_wait));
        QueueWaits {
            up: longest(&mut self.uplinks).max(switch(&mut self.switch_in).unwrap_or_default()),
            down: longest(&mut self.downlinks).max(switch(&mut self.switch_out).unwrap_or_default()),
        }
    }

    /// Puts a packet on its way at `now`, in `direction` between worker `rank` and the
    /// switch: up, through the worker's link, its latency, then the switch host's link
    /// if it has one; down, through the switch host's link first.
    fn carry(&mut self, now: Instant, direction: Direction, rank: u16, bytes: &[u8]) {
        let (link, latency, to) = match direction {
            Direction::Up => {
                let to = if self.switch_in.is_some() { Endpoint::SwitchIngress } else { Endpoint::Switch };
                (LinkSlot::Up(rank), self.uplink_latency, to)
            }
            Direction::Down if self.switch_out.is_some() => {
                (LinkSlot::SwitchOut, Duration::ZERO, Endpoint::WorkerEgress(rank))
            }
            Direction::Down => (LinkSlot::Down(rank), self.downlink_latency, Endpoint::Worker(rank)),
        };
        self.enqueue(now, link, latency, to, bytes.to_vec());
    }

    /// Moves a packet that reached a hop of its path on to the hop's link.
    fn forward(&mut self, now: Instant, at: Endpoint, bytes: Vec<u8>) {
        match at {
            Endpoint::SwitchIngress => {
                self.enqueue(now, LinkSlot::SwitchIn, Duration::ZERO, Endpoint::Switch, bytes)
            }
            Endpoint::WorkerEgress(rank) => {
                self.enqueue(now, LinkSlot::Down(rank), self.downlink_latency, Endpoint::Worker(rank), bytes)
            }
            Endpoint::Switch | Endpoint::Worker(_) => unreachable!("destinations are not hops"),
        }
    }

    /// Puts `bytes` on a link at `now` (through its bottleneck, if it has one), to reach
    /// `to` `latency` after it leaves.
    fn enqueue(&mut self, now: Instant, link: LinkSlot, latency: Duration, to: Endpoint, bytes: Vec<u8>) {
        let frame_bytes = bytes.len() as u64 + self.frame_overhead_bytes;
        let bottleneck = match link {
            LinkSlot::Up(rank) => self.uplinks[rank as usize].as_mut(),
            LinkSlot::Down(rank) => self.downlinks[rank as usize].as_mut(),
            LinkSlot::SwitchIn => self.switch_in.as_mut(),
            LinkSlot::SwitchOut => self.switch_out.as_mut(),
        };
        let departure = match bottleneck {
            Some(bottleneck) => match bottleneck.admit(now, frame_bytes) {
                Some(departure) => departure,
                None => {
                    self.queue_drops += 1;
                    return;
                }
            },
            None => now,
        };
        self.sequence += 1;
        let packet = InFlight { at: departure + latency, sequence: self.sequence, to, bytes };
        self.in_flight.push(Reverse(packet));
    }
}

/// Which workers an event reached since they were last polled, and when each worker's
/// next timer is due.
#[derive(Debug)]
struct Agenda {
    touched: Vec<u16>,
    is_touched: Vec<bool>,
    /// Each worker's armed deadline; entries of `timers` that disagree are stale.
    deadlines: Vec<Option<Instant>>,
    timers: BinaryHeap<Reverse<(Instant, u16)>>,
}

impl Agenda {
    fn new(workers: usize) -> Agenda {
        Agenda {
            touched: Vec::new(),
            is_touched: vec![false; workers],
            deadlines: vec![None; workers],
            timers: BinaryHeap::new(),
        }
    }

    fn touch(&mut self, rank: u16) {
        if !std::mem::replace(&mut self.is_touched[rank as usize], true) {
            self.touched.push(rank);
        }
    }

    /// The workers touched since the last call, in rank order (the order in which a
    /// poll of every worker would meet them, so that runs stay as they were).
    fn take_touched(&mut self) -> Vec<u16> {
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable();
        for &rank in &touched {
            self.is_touched[rank as usize] = false;
        }
        touched
    }

    /// Records worker `rank`'s next deadline, as its `poll_timeout` gives it.
    fn arm(&mut self, rank: u16, deadline: Option<Instant>) {
        if self.deadlines[rank as usize] != deadline {
            self.deadlines[rank as usize] = deadline;
            if let Some(at) = deadline {
                self.timers.push(Reverse((at, rank)));
            }
        }
    }

    fn next_timer(&mut self) -> Option<Instant> {
        self.drop_stale();
        self.timers.peek().map(|Reverse((at, _))| *at)
    }

    /// A worker whose deadline has come by `now`, touched so that it is polled again.
    fn pop_due(&mut self, now: Instant) -> Option<u16> {
        self.drop_stale();
        let &Reverse((at, rank)) = self.timers.peek()?;
        if at > now {
            return None;
        }
        self.timers.pop();
        self.deadlines[rank as usize] = None;
        self.touch(rank);
        Some(rank)
    }

    fn drop_stale(&mut self) {
        while let Some(&Reverse((at, rank))) = self.timers.peek() {
            if self.deadlines[rank as usize] == Some(at) {
                break;
            }
            self.timers.pop();
        }
    }
}

struct TensorIo {
    input: Vec<u8>,
    output: Vec<u8>,
    block_bytes: usize,
    /// The exponent each block was loaded with; `store` must be given the same.
    exponents: Vec<Option<i8>>,
}

impl TensorIo {
    fn block(&self, block: u32) -> &[u8] {
        let start = block as usize * self.block_bytes;
        &self.input[start..(start + self.block_bytes).min(self.input.len())]
    }
}

impl BlockIo for TensorIo {
    /// Passes elements through unchanged; exponents are only recorded and checked, so the
    /// protocol's agreement on them is tested apart from any quantiser.
    fn load(&mut self, block: u32, payload: &mut [u8], exponent: Option<i8>) {
        let start = block as usize * self.block_bytes;
        payload.copy_from_slice(&self.input[start..start + payload.len()]);
        self.exponents[block as usize] = exponent;
    }

    /// The number of significant bits of the block's largest magnitude.
    fn exponent(&mut self, block: u32) -> i8 {
        let largest = self
            .block(block)
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]).unsigned_abs())
            .max();
        (32 - largest.unwrap_or(0).leading_zeros()) as i8
    }

    fn store(&mut self, block: u32, payload: &[u8], exponent: Option<i8>) {
        assert_eq!(
            exponent, self.exponents[block as usize],
            "block {block} stored with another exponent than it was loaded with"
        );
        let start = block as usize * self.block_bytes;
        let end = (start + self.block_bytes).min(self.output.len());
        if payload.is_empty() {
            self.output[start..end].fill(0);
        } else {
            self.output[start..start + payload.len()].copy_from_slice(payload);
        }
    }
}

impl Cluster {
    /// Opens the cluster's session as a switch does: every worker registers with a
    /// control [`Registry`], which opens the session in the engine once every rank has,
    /// and each worker takes its session, rank and token from its accept.
    pub fn new(config: ClusterConfig) -> Result<Cluster, SimError> {
        let now = Instant::now();
        let mut engine = Engine::new(EngineLimits {
            session_idle_timeout: Duration::from_secs(3600),
            ..EngineLimits::default()
        });
        let host = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let endpoint = netagg_wire::Endpoint::Udp(SocketAddr::new(host, 0));
        let mut registry = Registry::new(
            vec![endpoint],
            ControlLimits {
                max_connections: usize::from(config.workers),
                max_sessions: 1,
                max_workers: config.workers,
                register_timeout: Duration::from_secs(60),
                data_networks: Vec::new(),
                max_datagram: None,
            },
        );
        for rank in 0..config.workers {
            let connection = registry.handle_connect(now, host);
            let register = ControlMessage::Register {
                rank,
                world_size: config.workers,
                packet_elements: config.packet_elements,
                slots: config.slots,
                depth: config.depth,
                encoding: ValueEncoding::Native,
                sparse_blocks: false,
                name: "sim".into(),
                endpoints: vec![endpoint],
            };
            registry.handle_message(now, connection, 0, register);
        }
        // Any value: the simulated links carry no forger.
        let token = config.seed.rotate_left(17) ^ 0x6e65_7461_6767;
        let mut accepts = Vec::new();
        while let Some(action) = registry.poll_action() {
            match action {
                Action::OpenSession { request, spec, .. } => {
                    let opened = engine.open_session(now, spec, token).map(|id| Opened { id, token });
                    registry.handle_opened(request, opened.map_err(OpenError::from));
                }
                Action::Send { message: ControlMessage::Accept { session, rank, token, .. }, .. } => {
                    accepts.push((session, rank, token))
                }
                Action::Send { message: ControlMessage::Reject { message, .. }, .. } => {
                    return Err(SimError::Refused(message))
                }
                // Closes follow refusals; the registry asks nothing else of a new session.
                _ => {}
            }
        }
        let Some(&(session, ..)) = accepts.first() else {
            return Err(SimError::Refused("a session needs at least one worker".into()));
        };
        let session = SessionId(session);
        let workers = accepts
            .into_iter()
            .map(|(_, rank, token)| {
                WorkerProtocol::new(
                    WorkerConfig {
                        keys: SessionKeys::one(SessionKey { session: session.0, token }),
                        rank,
                        slot_base: 0,
                        slots: config.slots,
                        packet_elements: config.packet_elements,
                        depth: config.depth,
                        retransmit_timeout: config.retransmit_timeout,
                        max_retransmit_timeout: config.max_retransmit_timeout,
                        job_timeout: config.job_timeout,
                        pacing: config.pacing,
                    },
                    now,
                )
            })
            .collect();
        Ok(Cluster {
            uplink: FaultInjector::new(config.uplink.rates(), config.seed),
            downlink: FaultInjector::new(config.downlink.rates(), !config.seed),
            wire: Wire::new(&config, now),
            results_to_lose: config.lost_results.clone(),
            config,
            engine,
            session,
            workers,
            now,
            next_job: 1,
        })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn session(&self) -> SessionId {
        self.session
    }

    /// Sums the workers' tensors (one per worker) and returns every worker's result.
    /// `sparse` sends only the blocks holding a non-zero element.
    pub fn allreduce(&mut self, inputs: &[Tensor], sparse: bool) -> Result<RunReport, SimError> {
        self.run(inputs, sparse, false)
    }

    /// A dense allreduce with block-floating-point exponents agreed per block.
    pub fn allreduce_with_exponents(&mut self, inputs: &[Tensor]) -> Result<RunReport, SimError> {
        self.run(inputs, false, true)
    }

    fn run(&mut self, inputs: &[Tensor], sparse: bool, exponents: bool) -> Result<RunReport, SimError> {
        let first = inputs.first().ok_or(SimError::Inputs)?;
        if inputs.len() != self.workers.len()
            || inputs.iter().any(|t| t.len() != first.len() || t.element_type() != first.element_type())
        {
            return Err(SimError::Inputs);
        }
        let job = self.next_job;
        self.next_job += 1;
        let block_elements = first.element_type().per_packet(self.config.packet_elements) as usize;
        let blocks = first.len().div_ceil(block_elements) as u32;
        let mut ios: Vec<TensorIo> = inputs
            .iter()
            .map(|tensor| {
                let input = tensor.to_le_bytes();
                TensorIo {
                    output: vec![0; input.len()],
                    input,
                    block_bytes: block_elements * first.element_type().size(),
                    exponents: vec![None; blocks as usize],
                }
            })
            .collect();
        let counters_before: Vec<WorkerCounters> = self.workers.iter().map(|w| *w.counters()).collect();
        let switch_before = self.switch_counters();
        let queue_drops_before = self.wire.queue_drops;
        // Counted afresh for this allreduce.
        self.wire.take_longest_waits();
        let started = self.now;
        let mut specs = Vec::with_capacity(ios.len());
        for io in &ios {
            let layout = if sparse {
                // Blocks of a whole packet each (never empty), as many as `blocks` counts.
                let mask = nonzero_blocks(&io.input, io.block_bytes).expect("blocks of whole packets");
                Layout::Sparse(mask)
            } else {
                Layout::Dense
            };
            specs.push(Some(JobSpec {
                job,
                element_type: first.element_type(),
                elements: first.len() as u64,
                layout,
                exponents,
            }));
        }
        let start_at =
            |rank: usize| started + self.config.start_delays.get(rank).copied().unwrap_or(Duration::ZERO);
        // Ranks not yet started, latest first, so that the next to start is at the end.
        let mut pending: Vec<(Instant, u16)> =
            (0..specs.len()).map(|rank| (start_at(rank), rank as u16)).collect();
        pending.sort_by(|a, b| b.cmp(a));
        let mut done = vec![false; specs.len()];
        let mut finished = 0;
        // Only the workers an event reached can have something to send or a new timer:
        // polling every worker at every event would make a step cost O(N).
        let mut agenda = Agenda::new(self.workers.len());

        let mut buf = vec![0u8; MAX_DATAGRAM_LEN];
        let mut steps = 0;
        loop {
            while pending.last().is_some_and(|&(at, _)| at <= self.now) {
                let Some((_, rank)) = pending.pop() else { break };
                let spec = specs[rank as usize].take().expect("each rank starts once");
                self.workers[rank as usize]
                    .start_job(self.now, spec)
                    .map_err(|e| SimError::Failed { rank, reason: e.to_string() })?;
                agenda.touch(rank);
            }
            for rank in agenda.take_touched() {
                let (worker, io) = (&mut self.workers[rank as usize], &mut ios[rank as usize]);
                while let Some(len) = worker.poll_transmit(self.now, &mut buf, io) {
                    let (wire, now) = (&mut self.wire, self.now);
                    self.uplink.push(now, rank, &buf[..len], |rank, bytes| {
                        wire.carry(now, Direction::Up, rank, bytes)
                    });
                }
                match worker.status() {
                    JobStatus::Failed(error) => {
                        return Err(SimError::Failed { rank, reason: error.to_string() })
                    }
                    JobStatus::Done if specs[rank as usize].is_none() && !done[rank as usize] => {
                        done[rank as usize] = true;
                        finished += 1;
                    }
                    _ => {}
                }
                agenda.arm(rank, worker.poll_timeout());
            }
            if finished == self.workers.len() {
                break;
            }
            steps += 1;
            if steps > self.config.max_steps {
                return Err(SimError::Livelock { steps });
            }
            let next_delivery = self.wire.in_flight.peek().map(|Reverse(p)| p.at);
            let next_release = [self.uplink.next_release(), self.downlink.next_release()];
            let next_start = pending.last().map(|&(at, _)| at);
            let events = [next_delivery, agenda.next_timer(), next_start].into_iter().chain(next_release);
            let Some(next) = events.flatten().min() else {
                let rank = done.iter().position(|&done| !done).unwrap_or(0);
                return Err(SimError::Stuck { rank: rank as u16 });
            };
            self.now = self.now.max(next);
            self.deliver_due(&mut ios, &mut buf, &mut agenda);
            while let Some(rank) = agenda.pop_due(self.now) {
                self.workers[rank as usize].handle_timeout(self.now);
            }
        }

        let switch_after = self.switch_counters();
        Ok(RunReport {
            outputs: ios.iter().map(|io| Tensor::from_le_bytes(first.element_type(), &io.output)).collect(),
            block_exponents: ios.iter().map(|io| io.exponents.clone()).collect(),
            workers: self
                .workers
                .iter()
                .zip(&counters_before)
                .map(|(w, before)| w.counters().since(before))
                .collect(),
            switch: switch_after.since(&switch_before),
            steps,
            queue_drops: self.wire.queue_drops - queue_drops_before,
            longest_queue_wait: self.wire.take_longest_waits(),
            elapsed: self.now - started,
        })
    }

    fn switch_counters(&self) -> SessionCounters {
        self.engine.session(self.session).map(|(_, c)| c).unwrap_or_default()
    }

    fn deliver_due(&mut self, ios: &mut [TensorIo], buf: &mut [u8], agenda: &mut Agenda) {
        // Packets the links held back go on their way now, after the link's latency.
        for (link, direction) in [(&mut self.uplink, Direction::Up), (&mut self.downlink, Direction::Down)] {
            let (wire, now) = (&mut self.wire, self.now);
            link.release(now, |rank, bytes| wire.carry(now, direction, rank, bytes));
        }
        while self.wire.in_flight.peek().is_some_and(|Reverse(p)| p.at <= self.now) {
            let Some(Reverse(packet)) = self.wire.in_flight.pop() else {
                break;
            };
            match packet.to {
                hop @ (Endpoint::SwitchIngress | Endpoint::WorkerEgress(_)) => {
                    self.wire.forward(self.now, hop, packet.bytes)
                }
                Endpoint::Worker(rank) => {
                    agenda.touch(rank);
                    self.workers[rank as usize].handle_datagram(
                        self.now,
                        &packet.bytes,
                        &mut ios[rank as usize],
                    );
                }
                Endpoint::Switch => {
                    let Verdict::Send(transmit) = self.engine.handle_datagram(self.now, &packet.bytes, buf)
                    else {
                        continue;
                    };
                    let recipients: Vec<u16> = match transmit.recipient {
                        Recipient::All => (0..self.config.workers).collect(),
                        Recipient::Worker(rank) => vec![rank],
                        // The simulated switch's sessions have no upper switch.
                        Recipient::Upstream => Vec::new(),
                    };
                    let (wire, now) = (&mut self.wire, self.now);
                    let result = Packet::new_checked(&buf[..transmit.len])
                        .ok()
                        .filter(|packet| packet.message_type() == MessageType::Result);
                    for rank in recipients {
                        if let Some(result) = &result {
                            let lost =
                                self.results_to_lose.iter().position(|&lost| lost == (rank, result.block()));
                            if let Some(lost) = lost {
                                self.results_to_lose.swap_remove(lost);
                                continue;
                            }
                        }
                        self.downlink.push(now, rank, &buf[..transmit.len], |rank, bytes| {
                            wire.carry(now, Direction::Down, rank, bytes)
                        });
                    }
                }
            }
        }
    }
}
