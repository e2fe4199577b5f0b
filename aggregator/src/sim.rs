//! An in-memory cluster: N workers running [`WorkerProtocol`], one [`Engine`] whose
//! session they open through a control [`Registry`], and links that drop, duplicate,
//! reorder and delay packets from a seeded RNG, on a virtual clock.
//! The faults are those of [`FaultInjector`], the one the client and switch shells use;
//! the links add their latency to it.
//!
//! On a network of racks ([`Racks`]) each rack's traffic to the core crosses an uplink
//! of its own (rate, latency, queue and faults), and either one switch at the core sums
//! every worker's packets (flat), or each rack's switch runs its own engine with an
//! upper switch's session attached, as `netagg-switch --upstream` does (a two-level
//! tree): it registers with the upper switch's [`Registry`] as one member, sends its
//! rack's partial sums up and recovers their losses on its own timers.
//!
//! A worker may run several threads ([`ClusterConfig::threads`]), each a
//! [`WorkerProtocol`] of its own over a share of the worker's slots, sharing its link and
//! pacer, as the client's threads do; and a series of jobs may run as applications run
//! them, each rank starting its next job when its own last one ended
//! ([`Cluster::allreduce_series`]).
//!
//! [`Ring`] runs the ring allreduce over the same links, for comparison.
//!
//! Runs are deterministic for a seed and bounded in steps, so a livelock fails instead of
//! hanging. The tests, property tests and benches drive the protocol through it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use netagg_wire::{ElementType, Integrity, MessageType, Packet, MAX_DATAGRAM_LEN};

use crate::engine::{Engine, Recipient, SessionCounters, SessionId, UplinkCounters, Verdict};
use crate::faults::FaultRates;
use crate::pacer::{LinkPacer, PacingConfig};
use crate::worker::{
    thread_blocks, JobSpec, JobStatus, Layout, WorkerConfig, WorkerCounters, WorkerProtocol,
};
use crate::zero_scan::nonzero_blocks;

mod agenda;
mod open;
mod ring;
mod tensor_io;
mod wire;

pub use ring::{Congestion, Ring, RingReport, TcpSegments};

use agenda::Agenda;
use open::Switch;
use tensor_io::TensorIo;
use wire::{Node, Wire};

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
    /// The racks the workers sit in, on a network of racks; `None`: every worker's link
    /// meets the others' at the switch. With racks, `switch_link` is every switch's
    /// (each rack's and the core's).
    pub racks: Option<Racks>,
    /// Switches that share the session's slots (shards), as `general.switches` lists
    /// them: each opens the session on its own and owns a contiguous range of every
    /// worker's slots, split as the client splits them; `switch_link` is each one's.
    /// 1: one switch. Not with racks.
    pub shards: u16,
    /// Worker threads of every worker, each running its own protocol over an equal share
    /// of the worker's `slots` and of every job's blocks, and all sharing the worker's link
    /// and pacer, as the client's threads do. 1: one thread of all the slots. Not with
    /// racks or shards.
    pub threads: u16,
}

/// A network of racks: the workers in `count` racks of contiguous ranks (split as
/// `netagg_wire::control::rack_ranks` splits them), each rack behind an uplink of its own
/// to the network's core.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Racks {
    pub count: u16,
    /// Each rack's uplink, each way: its latency, faults and rate (an oversubscribed
    /// uplink carries less than its rack's links together).
    pub uplink: LinkFaults,
    /// Each rack's switch sums its rack's workers and sends one partial sum up (a
    /// two-level tree); else one switch at the core takes every worker's packets through
    /// the uplinks.
    pub tree: bool,
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
            racks: None,
            shards: 1,
            threads: 1,
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
    #[error("racks.count {count} with {workers} workers: give 1 to {workers} racks")]
    Racks { count: u16, workers: u16 },
    #[error("{shards} shards for {slots} slots and {racks} racks: give 1 to {slots} shards, without racks")]
    Shards { shards: u16, slots: u16, racks: u16 },
    #[error(
        "{threads} worker threads for {slots} slots: give a number of threads that divides the slots \
         (more than 1 only with one switch and no racks)"
    )]
    Threads { threads: u16, slots: u16 },
}

/// What one allreduce cost.
#[derive(Debug, Clone, PartialEq)]
pub struct RunReport {
    pub outputs: Vec<Tensor>,
    /// Per worker, the agreed exponent each block was loaded and stored with (block
    /// floating point runs; `None` elsewhere).
    pub block_exponents: Vec<Vec<Option<i8>>>,
    /// Counters of each worker (its threads' together), for this allreduce alone.
    pub workers: Vec<WorkerCounters>,
    /// The counters of the session the workers' packets reach (the racks' sessions'
    /// together, in a tree), for this allreduce alone.
    pub switch: SessionCounters,
    /// What each rack's uplink carried, on a network of racks.
    pub racks: Vec<RackTraffic>,
    pub steps: u64,
    /// Packets the links' full queues dropped.
    pub queue_drops: u64,
    /// Of those, the ones on their way down (results, pending notices): the switch
    /// broadcasts a round's result to every worker when its last contribution comes,
    /// which no worker's pacer governs.
    pub queue_drops_down: u64,
    /// The longest any packet waited in a link's queue, each direction: the queueing
    /// delay the senders built.
    pub longest_queue_wait: QueueWaits,
    /// Virtual time the allreduce took.
    pub elapsed: Duration,
}

/// What a series of allreduces cost, run as each rank's application runs them: a rank
/// starts its next job as soon as its own last one ended, without waiting for the others,
/// so a rank that finished one job late starts the next late too.
#[derive(Debug, Clone, PartialEq)]
pub struct SeriesReport {
    /// Per job, every rank's result.
    pub outputs: Vec<Vec<Tensor>>,
    /// Per job, every rank's part in it.
    pub jobs: Vec<Vec<RankJob>>,
    /// The counters of the session the workers' packets reach, over the whole series.
    pub switch: SessionCounters,
    /// Virtual time the whole series took.
    pub elapsed: Duration,
}

/// One rank's part in one job of a series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankJob {
    /// From the rank's start of the job to its last thread's end: the time the rank's
    /// application measures.
    pub elapsed: Duration,
    /// Its threads' counters over that time, together.
    pub counters: WorkerCounters,
}

/// What crossed one rack's uplink in an allreduce.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RackTraffic {
    /// Bytes of the frames the uplink carried up and down, link headers counted.
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// What the rack's switch exchanged with the upper switch, in a tree.
    pub uplink: Option<UplinkCounters>,
}

/// The longest wait in the links' queues, towards the switches and back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueWaits {
    pub up: Duration,
    pub down: Duration,
}

/// The simulated cluster.
#[derive(Debug)]
pub struct Cluster {
    config: ClusterConfig,
    /// The racks' switches by rack (in a tree), then the switch at the core.
    switches: Vec<Switch>,
    /// Every worker thread, by rank and then thread: rank `r`'s thread `t` is at
    /// `r * config.threads + t`.
    workers: Vec<WorkerProtocol>,
    now: Instant,
    wire: Wire,
    next_job: u32,
    /// Of `config.lost_results`, those not yet lost.
    results_to_lose: Vec<(u16, u32)>,
}

/// What [`Cluster::run_series`] gives: per job, every rank's result, agreed exponents
/// and part in it.
struct Series {
    outputs: Vec<Vec<Tensor>>,
    exponents: Vec<Vec<Vec<Option<i8>>>>,
    ranks: Vec<Vec<RankJob>>,
    steps: u64,
}

impl Cluster {
    /// Opens the cluster's sessions as its switches do: every worker registers with a
    /// control [`Registry`](crate::control::Registry), which opens the session in the
    /// engine once every rank has, and each worker takes its session, rank and token from
    /// its accept; in a tree, each rack's switch first joins the upper switch's session.
    pub fn new(config: ClusterConfig) -> Result<Cluster, SimError> {
        if let Some(Racks { count, .. }) = config.racks {
            if count == 0 || count > config.workers {
                return Err(SimError::Racks { count, workers: config.workers });
            }
        }
        let racks = config.racks.map_or(0, |racks| racks.count);
        // One shard is the switch, whose registry judges the slots.
        if config.shards == 0 || (config.shards > 1 && (config.shards > config.slots || racks > 0)) {
            return Err(SimError::Shards { shards: config.shards, slots: config.slots, racks });
        }
        let threads = config.threads;
        if threads == 0 || config.slots % threads != 0 || (threads > 1 && (racks > 0 || config.shards > 1)) {
            return Err(SimError::Threads { threads, slots: config.slots });
        }
        let slots = config.slots / threads;
        let now = Instant::now();
        let mut sessions = open::open(&config, now)?;
        if threads > 1 {
            let core = sessions.switches.last_mut().expect("a cluster has a switch");
            core.engine.number_per_thread(core.session, slots);
        }
        let mut workers = Vec::with_capacity(sessions.workers.len() * usize::from(threads));
        for (rank, keys) in sessions.workers {
            // A worker's threads share its pacer, as they share its link.
            let pacer = LinkPacer::new(config.pacing);
            for thread in 0..threads {
                let thread_config = WorkerConfig {
                    keys: keys.clone(),
                    rank,
                    slot_base: thread * slots,
                    slots,
                    packet_elements: config.packet_elements,
                    depth: config.depth,
                    retransmit_timeout: config.retransmit_timeout,
                    max_retransmit_timeout: config.max_retransmit_timeout,
                    job_timeout: config.job_timeout,
                    pacing: config.pacing,
                    integrity: Integrity::Checksummed,
                };
                workers.push(WorkerProtocol::with_pacer(thread_config, now, Arc::clone(&pacer)));
            }
        }
        Ok(Cluster {
            wire: Wire::new(&config, now),
            results_to_lose: config.lost_results.clone(),
            switches: sessions.switches,
            config,
            workers,
            now,
            next_job: 1,
        })
    }

    /// The engine of the switch at the core (the upper switch, in a tree; the last
    /// shard's, with shards).
    pub fn engine(&self) -> &Engine {
        &self.core().engine
    }

    /// The cluster's session in [`Cluster::engine`].
    pub fn session(&self) -> SessionId {
        self.core().session
    }

    fn core(&self) -> &Switch {
        // `open` makes at least the core's.
        self.switches.last().expect("a cluster has a switch")
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

    /// Runs `jobs` (each one tensor per worker) back to back as each rank's application
    /// runs them, waiting for its job before it submits the next: a rank starts its next
    /// job as soon as its own last one ended, whatever the others' stand. A rank's
    /// [`ClusterConfig::start_delays`] delay each of its starts. `sparse` sends only the
    /// blocks holding a non-zero element.
    pub fn allreduce_series(&mut self, jobs: &[Vec<Tensor>], sparse: bool) -> Result<SeriesReport, SimError> {
        let switch_before = self.switch_counters();
        let started = self.now;
        let jobs: Vec<&[Tensor]> = jobs.iter().map(Vec::as_slice).collect();
        let series = self.run_series(&jobs, sparse, false)?;
        Ok(SeriesReport {
            outputs: series.outputs,
            jobs: series.ranks,
            switch: self.switch_counters().since(&switch_before),
            elapsed: self.now - started,
        })
    }

    fn run(&mut self, inputs: &[Tensor], sparse: bool, exponents: bool) -> Result<RunReport, SimError> {
        let counters_before: Vec<WorkerCounters> =
            (0..self.config.workers).map(|rank| self.rank_counters(rank)).collect();
        let switch_before = self.switch_counters();
        let queue_drops_before = (self.wire.queue_drops(), self.wire.queue_drops_down());
        let uplinks_before = self.uplink_traffic();
        // Counted afresh for this allreduce.
        self.wire.take_longest_waits();
        let started = self.now;
        let mut series = self.run_series(&[inputs], sparse, exponents)?;
        let switch_after = self.switch_counters();
        Ok(RunReport {
            outputs: series.outputs.swap_remove(0),
            block_exponents: series.exponents.swap_remove(0),
            workers: counters_before
                .iter()
                .enumerate()
                .map(|(rank, before)| self.rank_counters(rank as u16).since(before))
                .collect(),
            switch: switch_after.since(&switch_before),
            racks: self
                .uplink_traffic()
                .iter()
                .zip(&uplinks_before)
                .map(|(after, before)| RackTraffic {
                    bytes_up: after.bytes_up - before.bytes_up,
                    bytes_down: after.bytes_down - before.bytes_down,
                    uplink: after.uplink.zip(before.uplink).map(|(after, before)| after.since(&before)),
                })
                .collect(),
            steps: series.steps,
            queue_drops: self.wire.queue_drops() - queue_drops_before.0,
            queue_drops_down: self.wire.queue_drops_down() - queue_drops_before.1,
            longest_queue_wait: self.wire.take_longest_waits(),
            elapsed: self.now - started,
        })
    }

    /// Runs `jobs` as [`Cluster::allreduce_series`] does; one job is one allreduce.
    fn run_series(&mut self, jobs: &[&[Tensor]], sparse: bool, exponents: bool) -> Result<Series, SimError> {
        let ranks = usize::from(self.config.workers);
        for inputs in jobs {
            let first = inputs.first().ok_or(SimError::Inputs)?;
            if inputs.len() != ranks
                || inputs.iter().any(|t| t.len() != first.len() || t.element_type() != first.element_type())
            {
                return Err(SimError::Inputs);
            }
        }
        let first_job = self.next_job;
        self.next_job += jobs.len() as u32;
        let threads = usize::from(self.config.threads);
        let mut ios: Vec<TensorIo> = (0..self.workers.len()).map(|_| TensorIo::empty()).collect();
        let mut series = Series {
            outputs: vec![Vec::with_capacity(ranks); jobs.len()],
            exponents: vec![Vec::with_capacity(ranks); jobs.len()],
            ranks: vec![Vec::with_capacity(ranks); jobs.len()],
            steps: 0,
        };
        // Each rank's job under way or next, when it started, and its threads' counters then.
        let mut progress = vec![(0, self.now, WorkerCounters::default()); ranks];
        let delay =
            |config: &ClusterConfig, rank: usize| config.start_delays.get(rank).copied().unwrap_or_default();
        // Ranks not yet started on their next job, latest first, so that the next to
        // start is at the end.
        let mut pending: Vec<(Instant, u16)> =
            (0..ranks).map(|rank| (self.now + delay(&self.config, rank), rank as u16)).collect();
        pending.sort_by(|a, b| b.cmp(a));
        let mut running = vec![false; self.workers.len()];
        let mut finished = 0;
        // Only the threads an event reached can have something to send or a new timer:
        // polling every thread at every event would make a step cost O(N).
        let mut agenda = Agenda::new(self.workers.len());

        let mut buf = vec![0u8; MAX_DATAGRAM_LEN];
        loop {
            while pending.last().is_some_and(|&(at, _)| at <= self.now) {
                let Some((_, rank)) = pending.pop() else { break };
                let (job, started, counters) = &mut progress[usize::from(rank)];
                (*started, *counters) = (self.now, self.rank_counters(rank));
                let tensor = &jobs[*job][usize::from(rank)];
                let shares = self.thread_jobs(tensor, first_job + *job as u32, sparse, exponents);
                for (thread, (io, spec)) in shares.into_iter().enumerate() {
                    let index = usize::from(rank) * threads + thread;
                    self.workers[index]
                        .start_job(self.now, spec)
                        .map_err(|e| SimError::Failed { rank, reason: e.to_string() })?;
                    (ios[index], running[index]) = (io, true);
                    agenda.touch(index);
                }
            }
            for index in agenda.take_touched() {
                let rank = (index / threads) as u16;
                let (worker, io) = (&mut self.workers[index], &mut ios[index]);
                while let Some(len) = worker.poll_transmit(self.now, &mut buf, io) {
                    let switch = Node::Switch(self.wire.switch_of(rank, &buf[..len]));
                    self.wire.send(self.now, Node::Worker(rank), switch, &buf[..len]);
                }
                agenda.arm(index, worker.poll_timeout());
                match worker.status() {
                    JobStatus::Failed(error) => {
                        return Err(SimError::Failed { rank, reason: error.to_string() })
                    }
                    JobStatus::Done if running[index] => running[index] = false,
                    _ => continue,
                }
                let rank_threads = usize::from(rank) * threads..usize::from(rank + 1) * threads;
                if running[rank_threads.clone()].contains(&true) {
                    continue;
                }
                let (job, started, counters) = &mut progress[usize::from(rank)];
                let element_type = jobs[*job][0].element_type();
                let ios = &ios[rank_threads];
                let output: Vec<u8> = ios.iter().flat_map(|io| io.output.iter().copied()).collect();
                series.outputs[*job].push(Tensor::from_le_bytes(element_type, &output));
                series.exponents[*job].push(ios.iter().flat_map(|io| io.exponents.iter().copied()).collect());
                let elapsed = self.now - *started;
                let counters = self.rank_counters(rank).since(counters);
                series.ranks[*job].push(RankJob { elapsed, counters });
                *job += 1;
                if *job < jobs.len() {
                    pending.push((self.now + delay(&self.config, usize::from(rank)), rank));
                    pending.sort_by(|a, b| b.cmp(a));
                } else {
                    finished += 1;
                }
            }
            if finished == ranks {
                return Ok(series);
            }
            series.steps += 1;
            if series.steps > self.config.max_steps {
                return Err(SimError::Livelock { steps: series.steps });
            }
            let next_start = pending.last().map(|&(at, _)| at);
            let upstream = self.switches.iter().filter_map(|switch| switch.engine.upstream_timeout()).min();
            let events = [self.wire.next_event(), agenda.next_timer(), next_start, upstream];
            let Some(next) = events.into_iter().flatten().min() else {
                let rank = progress.iter().position(|&(job, ..)| job < jobs.len()).unwrap_or(0);
                return Err(SimError::Stuck { rank: rank as u16 });
            };
            self.now = self.now.max(next);
            self.deliver_due(&mut ios, &mut buf, &mut agenda);
            for switch in 0..self.switches.len() as u16 {
                if self.switches[usize::from(switch)]
                    .engine
                    .upstream_timeout()
                    .is_some_and(|at| at <= self.now)
                {
                    self.poll_upstream(switch, &mut buf);
                }
            }
            while let Some(index) = agenda.pop_due(self.now) {
                self.workers[index].handle_timeout(self.now);
            }
        }
    }

    /// Each of a rank's threads' share of its `tensor` in job `job`: the blocks
    /// [`thread_blocks`] gives the thread, and the job as the thread sees it.
    fn thread_jobs(
        &self,
        tensor: &Tensor,
        job: u32,
        sparse: bool,
        exponents: bool,
    ) -> Vec<(TensorIo, JobSpec)> {
        let element_type = tensor.element_type();
        let block_elements = element_type.per_packet(self.config.packet_elements) as usize;
        let block_bytes = block_elements * element_type.size();
        let bytes = tensor.to_le_bytes();
        let blocks = tensor.len().div_ceil(block_elements);
        let shares = thread_blocks(blocks, usize::from(self.config.threads)).map(|run| {
            let input = bytes
                [(run.start * block_bytes).min(bytes.len())..(run.end * block_bytes).min(bytes.len())]
                .to_vec();
            let layout = if sparse {
                // Blocks of a whole packet each, as many as the thread's share counts.
                Layout::Sparse(nonzero_blocks(&input, block_bytes).expect("blocks of whole packets"))
            } else {
                Layout::Dense
            };
            let elements = (input.len() / element_type.size()) as u64;
            let io = TensorIo {
                output: vec![0; input.len()],
                input,
                block_bytes,
                exponents: vec![None; run.len()],
            };
            (io, JobSpec { job, element_type, elements, layout, exponents })
        });
        shares.collect()
    }

    /// Rank `rank`'s threads' counters so far, together.
    fn rank_counters(&self, rank: u16) -> WorkerCounters {
        let threads = usize::from(self.config.threads);
        let rank_threads = &self.workers[usize::from(rank) * threads..usize::from(rank + 1) * threads];
        rank_threads.iter().fold(WorkerCounters::default(), |total, thread| total + *thread.counters())
    }

    /// The thread of rank `rank` that a datagram for it reaches: the one owning the slot
    /// it names, as the switch sends each thread's packets to the thread's own address.
    fn thread_of(&self, rank: u16, datagram: &[u8]) -> usize {
        let threads = usize::from(self.config.threads);
        let first = usize::from(rank) * threads;
        if threads == 1 {
            return first;
        }
        let slots = self.config.slots / self.config.threads;
        // A datagram too mangled to name its slot is refused by whichever thread takes it.
        let thread = Packet::new_checked(datagram).map_or(0, |packet| usize::from(packet.slot() / slots));
        first + thread.min(threads - 1)
    }

    /// The counters of the sessions the workers' packets reach, together.
    fn switch_counters(&self) -> SessionCounters {
        self.wire
            .workers_switches()
            .filter_map(|switch| {
                let switch = &self.switches[usize::from(switch)];
                switch.engine.session(switch.session).map(|(_, counters)| counters)
            })
            .fold(SessionCounters::default(), |total, counters| total + counters)
    }

    /// What each rack's uplink has carried so far.
    fn uplink_traffic(&self) -> Vec<RackTraffic> {
        let bytes = self.wire.uplink_bytes().into_iter().enumerate();
        bytes
            .map(|(rack, (bytes_up, bytes_down))| {
                let switch = self.switches.get(rack).filter(|_| self.switches.len() > 1);
                let uplink = switch.and_then(|switch| switch.engine.uplink_counters(switch.session));
                RackTraffic { bytes_up, bytes_down, uplink }
            })
            .collect()
    }

    fn deliver_due(&mut self, ios: &mut [TensorIo], buf: &mut [u8], agenda: &mut Agenda) {
        while let Some((to, bytes)) = self.wire.pop_due(self.now) {
            match to {
                Node::Worker(rank) => {
                    let thread = self.thread_of(rank, &bytes);
                    agenda.touch(thread);
                    self.workers[thread].handle_datagram(self.now, &bytes, &mut ios[thread]);
                }
                Node::Switch(switch) => {
                    let engine = &mut self.switches[usize::from(switch)].engine;
                    if let Verdict::Send(transmit) = engine.handle_datagram(self.now, &bytes, buf) {
                        self.dispatch(switch, transmit.recipient, &buf[..transmit.len]);
                    }
                    self.poll_notices(switch, buf);
                    // A rack's switch may owe its upper switch an acknowledgement.
                    self.poll_upstream(switch, buf);
                }
            }
        }
    }

    /// Sends the notices of lost contributions that switch `switch` holds behind results.
    fn poll_notices(&mut self, switch: u16, buf: &mut [u8]) {
        loop {
            let engine = &mut self.switches[usize::from(switch)].engine;
            let Some(transmit) = engine.poll_notice(buf) else { return };
            self.dispatch(switch, transmit.recipient, &buf[..transmit.len]);
        }
    }

    /// Sends what switch `switch`'s timers and acknowledgements call for up to its upper
    /// switch.
    fn poll_upstream(&mut self, switch: u16, buf: &mut [u8]) {
        loop {
            let engine = &mut self.switches[usize::from(switch)].engine;
            let Some(transmit) = engine.poll_upstream(self.now, buf) else { return };
            self.dispatch(switch, transmit.recipient, &buf[..transmit.len]);
        }
    }

    /// Puts a packet switch `switch` wrote for `recipient` on its way to each node it
    /// names, but for the results `config.lost_results` loses.
    fn dispatch(&mut self, switch: u16, recipient: Recipient, packet: &[u8]) {
        let result =
            Packet::new_checked(packet).ok().filter(|packet| packet.message_type() == MessageType::Result);
        for to in self.wire.recipients(switch, recipient) {
            if let (Some(result), Node::Worker(rank)) = (&result, to) {
                let lost = self.results_to_lose.iter().position(|&lost| lost == (rank, result.block()));
                if let Some(lost) = lost {
                    self.results_to_lose.swap_remove(lost);
                    continue;
                }
            }
            self.wire.send(self.now, Node::Switch(switch), to, packet);
        }
    }
}
