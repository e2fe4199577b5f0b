//! The worker side of the protocol, without I/O: one instance per worker thread.
//!
//! A thread owns a contiguous range of the session's slots. Its share of a job is cut
//! into blocks of `packet_elements`; block `b` travels through local slot `b % slots`, so
//! every slot carries a *stream* of blocks `s, s + slots, s + 2·slots, …`, and every rank
//! maps the same elements to the same slot.
//!
//! - **Dense** jobs: each slot has one packet in flight; the result of round `r` releases
//!   the slot's next block as round `r + 1` (SwitchML's self-clocked window).
//! - **Sparse** jobs: each slot starts with one contribution from every worker (data if
//!   its first block is non-zero, an empty packet otherwise), naming the sender's next
//!   non-zero block. Afterwards a worker sends only when a result names its own next block;
//!   meanwhile it takes the results of the rounds others contribute to, and acknowledges
//!   them in batches so the aggregator can free its sets.
//!
//! Loss is recovered by per-slot timers with exponential backoff. When a slot's timer
//! fires, the worker first asks whether anything points to a loss: a result of a packet
//! sent *after* the slot's (the switch has moved on without it, as TCP's RACK reasons), or
//! a gap in the slot's results. If so, an outstanding contribution is sent again (at the
//! first timeout, while peers' contributions complete the rounds, the slot asks first
//! whether the switch holds it: the round may wait on a peer's loss), and a slot with
//! nothing outstanding, or missing a result, asks for the first round it lacks.
//! If not, the whole thread is waiting, most likely for a late peer: then one slot
//! *probes* with a header-only request, and the other slots' timers wait for its answer
//! rather than resend a window. The switch answers a request or a repeated contribution
//! for a round still aggregating with a *pending* notice saying whether this worker's
//! contribution is in; a slot known to be in is never sent again, and one the switch
//! lacks is sent at once. Any result ends the wait, and the waiting slots' timers start
//! afresh. A job with no progress for `job_timeout` fails.
//!
//! The timeout follows the measured round-trip time (RFC 6298's smoothed mean plus four
//! deviations; one packet per round trip is timed, as TCP times one segment, and only
//! while it has been sent once, as Karn's rule says), never below the configured one. A
//! round trip includes waiting for the slowest worker, and a fixed timeout below that
//! makes every worker retransmit rounds that are merely waiting, which slows the switch
//! and the others further: congestion collapse.
//!
//! Data packets, first sendings and retransmissions, go out through the worker's
//! [`LinkPacer`], which every thread of the worker shares: unpaced until the worker's
//! path shows an overflowing queue, then spaced at the rate the path delivers (see
//! [`crate::pacer`]). A contribution the pacer holds has never been sent: no timer runs
//! for it, and no recovery may send it.
//!
//! Payloads never pass through this core: [`BlockIo`] loads a block into an outgoing
//! packet and stores a result, so the caller does pre- and post-processing in place.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use netagg_wire::packet::{BROADCAST_RANK, ELEMENT_LEN, END_OF_STREAM, HEADER_LEN};
use netagg_wire::{ElementType, Flags, MessageType, Packet, PacketRepr, WireError};

use crate::pacer::{LinkPacer, PacingConfig};
use crate::round::is_after;

/// Moves payloads between the caller's tensors and packets: the pre- and
/// post-processing.
pub trait BlockIo {
    /// Writes block `block` (as many elements as `payload` holds, little-endian) into
    /// `payload`. In a block-floating-point job `exponent` is the exponent every worker
    /// agreed for this block, which the encoding must use; otherwise it is `None`.
    fn load(&mut self, block: u32, payload: &mut [u8], exponent: Option<i8>);
    /// Takes the aggregate of block `block`, encoded as [`BlockIo::load`] encoded it.
    /// An empty `payload` means the block is zero on every worker. Blocks of a sparse job
    /// that no round visits are zero on every worker and are never stored: the caller
    /// zeroes its output first.
    fn store(&mut self, block: u32, payload: &[u8], exponent: Option<i8>);
    /// This worker's exponent of block `block`: what block floating point needs to
    /// represent its largest element. Only block-floating-point jobs ask.
    fn exponent(&mut self, block: u32) -> i8 {
        let _ = block;
        i8::MIN
    }
}

/// Which blocks of a job hold a non-zero element.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockMask {
    words: Vec<u64>,
    blocks: u32,
}

impl BlockMask {
    /// A mask of `blocks` blocks, all zero.
    pub fn new(blocks: u32) -> BlockMask {
        BlockMask { words: vec![0; (blocks as usize).div_ceil(64)], blocks }
    }

    /// A mask whose block `b` is non-zero where `nonzero(b)` says so.
    pub fn from_fn(blocks: u32, mut nonzero: impl FnMut(u32) -> bool) -> BlockMask {
        let mut mask = BlockMask::new(blocks);
        for block in 0..blocks {
            if nonzero(block) {
                mask.insert(block);
            }
        }
        mask
    }

    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    pub fn insert(&mut self, block: u32) {
        if block < self.blocks {
            self.words[block as usize / 64] |= 1 << (block % 64);
        }
    }

    pub fn contains(&self, block: u32) -> bool {
        block < self.blocks && self.words[block as usize / 64] & (1 << (block % 64)) != 0
    }

    /// Non-zero blocks in the mask.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The first non-zero block of `from, from + stride, …`, or [`END_OF_STREAM`].
    fn next_in_stream(&self, from: u64, stride: u64) -> u32 {
        let mut block = from;
        while block < self.blocks as u64 {
            if self.contains(block as u32) {
                return block as u32;
            }
            block += stride;
        }
        END_OF_STREAM
    }
}

/// How a job's blocks travel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// Every block is sent.
    Dense,
    /// Only non-zero blocks are sent, OmniReduce-style.
    Sparse(BlockMask),
}

/// One job, as this worker thread sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSpec {
    /// Job number, the same on every rank; results of other jobs are stale.
    pub job: u32,
    pub element_type: ElementType,
    /// Elements of this thread's share of the tensor.
    pub elements: u64,
    pub layout: Layout,
    /// Block floating point: every block is encoded with an exponent all workers agreed
    /// on beforehand (dense jobs only). A header-only *exponent round* on the thread's
    /// first slot agrees one for the first block of every slot; after that each packet
    /// carries its sender's exponent of the next block in its slot, and the switch's
    /// maximum of those comes back with the result, one round ahead of its use. A job of
    /// `L` packets thus costs `L + 1` packets (SwitchML's look-ahead batch costs
    /// `L + min(L, window)`).
    pub exponents: bool,
}

/// Parameters of one worker thread in one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    pub session: u32,
    /// The session's secret from the switch's accept; sent in every packet, and a result
    /// without it is not from the session's switch.
    pub token: u64,
    pub rank: u16,
    /// This thread's slots are `slot_base..slot_base + slots`.
    pub slot_base: u16,
    pub slots: u16,
    pub packet_elements: u16,
    /// The session's depth: rounds each slot retains at the aggregator.
    pub depth: u8,
    /// Retransmission timeout before any round trip is measured, and its floor after;
    /// it doubles on every timeout of a slot.
    pub retransmit_timeout: Duration,
    pub max_retransmit_timeout: Duration,
    /// A job that makes no progress for this long fails.
    pub job_timeout: Duration,
    /// Spacing of the contributions' first sendings to the rate the path carries.
    pub pacing: PacingConfig,
}

/// Why a job could not start or did not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("a job is already running")]
    Busy,
    #[error("the job's {blocks} blocks exceed the protocol's 2^32 - 1")]
    TooLarge { blocks: u64 },
    #[error("the sparse mask has {mask} blocks, the job has {blocks}")]
    MaskSize { mask: u32, blocks: u32 },
    #[error("no progress for {0:?}: the switch or another worker is not answering")]
    Timeout(Duration),
    #[error("an earlier job failed, so the slots' rounds are out of step: open a new session")]
    SessionBroken,
    #[error("block floating point needs a dense layout")]
    SparseExponents,
    #[error("aborted: {0}")]
    Aborted(String),
}

/// Where the current job stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobStatus {
    Idle,
    Running,
    Done,
    Failed(JobError),
}

/// What became of a datagram received from the switch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// A new result, stored.
    Accepted,
    /// A result already held.
    Duplicate,
    /// A result of another job, or for a slot not in use.
    Stale,
    /// A pending notice: the round is still aggregating.
    Pending,
    /// Not a result for this worker.
    Rejected(RejectReason),
}

/// Why a datagram from the switch was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    #[error("malformed packet: {0}")]
    Malformed(#[from] WireError),
    #[error("neither a result nor a pending notice")]
    NotAResult,
    #[error("result of another session")]
    WrongSession,
    #[error("result without the session's token")]
    WrongToken,
    #[error("result for another rank")]
    WrongRank,
    #[error("slot outside this thread's range")]
    WrongSlot,
    #[error("round outside the window this slot can receive")]
    RoundOutOfWindow,
    #[error("result does not match the block in flight")]
    WrongBlock,
    #[error("payload does not fit the block")]
    WrongLength,
}

counters! {
    /// Counters of one worker thread.
    pub struct WorkerCounters {
        pub packets_sent: u64,
        /// Bytes of the datagrams sent, headers included.
        pub bytes_sent: u64,
        pub data_sent: u64,
        pub acks_sent: u64,
        pub retransmissions: u64,
        /// Header-only requests sent while the whole thread waited: one per timeout of the
        /// probing slot, instead of a window of retransmissions.
        pub probes: u64,
        /// First sendings the pacer held back, to space them at the rate the path carries.
        pub paced: u64,
        pub results_received: u64,
        /// Bytes of the new results received, headers included.
        pub bytes_received: u64,
        pub duplicates: u64,
        pub stale: u64,
        pub rejected: u64,
        /// Pending notices received: a round asked about is still aggregating.
        pub pending: u64,
        /// Slot timers that fired and sent a retransmission, a request or a probe (timers
        /// that fired while a probe was out send nothing and are not counted).
        pub timeouts: u64,
        pub jobs_done: u64,
        pub jobs_failed: u64,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Contribution {
    round: u32,
    block: u32,
    /// The sender's next non-zero block after `block` (sparse), fixed at first sending so
    /// that retransmissions repeat it.
    next: u32,
    /// The agreed exponent `block` is encoded with (block floating point).
    exponent: Option<i8>,
    /// This is the exponent round: no payload, the exponent of the first window.
    exponent_round: bool,
}

impl Contribution {
    /// A contribution of a block's data.
    fn data(round: u32, block: u32, next: u32, exponent: Option<i8>) -> Contribution {
        Contribution { round, block, next, exponent, exponent_round: false }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Send {
    /// The slot's outstanding contribution; a retransmission names the round it resends,
    /// and is dropped if that round was answered while it waited in the queue (the next
    /// contribution is then queued on its own, and is no retransmission).
    Data { retransmission: Option<u32> },
    /// An acknowledgement of the results held.
    Ack,
    /// An acknowledgement asking for the result of `round`; dropped if that round was
    /// answered while the request waited in the queue.
    Request { round: u32 },
}

#[derive(Debug)]
struct SlotState {
    /// First round of this slot's next stream; persists across jobs.
    next_round: u32,
    active: bool,
    /// Every result of this slot up to this round is held.
    have: u32,
    /// Bit `i`: the result of round `have + 2 + i` is held (`have + 1` never is).
    ahead: u64,
    outstanding: Option<Contribution>,
    /// Sparse: the first non-zero block of this stream not yet contributed.
    my_next: u32,
    /// Sparse: the round whose result ended the stream.
    end_round: Option<u32>,
    /// The last `have` sent to the aggregator.
    acked: u32,
    /// When the slot's current wait began, as a count of the thread's transmissions: the
    /// first sending of its contribution, or the transmissions before the result that left
    /// it waiting.
    /// A count rather than a time, since a burst of sends shares one clock reading.
    waiting_since: u64,
    /// The round whose contribution the switch said it holds: while it is the outstanding
    /// one, it is never sent again, only asked after.
    held: Option<u32>,
    /// The slot's timer fired while another slot probed, and was put off until the probe
    /// is answered.
    deferred: bool,
    /// The outstanding contribution waits in the pacer's queue and was never sent: no
    /// timer runs for it, and nothing may send it but the pacer.
    paced: bool,
    /// Consecutive timeouts of this slot; each doubles its timeout.
    backoff: u32,
    /// When this slot's retransmission timer fires; re-armed at every send.
    deadline: Option<Instant>,
    /// The deadline of this slot's live entry in `timers`. Re-arming to a later deadline
    /// leaves that entry alone (it moves when it reaches the top), so that a send costs
    /// no heap operation: a timer is re-armed at every send but fires once per timeout.
    queued: Option<Instant>,
}

impl SlotState {
    /// What the slot sends to recover from a loss: its contribution again, unless it has
    /// none or the switch said it holds it; then a request for the first result it lacks.
    fn recovery(&self) -> Send {
        match self.outstanding {
            Some(c) if self.held != Some(c.round) => Send::Data { retransmission: Some(c.round) },
            _ => Send::Request { round: self.have.wrapping_add(1) },
        }
    }
}

/// A contribution's first sending: the one send the pacer may hold back.
const FIRST_SENDING: Send = Send::Data { retransmission: None };

/// Timeouts beyond a year are taken as a year, so that no deadline can overflow the
/// clock.
const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

/// Smoothed round-trip time and its deviation (RFC 6298), in nanoseconds: integer
/// arithmetic, where `Duration`'s costs a normalisation per operation on every result.
#[derive(Debug, Clone, Copy)]
struct RttEstimate {
    smoothed: u64,
    deviation: u64,
}

#[derive(Debug)]
struct Job {
    spec: JobSpec,
    blocks: u32,
}

/// The contribution whose round trip is being timed.
#[derive(Debug, Clone, Copy)]
struct TimedPacket {
    slot: u16,
    round: u32,
    sent: Instant,
    /// Its slot's timer fired before its result came, and found a loss, a thread
    /// waiting as a whole, or a probe out (not results still coming in order). Its round
    /// trip may then time a wait for a peer's loss recovery, not the path, and the
    /// retransmission timeout does not take it (Karn's rule, widened); the pacer does,
    /// since it looks past a lone long round trip.
    expired: bool,
}

/// A header-only request sent while every slot of the thread waited.
#[derive(Debug, Clone, Copy)]
struct Probe {
    /// The slot the request went out on; its timer sends the next probe.
    slot: u16,
    /// The thread's transmissions before it.
    sent: u64,
    /// Probes sent in this wait; each doubles the timeout to the next.
    count: u32,
}

/// The worker-side protocol core of one worker thread.
#[derive(Debug)]
pub struct WorkerProtocol {
    config: WorkerConfig,
    slots: Vec<SlotState>,
    job: Option<Job>,
    status: JobStatus,
    broken: bool,
    pending: VecDeque<(u16, Send)>,
    /// Slots whose contribution's first sending waits for the pacer, in the order they
    /// were queued.
    paced: VecDeque<u16>,
    /// Retransmissions waiting for the pacer, which go before the first sendings.
    resends: VecDeque<(u16, Send)>,
    /// The pacer of this worker's path, which its other threads may share.
    pacer: Arc<LinkPacer>,
    /// Slots by their timers' deadlines, at most one live entry per slot (`queued`).
    timers: BinaryHeap<Reverse<(Instant, u16)>>,
    last_progress: Instant,
    rtt: Option<RttEstimate>,
    /// One contribution at a time is timed, sent once and not since. RFC 6298's gains
    /// assume about one sample per round trip: one per packet, with a window of packets
    /// in flight, would weigh only the last few packets' delays, and cost clock
    /// arithmetic on every packet.
    timed: Option<TimedPacket>,
    /// A slot's timeout before any backoff, from `rtt` and the configured floor: kept
    /// rather than worked out at every send.
    base_timeout: Duration,
    /// Packets sent so far: the clock `waiting_since` is read on.
    transmissions: u64,
    /// The latest `waiting_since` of a slot whose wait a result answered, this job: a
    /// slot waiting since earlier has evidence of a loss.
    latest_answered: Option<u64>,
    /// The probe out while the whole thread waits without evidence of a loss.
    probe: Option<Probe>,
    /// The latest result's round was completed by another worker's contribution.
    peers_complete: bool,
    counters: WorkerCounters,
}

impl WorkerProtocol {
    /// A worker thread's protocol, with a pacer of its own; timeouts are capped at
    /// a year.
    pub fn new(config: WorkerConfig, now: Instant) -> WorkerProtocol {
        let pacer = LinkPacer::new(config.pacing);
        WorkerProtocol::with_pacer(config, now, pacer)
    }

    /// A worker thread's protocol that paces its packets with `pacer`, which the worker's
    /// other threads share (its `config.pacing` is then `pacer`'s).
    pub fn with_pacer(mut config: WorkerConfig, now: Instant, pacer: Arc<LinkPacer>) -> WorkerProtocol {
        config.retransmit_timeout = config.retransmit_timeout.min(YEAR);
        config.max_retransmit_timeout = config.max_retransmit_timeout.min(YEAR);
        config.job_timeout = config.job_timeout.min(YEAR);
        let slots = (0..config.slots)
            .map(|_| SlotState {
                next_round: 0,
                active: false,
                have: u32::MAX,
                ahead: 0,
                outstanding: None,
                my_next: END_OF_STREAM,
                end_round: None,
                acked: u32::MAX,
                waiting_since: 0,
                held: None,
                deferred: false,
                paced: false,
                backoff: 0,
                deadline: None,
                queued: None,
            })
            .collect();
        WorkerProtocol {
            base_timeout: config.retransmit_timeout,
            pacer,
            config,
            slots,
            job: None,
            status: JobStatus::Idle,
            broken: false,
            pending: VecDeque::new(),
            paced: VecDeque::new(),
            resends: VecDeque::new(),
            timers: BinaryHeap::new(),
            last_progress: now,
            rtt: None,
            timed: None,
            transmissions: 0,
            latest_answered: None,
            probe: None,
            peers_complete: false,
            counters: WorkerCounters::default(),
        }
    }

    /// The current retransmission timeout of a slot.
    fn retransmit_timeout(&self, slot: &SlotState) -> Duration {
        let base = self.base_timeout;
        if slot.backoff == 0 {
            return base;
        }
        base.saturating_mul(1 << slot.backoff.min(16)).min(self.config.max_retransmit_timeout.max(base))
    }

    fn sample_rtt(&mut self, sample: Duration) {
        // At most a year (`new` caps the timeouts so), so that no sum below overflows.
        let sample = sample.as_nanos().min(YEAR.as_nanos()) as u64;
        let rtt = match self.rtt {
            None => RttEstimate { smoothed: sample, deviation: sample / 2 },
            Some(rtt) => {
                let error = sample.abs_diff(rtt.smoothed);
                RttEstimate {
                    smoothed: (rtt.smoothed * 7 + sample) / 8,
                    deviation: (rtt.deviation * 3 + error) / 4,
                }
            }
        };
        self.rtt = Some(rtt);
        let timeout = Duration::from_nanos(rtt.smoothed + rtt.deviation * 4);
        let ceiling = self.config.max_retransmit_timeout.max(self.config.retransmit_timeout);
        self.base_timeout = timeout.min(ceiling).max(self.config.retransmit_timeout);
    }

    /// The smoothed round-trip time measured so far.
    pub fn smoothed_rtt(&self) -> Option<Duration> {
        self.rtt.map(|rtt| Duration::from_nanos(rtt.smoothed))
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    pub fn status(&self) -> &JobStatus {
        &self.status
    }

    pub fn counters(&self) -> &WorkerCounters {
        &self.counters
    }

    /// Starts a job; its packets then come out of [`WorkerProtocol::poll_transmit`].
    pub fn start_job(&mut self, now: Instant, spec: JobSpec) -> Result<(), JobError> {
        if self.status == JobStatus::Running {
            return Err(JobError::Busy);
        }
        if self.broken {
            return Err(JobError::SessionBroken);
        }
        let blocks = spec.elements.div_ceil(self.config.packet_elements as u64);
        if blocks >= END_OF_STREAM as u64 {
            return Err(JobError::TooLarge { blocks });
        }
        let blocks = blocks as u32;
        if let Layout::Sparse(mask) = &spec.layout {
            if mask.blocks() != blocks {
                return Err(JobError::MaskSize { mask: mask.blocks(), blocks });
            }
            if spec.exponents {
                return Err(JobError::SparseExponents);
            }
        }
        let active_slots = (self.config.slots as u32).min(blocks) as u16;
        let stride = self.config.slots as u64;
        self.pending.clear();
        self.clear_paced();
        self.clear_timers();
        self.last_progress = now;
        self.timed = None;
        self.latest_answered = None;
        self.probe = None;
        self.pacer.job_started(now);
        for (index, slot) in self.slots.iter_mut().enumerate().take(active_slots as usize) {
            let block = index as u32;
            let next = match &spec.layout {
                Layout::Dense => END_OF_STREAM,
                Layout::Sparse(mask) => mask.next_in_stream(block as u64 + stride, stride),
            };
            slot.active = true;
            slot.have = slot.next_round.wrapping_sub(1);
            slot.ahead = 0;
            slot.my_next = next;
            slot.end_round = None;
            slot.deferred = false;
            slot.held = None;
            slot.backoff = 0;
            // In a block-floating-point job the first blocks wait for the exponent round.
            slot.outstanding = (!spec.exponents || index == 0).then_some(Contribution {
                round: slot.next_round,
                block,
                next,
                exponent: None,
                exponent_round: spec.exponents,
            });
            if slot.outstanding.is_some() {
                self.pending.push_back((index as u16, FIRST_SENDING));
            }
        }
        self.job = Some(Job { spec, blocks });
        self.status = JobStatus::Running;
        if active_slots == 0 {
            self.finish_job();
        }
        Ok(())
    }

    /// Writes the next packet to send into `buf` and returns its length.
    ///
    /// `buf` must hold a header and a full packet (a [`MAX_DATAGRAM_LEN`]-byte buffer
    /// always does); a smaller one yields nothing.
    ///
    /// [`MAX_DATAGRAM_LEN`]: netagg_wire::MAX_DATAGRAM_LEN
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8], io: &mut impl BlockIo) -> Option<usize> {
        if buf.len() < HEADER_LEN + self.config.packet_elements as usize * ELEMENT_LEN {
            return None;
        }
        let pacing = self.pacer.rate().is_some();
        while let Some((index, send)) = self.pending.pop_front() {
            // Data waits behind data already waiting, in order, retransmissions first.
            let waiting = !self.resends.is_empty() || !self.paced.is_empty();
            match send {
                FIRST_SENDING if pacing && (waiting || !self.pacer.allows(now)) => {
                    self.queue_paced(index);
                    continue;
                }
                Send::Data { retransmission: Some(_) } if pacing && (waiting || !self.pacer.allows(now)) => {
                    // One copy waits: a later timeout or notice asking for the same adds
                    // nothing.
                    if !self.resends.contains(&(index, send)) {
                        self.resends.push_back((index, send));
                    }
                    continue;
                }
                _ => {}
            }
            if let Some(len) = self.transmit(now, index, send, buf, io) {
                return Some(len);
            }
        }
        // Retransmissions first: they repair rounds every worker waits on.
        while !self.resends.is_empty() || !self.paced.is_empty() {
            if !self.pacer.allows(now) {
                return None;
            }
            let (index, send) = match self.resends.pop_front() {
                Some(resend) => resend,
                None => {
                    let index = self.paced.pop_front()?;
                    self.slots[index as usize].paced = false;
                    (index, FIRST_SENDING)
                }
            };
            if let Some(len) = self.transmit(now, index, send, buf, io) {
                return Some(len);
            }
        }
        None
    }

    /// Puts a slot's first sending of its contribution in the pacer's queue.
    fn queue_paced(&mut self, index: u16) {
        let slot = &mut self.slots[index as usize];
        if slot.active && slot.outstanding.is_some() && !slot.paced {
            slot.paced = true;
            self.paced.push_back(index);
            self.counters.paced += 1;
        }
    }

    /// Empties the pacer's queues: their packets are no longer to be sent.
    fn clear_paced(&mut self) {
        self.resends.clear();
        for index in self.paced.drain(..) {
            self.slots[index as usize].paced = false;
        }
    }

    /// Builds `send` for slot `index` into `buf`, and books it as sent at `now`.
    fn transmit(
        &mut self,
        now: Instant,
        index: u16,
        send: Send,
        buf: &mut [u8],
        io: &mut impl BlockIo,
    ) -> Option<usize> {
        let len = self.build(index, send, buf, io)?;
        self.counters.packets_sent += 1;
        self.counters.bytes_sent += len as u64;
        match send {
            FIRST_SENDING if self.timed.is_none() => {
                // `build` sent the slot's outstanding contribution.
                if let Some(contribution) = self.slots[index as usize].outstanding {
                    let round = contribution.round;
                    self.timed = Some(TimedPacket { slot: index, round, sent: now, expired: false });
                }
            }
            // Karn's rule: the result may answer either copy.
            Send::Data { retransmission: Some(_) } if self.timed.is_some_and(|t| t.slot == index) => {
                self.timed = None;
            }
            _ => {}
        }
        self.transmissions += 1;
        // The wait starts with a contribution's first sending. An answer to a resent one
        // or to a request may answer the first sending, so it must not count as the
        // answer to a packet sent later than the others waiting.
        if let Send::Data { retransmission } = send {
            self.pacer.sent(now, len);
            if retransmission.is_some() {
                self.pacer.lost();
            }
        }
        if send == FIRST_SENDING {
            self.slots[index as usize].waiting_since = self.transmissions;
        }
        self.arm_timer(index, now);
        Some(len)
    }

    fn build(&mut self, index: u16, send: Send, buf: &mut [u8], io: &mut impl BlockIo) -> Option<usize> {
        let job = self.job.as_ref()?;
        let slot = &self.slots[index as usize];
        if !slot.active {
            return None;
        }
        let sparse = matches!(job.spec.layout, Layout::Sparse(_));
        let mut repr = PacketRepr {
            message_type: MessageType::Ack,
            element_type: job.spec.element_type,
            flags: if sparse { Flags::SPARSE } else { Flags::NONE },
            session: self.config.session,
            job: job.spec.job,
            packet_id: 0,
            rank: self.config.rank,
            element_count: 0,
            slot: self.config.slot_base + index,
            exponent: 0,
            round: slot.have.wrapping_add(1),
            block: 0,
            next_block: 0,
            ack_round: slot.have,
            token: self.config.token,
        };
        match send {
            Send::Ack => self.counters.acks_sent += 1,
            Send::Request { round } => {
                if round != repr.round {
                    return None;
                }
                repr.flags = repr.flags | Flags::WANT_RESULT;
                self.counters.acks_sent += 1;
            }
            Send::Data { retransmission } => {
                let contribution = slot.outstanding?;
                // Answered, or known to be at the switch, while it waited in the queue; or
                // never sent yet, still in the pacer's queue.
                if retransmission.is_some_and(|round| {
                    round != contribution.round || slot.held == Some(round) || slot.paced
                }) {
                    return None;
                }
                let carries_data = !contribution.exponent_round
                    && match &job.spec.layout {
                        Layout::Dense => true,
                        Layout::Sparse(mask) => mask.contains(contribution.block),
                    };
                repr.message_type = MessageType::Data;
                repr.packet_id = contribution.block;
                repr.round = contribution.round;
                repr.block = contribution.block;
                repr.next_block = contribution.next;
                if carries_data {
                    repr.element_count =
                        block_len(&job.spec, contribution.block, self.config.packet_elements);
                }
                if retransmission.is_some() {
                    repr.flags = repr.flags | Flags::RETRANSMISSION;
                    self.counters.retransmissions += 1;
                }
                self.counters.data_sent += 1;
            }
        }
        let contribution = slot.outstanding.filter(|_| repr.message_type == MessageType::Data);
        if job.spec.exponents {
            if let Some(contribution) = contribution {
                repr.exponent = if contribution.exponent_round {
                    // The first window's blocks share the exponent this round agrees.
                    let first_window = job.blocks.min(self.config.slots as u32);
                    (0..first_window).map(|block| io.exponent(block)).max().unwrap_or(i8::MIN)
                } else {
                    let next = contribution.block as u64 + self.config.slots as u64;
                    if next < job.blocks as u64 {
                        io.exponent(next as u32)
                    } else {
                        i8::MIN
                    }
                };
            }
        }
        let len = repr.buffer_len();
        // `poll_transmit` checked that `buf` holds a full packet.
        let mut packet = repr.emit(buf).ok()?;
        if repr.element_count > 0 {
            io.load(repr.block, packet.payload_mut(), contribution.and_then(|c| c.exponent));
        }
        self.slots[index as usize].acked = repr.ack_round;
        Some(len)
    }

    fn arm_timer(&mut self, index: u16, now: Instant) {
        let deadline = now + self.retransmit_timeout(&self.slots[index as usize]);
        let slot = &mut self.slots[index as usize];
        slot.deadline = Some(deadline);
        if slot.queued.is_none_or(|queued| deadline < queued) {
            slot.queued = Some(deadline);
            self.timers.push(Reverse((deadline, index)));
        }
    }

    fn clear_timers(&mut self) {
        self.timers.clear();
        for slot in &mut self.slots {
            slot.deadline = None;
            slot.queued = None;
        }
    }

    /// The next slot whose timer is due at `now`. Entries come off the heap only once
    /// due: a superseded one is dropped, and one whose slot was re-armed since moves to its
    /// slot's deadline, so a slot costs a heap operation per timeout, not per send.
    fn due_timer(&mut self, now: Instant) -> Option<u16> {
        while let Some(&Reverse((at, index))) = self.timers.peek() {
            if at > now {
                return None;
            }
            self.timers.pop();
            let slot = &mut self.slots[index as usize];
            if slot.queued != Some(at) {
                continue;
            }
            slot.queued = None;
            match slot.deadline {
                Some(deadline) if slot.active && deadline <= now => return Some(index),
                Some(deadline) if slot.active => {
                    slot.queued = Some(deadline);
                    self.timers.push(Reverse((deadline, index)));
                }
                // Off the heap now: an inactive slot keeps no timer to re-arm later.
                _ => slot.deadline = None,
            }
        }
        None
    }

    /// Takes one datagram from the switch.
    pub fn handle_datagram(&mut self, now: Instant, datagram: &[u8], io: &mut impl BlockIo) -> Delivery {
        match self.receive(now, datagram, io) {
            Ok(delivery) => {
                match delivery {
                    Delivery::Accepted => {
                        self.counters.results_received += 1;
                        self.counters.bytes_received += datagram.len() as u64;
                        self.pacer.delivered(datagram.len());
                    }
                    Delivery::Duplicate => self.counters.duplicates += 1,
                    Delivery::Stale => self.counters.stale += 1,
                    Delivery::Pending => self.counters.pending += 1,
                    Delivery::Rejected(_) => {}
                }
                delivery
            }
            Err(reason) => {
                self.counters.rejected += 1;
                Delivery::Rejected(reason)
            }
        }
    }

    fn receive(
        &mut self,
        now: Instant,
        datagram: &[u8],
        io: &mut impl BlockIo,
    ) -> Result<Delivery, RejectReason> {
        let packet = Packet::new_checked(datagram)?;
        let repr = PacketRepr::parse(&packet);
        let pending = match repr.message_type {
            MessageType::Result => false,
            MessageType::Pending => true,
            MessageType::Data | MessageType::Ack => return Err(RejectReason::NotAResult),
        };
        if repr.session != self.config.session {
            return Err(RejectReason::WrongSession);
        }
        if repr.token != self.config.token {
            return Err(RejectReason::WrongToken);
        }
        // A pending notice answers one worker's question, so it is never broadcast.
        if repr.rank != self.config.rank && (pending || repr.rank != BROADCAST_RANK) {
            return Err(RejectReason::WrongRank);
        }
        let index = repr.slot.wrapping_sub(self.config.slot_base);
        if index >= self.config.slots {
            return Err(RejectReason::WrongSlot);
        }
        let Some(job) = &self.job else {
            return Ok(Delivery::Stale);
        };
        let slot = &mut self.slots[index as usize];
        if !slot.active || repr.job != job.spec.job || self.status != JobStatus::Running {
            return Ok(Delivery::Stale);
        }
        if pending {
            self.take_pending(now, index, &repr);
            return Ok(Delivery::Pending);
        }
        let offset = repr.round.wrapping_sub(slot.have);
        if offset == 0 || !is_after(repr.round, slot.have) {
            return Ok(Delivery::Duplicate);
        }
        if offset > 64 {
            return Err(RejectReason::RoundOutOfWindow);
        }
        if offset >= 2 && slot.ahead & (1 << (offset - 2)) != 0 {
            return Ok(Delivery::Duplicate);
        }
        let sparse = matches!(job.spec.layout, Layout::Sparse(_));
        if !sparse && slot.outstanding.is_none_or(|c| c.round != repr.round || c.block != repr.block) {
            return Err(RejectReason::WrongBlock);
        }
        let answered = slot.outstanding.filter(|c| c.round == repr.round);
        let exponent_round = answered.is_some_and(|c| c.exponent_round);
        if sparse && repr.block as u64 % self.config.slots as u64 != index as u64 {
            return Err(RejectReason::WrongBlock);
        }
        if repr.block >= job.blocks
            || (repr.element_count != 0
                && repr.element_count != block_len(&job.spec, repr.block, self.config.packet_elements))
            || (!sparse && (repr.element_count == 0) != exponent_round)
        {
            return Err(RejectReason::WrongLength);
        }

        if !exponent_round {
            io.store(repr.block, packet.payload(), answered.and_then(|c| c.exponent));
        }
        if offset == 1 {
            slot.have = repr.round;
            while slot.ahead & 1 != 0 {
                slot.have = slot.have.wrapping_add(1);
                slot.ahead >>= 1;
            }
            slot.ahead >>= 1;
        } else {
            slot.ahead |= 1 << (offset - 2);
        }
        let mut rtt_sample = None;
        if answered.is_some() {
            slot.outstanding = None;
            if let Some(timed) = self.timed.filter(|t| t.slot == index && t.round == repr.round) {
                let completed_here = repr.completed_by() == Some(self.config.rank);
                rtt_sample = Some((now.saturating_duration_since(timed.sent), timed.expired, completed_here));
                self.timed = None;
            }
        }
        slot.backoff = 0;
        self.last_progress = now;
        self.peers_complete = repr.completed_by().is_some_and(|rank| rank != self.config.rank);
        self.latest_answered = self.latest_answered.max(Some(slot.waiting_since));

        let stride = self.config.slots as u64;
        let pending_before = self.pending.len();
        // The switch's maximum of the look-ahead exponents: what the next block uses.
        let agreed = job.spec.exponents.then_some(repr.exponent);
        match &job.spec.layout {
            Layout::Dense if exponent_round => {
                // Every slot's first block goes out now, encoded with the agreed exponent.
                let first_window = job.blocks.min(self.config.slots as u32) as u16;
                for other in 0..first_window {
                    let slot = &mut self.slots[other as usize];
                    let round = slot.have.wrapping_add(1);
                    let block = other as u32;
                    slot.outstanding = Some(Contribution::data(round, block, END_OF_STREAM, agreed));
                    self.pending.push_back((other, FIRST_SENDING));
                }
            }
            Layout::Dense => {
                let next = repr.block as u64 + stride;
                if next < job.blocks as u64 {
                    let round = repr.round.wrapping_add(1);
                    let block = next as u32;
                    slot.outstanding = Some(Contribution::data(round, block, END_OF_STREAM, agreed));
                    self.pending.push_back((index, FIRST_SENDING));
                } else {
                    slot.end_round = Some(repr.round);
                }
            }
            Layout::Sparse(mask) => {
                if repr.next_block == END_OF_STREAM {
                    slot.end_round = Some(repr.round);
                } else if repr.next_block == slot.my_next {
                    let block = slot.my_next;
                    let next = mask.next_in_stream(block as u64 + stride, stride);
                    let round = repr.round.wrapping_add(1);
                    slot.outstanding = Some(Contribution::data(round, block, next, None));
                    slot.my_next = next;
                    self.pending.push_back((index, FIRST_SENDING));
                }
            }
        }

        let slot = &mut self.slots[index as usize];
        let done = slot.end_round == Some(slot.have) && slot.outstanding.is_none();
        if let Some((rtt, expired, completed_here)) = rtt_sample {
            if !expired {
                self.sample_rtt(rtt);
            }
            self.pacer.sample(now, rtt, completed_here);
        }
        if self.probe.is_some() {
            self.end_wait(now);
        }
        let slot = &mut self.slots[index as usize];
        if done {
            slot.next_round = slot.have.wrapping_add(1);
            slot.active = false;
            if self.slots.iter().all(|s| !s.active) {
                self.finish_job();
            }
            return Ok(Delivery::Accepted);
        }
        // A silent worker acknowledges every depth/2 results, so the aggregator can free
        // sets before a stream needs them again.
        let batch = (self.config.depth as u32 / 2).max(1);
        if slot.outstanding.is_none() && slot.have.wrapping_sub(slot.acked) >= batch {
            self.pending.push_back((index, Send::Ack));
        }
        if self.pending.len() == pending_before {
            slot.waiting_since = self.transmissions;
            self.arm_timer(index, now);
        } else {
            // The packet queued for the slot arms its timer when it is sent; until then
            // the timer of the packet just answered must not fire.
            slot.deadline = None;
        }
        Ok(Delivery::Accepted)
    }

    /// Takes the switch's word that round `notice.round` of a slot is still aggregating.
    fn take_pending(&mut self, now: Instant, index: u16, notice: &PacketRepr) {
        if let Some(probe) = self.probe.filter(|probe| probe.slot == index) {
            self.take_lacking(now, probe, notice.lacking());
        }
        let slot = &mut self.slots[index as usize];
        // About a round this slot is not contributing to: it waits for others, as it knew.
        let Some(contribution) = slot.outstanding.filter(|c| c.round == notice.round) else {
            return;
        };
        if notice.flags.contains(Flags::CONTRIBUTED) {
            slot.held = Some(contribution.round);
        } else if slot.held != Some(contribution.round) && !slot.paced {
            // Lost on the way: send it now. The thread was not (only) waiting for a late
            // peer, so the slots put off behind a probe may have lost theirs too.
            self.pending.push_back((index, Send::Data { retransmission: Some(contribution.round) }));
            self.end_wait(now);
        }
    }

    /// Acts on a probe's answer: the slots whose rounds wait for this worker's
    /// contribution. Those that sent one before the probe lost it, or lost the result it
    /// was answered with, so each sends it again or asks for the result.
    fn take_lacking(&mut self, now: Instant, probe: Probe, mut lacking: u64) {
        let mut resent = false;
        while lacking != 0 {
            let offset = lacking.trailing_zeros();
            lacking &= lacking - 1;
            let index = probe.slot as u32 + offset;
            let Some(slot) = self.slots.get_mut(index as usize) else {
                break;
            };
            if !slot.active || slot.paced || slot.waiting_since > probe.sent || index == probe.slot as u32 {
                continue;
            }
            slot.deferred = false;
            self.pending.push_back((index as u16, slot.recovery()));
            // Its timer fired while deferred: it runs again from now, as after any
            // recovery queued (see `handle_timeout`).
            self.arm_timer(index as u16, now);
            resent = true;
        }
        if resent {
            // A loss, not (only) a late peer: the other slots may have lost theirs too.
            self.end_wait(now);
        }
    }

    /// Slot `index`'s timed packet, if it is the timed one, no longer measures the path:
    /// its wait is for a loss, its recovery or a peer (Karn's rule, widened).
    fn expire_timed(&mut self, index: u16) {
        if let Some(timed) = self.timed.as_mut().filter(|timed| timed.slot == index) {
            timed.expired = true;
        }
    }

    /// The first active slot at or after `from`, wrapping around to slot 0.
    fn active_slot_from(&self, from: usize) -> u16 {
        let slots = self.slots.len();
        let from = if from >= slots { 0 } else { from };
        (from..slots).chain(0..from).find(|&index| self.slots[index].active).unwrap_or(0) as u16
    }

    /// Ends the thread's wait behind a probe, on progress or on evidence of a loss: the
    /// slots whose timers were put off behind the probe get their timers back, from now.
    fn end_wait(&mut self, now: Instant) {
        self.probe = None;
        for index in 0..self.slots.len() {
            let slot = &mut self.slots[index];
            if std::mem::take(&mut slot.deferred) && slot.active && !slot.paced {
                self.arm_timer(index as u16, now);
            }
        }
    }

    /// Fails the running job from outside, say because its transport broke. The slots'
    /// rounds are then out of step with the other workers, so later jobs are refused.
    pub fn abort(&mut self, reason: &str) {
        if self.status == JobStatus::Running {
            self.fail(JobError::Aborted(reason.to_string()));
        }
    }

    fn fail(&mut self, error: JobError) {
        self.status = JobStatus::Failed(error);
        self.counters.jobs_failed += 1;
        self.broken = true;
        self.pending.clear();
        self.clear_paced();
        self.clear_timers();
        for slot in &mut self.slots {
            slot.active = false;
        }
    }

    fn finish_job(&mut self) {
        self.status = JobStatus::Done;
        self.counters.jobs_done += 1;
        self.pending.clear();
        self.clear_paced();
        self.clear_timers();
    }

    /// When [`WorkerProtocol::handle_timeout`] may next have something to do: the
    /// earliest entry of `timers`, which may be before its slot's deadline (entries move
    /// lazily); a wake-up then finds nothing due and moves the entry.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.status != JobStatus::Running {
            return None;
        }
        let job_deadline = self.last_progress + self.config.job_timeout;
        let timer = self.timers.peek().map(|Reverse((at, _))| *at);
        let held = !self.paced.is_empty() || !self.resends.is_empty();
        let paced = self.pacer.ready_at().filter(|_| held);
        [timer, paced].into_iter().flatten().chain([job_deadline]).min()
    }

    /// Fires every timer due at `now`: retransmissions, requests, and the job timeout.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.status != JobStatus::Running {
            return;
        }
        if now.saturating_duration_since(self.last_progress) >= self.config.job_timeout {
            self.fail(JobError::Timeout(self.config.job_timeout));
            return;
        }
        while let Some(index) = self.due_timer(now) {
            let slot = &mut self.slots[index as usize];
            slot.deadline = None;
            if slot.paced {
                // Its contribution was never sent: the pacer sends it, and arms the timer.
                continue;
            }
            // RACK's reasoning: a result for something sent after this slot's packet means
            // the switch moved on without it; so does a gap in its results.
            let loss_evident =
                slot.ahead != 0 || self.latest_answered.is_some_and(|answered| answered > slot.waiting_since);
            if !loss_evident && self.probe.is_some_and(|probe| probe.slot != index) {
                // The probe's answer speaks for this slot too: wait for it.
                slot.deferred = true;
                self.expire_timed(index);
                continue;
            }
            if !loss_evident && now.saturating_duration_since(self.last_progress) < self.base_timeout {
                // Results are still coming, in the order their packets went out: this
                // slot's is queued behind them, not lost. A timed packet's round trip then
                // measures the queue, which the timeout must learn.
                self.arm_timer(index, now);
                continue;
            }
            // Past this point the wait is for a loss, its recovery or a late peer.
            self.expire_timed(index);
            self.counters.timeouts += 1;
            if !loss_evident {
                // Nothing answered since this slot sent: the thread waits, most likely for
                // a late peer. One header-only request asks the switch, as TCP resends one
                // segment on a timeout, not its window. Its answer maps 64 slots from the
                // one it asks about; a thread of more slots asks about the next 64 each time.
                let (asked, count) = match self.probe {
                    None => (index, 1),
                    Some(probe) => (self.active_slot_from(probe.slot as usize + 64), probe.count + 1),
                };
                if asked != index {
                    self.slots[index as usize].deferred = true;
                }
                let probing = &mut self.slots[asked as usize];
                probing.deferred = false;
                probing.backoff = count;
                self.probe = Some(Probe { slot: asked, sent: self.transmissions, count });
                self.counters.probes += 1;
                // The round trip under way measures the late peer, not the path.
                self.timed = None;
                let round = self.slots[asked as usize].have.wrapping_add(1);
                self.pending.push_back((asked, Send::Request { round }));
                self.arm_timer(asked, now);
                continue;
            }
            self.slots[index as usize].backoff += 1;
            if self.probe.is_some_and(|probe| probe.slot == index) {
                // The probing slot itself has evidence now: the thread no longer waits as
                // a whole, and the slots put off behind the probe must not wait for it.
                self.end_wait(now);
            }
            let slot = &self.slots[index as usize];
            let recovery = match slot.recovery() {
                // At the first timeout, while peers complete the rounds, ask whether the
                // switch holds the contribution rather than send it again: a round stalls
                // on one worker's loss, and the others, whose contributions are in, would
                // each send theirs twice. The answer says which; the one that lost its
                // packet sends it then, a round trip later than at once. A worker whose
                // contributions complete the rounds (the last to arrive, or alone) has the
                // stalled round waiting on itself, and sends again at once.
                Send::Data { .. }
                    if self.peers_complete
                        && slot.backoff == 1
                        && slot.outstanding.is_some_and(|c| c.round == slot.have.wrapping_add(1)) =>
                {
                    Send::Request { round: slot.have.wrapping_add(1) }
                }
                recovery => recovery,
            };
            self.pending.push_back((index, recovery));
            if matches!(recovery, Send::Data { .. }) && slot.ahead != 0 {
                // A gap in its results too: ask for the first it lacks.
                self.pending.push_back((index, Send::Request { round: slot.have.wrapping_add(1) }));
            }
            // The timer runs from now, not only from the sending: a retransmission may
            // wait for the pacer, and be dropped there if the switch meanwhile says it
            // holds the contribution; the slot must not be left without a timer.
            self.arm_timer(index, now);
        }
    }
}

/// Elements in block `block` of a job: a full packet, or the tail.
fn block_len(spec: &JobSpec, block: u32, packet_elements: u16) -> u16 {
    let start = block as u64 * packet_elements as u64;
    spec.elements.saturating_sub(start).min(packet_elements as u64) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of one int32 element each, the element being the block's number.
    struct Numbers;

    impl BlockIo for Numbers {
        fn load(&mut self, block: u32, payload: &mut [u8], _: Option<i8>) {
            payload.copy_from_slice(&(block as i32).to_le_bytes());
        }
        fn store(&mut self, _: u32, _: &[u8], _: Option<i8>) {}
    }

    /// The switch's result for a data packet, the sum being the packet itself; rank 1's
    /// contribution completed the round.
    fn result_of(packet: &[u8]) -> Vec<u8> {
        let mut result = packet.to_vec();
        let mut view = Packet::new_unchecked(&mut result[..]);
        view.set_message_type(MessageType::Result);
        view.set_rank(BROADCAST_RANK);
        view.set_ack_round(2);
        result
    }

    /// The switch's pending notice answering a request: the round is still aggregating,
    /// and the asker's contribution is in it or not.
    fn pending_of(request: &[u8], contributed: bool) -> Vec<u8> {
        let asked = PacketRepr::parse(&Packet::new_checked(request).unwrap());
        let notice = PacketRepr {
            flags: if contributed { Flags::CONTRIBUTED } else { Flags::NONE },
            job: asked.job,
            rank: asked.rank,
            slot: asked.slot,
            round: asked.round,
            ..PacketRepr::new(MessageType::Pending, asked.element_type, asked.session, asked.token, 0)
        };
        let mut bytes = vec![0; HEADER_LEN];
        notice.emit(&mut bytes[..]).unwrap();
        bytes
    }

    /// A protocol of `slots` slots of one int32 element each, running a dense job of
    /// `elements`; retransmission timeout `timeout`.
    fn running(start: Instant, slots: u16, elements: u64, timeout: Duration) -> WorkerProtocol {
        let config = WorkerConfig {
            session: 1,
            token: 2,
            rank: 0,
            slot_base: 0,
            slots,
            packet_elements: 1,
            depth: 2,
            retransmit_timeout: timeout,
            max_retransmit_timeout: timeout * 8,
            job_timeout: Duration::from_secs(10),
            pacing: PacingConfig::DEFAULT,
        };
        let mut protocol = WorkerProtocol::new(config, start);
        let job = JobSpec {
            job: 1,
            element_type: ElementType::Int32,
            elements,
            layout: Layout::Dense,
            exponents: false,
        };
        protocol.start_job(start, job).unwrap();
        protocol
    }

    /// Every packet the protocol has to send at `now`.
    fn sent(protocol: &mut WorkerProtocol, now: Instant) -> Vec<Vec<u8>> {
        let mut buffer = vec![0; 64];
        std::iter::from_fn(|| {
            protocol.poll_transmit(now, &mut buffer, &mut Numbers).map(|len| buffer[..len].to_vec())
        })
        .collect()
    }

    #[test]
    fn one_packet_per_round_trip_is_timed() {
        let start = Instant::now();
        let mut protocol = running(start, 4, 8, Duration::from_millis(1));
        let first = sent(&mut protocol, start);
        assert_eq!(first.len(), 4);
        // The first packet's result after 50 ms, the others' after 90 ms: only the first
        // was timed.
        let ms = Duration::from_millis;
        protocol.handle_datagram(start + ms(50), &result_of(&first[0]), &mut Numbers);
        for packet in &first[1..] {
            protocol.handle_datagram(start + ms(90), &result_of(packet), &mut Numbers);
        }
        assert_eq!(protocol.smoothed_rtt(), Some(ms(50)));
        // The next packet sent is timed: 10 ms, weighed in at RFC 6298's 1/8.
        let second = sent(&mut protocol, start + ms(90));
        assert_eq!(second.len(), 4);
        for packet in second.iter().rev() {
            protocol.handle_datagram(start + ms(100), &result_of(packet), &mut Numbers);
        }
        assert_eq!(protocol.smoothed_rtt(), Some(ms(45)));
        assert_eq!(protocol.status(), &JobStatus::Done);
    }

    #[test]
    fn a_retransmitted_packet_is_not_timed() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let mut protocol = running(start, 1, 2, timeout);
        let first = sent(&mut protocol, start);
        protocol.handle_timeout(start + timeout);
        let again = sent(&mut protocol, start + timeout);
        assert_eq!(again.len(), 1, "retransmitted");
        protocol.handle_datagram(start + timeout * 2, &result_of(&first[0]), &mut Numbers);
        assert_eq!(protocol.smoothed_rtt(), None, "either copy may have been answered");
        let later = start + timeout * 3;
        let second = sent(&mut protocol, later);
        protocol.handle_datagram(later + Duration::from_millis(3), &result_of(&second[0]), &mut Numbers);
        assert_eq!(protocol.smoothed_rtt(), Some(Duration::from_millis(3)), "the next one is");
    }

    #[test]
    fn another_slots_retransmission_leaves_the_timed_packet_timed() {
        let start = Instant::now();
        let (ms, timeout) = (Duration::from_millis, Duration::from_millis(10));
        let mut protocol = running(start, 3, 6, timeout);
        let first = sent(&mut protocol, start);
        protocol.handle_datagram(start + ms(1), &result_of(&first[0]), &mut Numbers);
        assert_eq!(protocol.smoothed_rtt(), Some(ms(1)));
        // Slot 0's next block is timed. Slot 2's result shows slot 1's packet, sent
        // before slot 2's, lost: it times out, asks, learns the switch lacks it, and
        // sends it again.
        protocol.handle_datagram(start + ms(1), &result_of(&first[2]), &mut Numbers);
        let timed = sent(&mut protocol, start + ms(1));
        protocol.handle_timeout(start + timeout);
        let asked = sent(&mut protocol, start + timeout);
        protocol.handle_datagram(start + timeout, &pending_of(&asked[0], false), &mut Numbers);
        let again = sent(&mut protocol, start + timeout);
        assert_eq!((timed.len(), asked.len(), again.len()), (2, 1, 1));
        let resent = PacketRepr::parse(&Packet::new_checked(&again[0][..]).unwrap());
        assert_eq!((resent.block, resent.flags), (1, Flags::RETRANSMISSION));
        protocol.handle_datagram(start + timeout + ms(1), &result_of(&timed[0]), &mut Numbers);
        // (7 · 1 ms + 10 ms) / 8
        assert_eq!(protocol.smoothed_rtt(), Some(Duration::from_micros(2125)));
    }

    #[test]
    fn a_retransmission_of_a_round_answered_meanwhile_is_not_sent() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let mut protocol = running(start, 1, 2, timeout);
        let first = sent(&mut protocol, start);
        // The timer fires, and the result arrives before the retransmission goes out.
        protocol.handle_timeout(start + timeout);
        protocol.handle_datagram(start + timeout, &result_of(&first[0]), &mut Numbers);
        let next = sent(&mut protocol, start + timeout);
        assert_eq!(next.len(), 1, "the next block, once");
        let repr = PacketRepr::parse(&Packet::new_checked(&next[0][..]).unwrap());
        assert_eq!((repr.block, repr.flags), (1, Flags::NONE));
        assert_eq!(protocol.counters().retransmissions, 0);
    }

    #[test]
    fn a_result_after_its_deadline_releases_the_next_block_without_a_retransmission() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let mut protocol = running(start, 1, 2, timeout);
        let mut buffer = vec![0; 64];
        let len = protocol.poll_transmit(start, &mut buffer, &mut Numbers).unwrap();
        let first = buffer[..len].to_vec();

        // The result arrives after the timer's deadline, and the timers run before the
        // next block goes out, as a worker thread's loop runs them.
        let late = start + timeout * 2;
        let delivery = protocol.handle_datagram(late, &result_of(&first), &mut Numbers);
        assert_eq!(delivery, Delivery::Accepted);
        protocol.handle_timeout(late);
        let len = protocol.poll_transmit(late, &mut buffer, &mut Numbers).unwrap();
        let second = PacketRepr::parse(&Packet::new_checked(&buffer[..len]).unwrap());
        assert_eq!((second.block, second.flags), (1, Flags::NONE));
        assert_eq!(protocol.poll_transmit(late, &mut buffer, &mut Numbers), None, "sent once");
        assert_eq!((protocol.counters().retransmissions, protocol.counters().timeouts), (0, 0));
    }

    /// A job of three blocks whose second packet is taken as lost (the third's result
    /// came, the first's too), when its timer fires.
    fn lost_in_the_middle(start: Instant, timeout: Duration) -> (WorkerProtocol, Vec<Vec<u8>>) {
        let mut protocol = running(start, 3, 3, timeout);
        let first = sent(&mut protocol, start);
        for answered in [&first[0], &first[2]] {
            protocol.handle_datagram(start, &result_of(answered), &mut Numbers);
        }
        assert!(sent(&mut protocol, start).is_empty());
        protocol.handle_timeout(start + timeout);
        (protocol, first)
    }

    #[test]
    fn a_timeout_asks_whether_the_switch_holds_the_contribution_before_resending_it() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let (mut protocol, _) = lost_in_the_middle(start, timeout);
        let asked = sent(&mut protocol, start + timeout);
        assert_eq!(asked.len(), 1);
        let request = PacketRepr::parse(&Packet::new_checked(&asked[0][..]).unwrap());
        assert_eq!(
            (request.message_type, request.slot, request.flags),
            (MessageType::Ack, 1, Flags::WANT_RESULT)
        );
        assert_eq!(request.buffer_len(), HEADER_LEN, "header only");
        // The switch holds it: nothing is sent again, and the slot keeps asking.
        protocol.handle_datagram(start + timeout, &pending_of(&asked[0], true), &mut Numbers);
        assert!(sent(&mut protocol, start + timeout).is_empty());
        let next = protocol.poll_timeout().unwrap();
        protocol.handle_timeout(next);
        let again = sent(&mut protocol, next);
        let request = PacketRepr::parse(&Packet::new_checked(&again[0][..]).unwrap());
        assert_eq!((again.len(), request.message_type), (1, MessageType::Ack));
        assert_eq!(protocol.counters().retransmissions, 0);
        // The second timeout of a slot that knows nothing sends its data.
        let (mut unanswered, _) = lost_in_the_middle(start, timeout);
        sent(&mut unanswered, start + timeout);
        let next = unanswered.poll_timeout().unwrap();
        unanswered.handle_timeout(next);
        let resent = sent(&mut unanswered, next);
        let repr = PacketRepr::parse(&Packet::new_checked(&resent[0][..]).unwrap());
        assert_eq!((repr.message_type, repr.flags), (MessageType::Data, Flags::RETRANSMISSION));
    }

    #[test]
    fn a_recovery_dropped_before_it_is_sent_leaves_the_slot_its_timer() {
        // A retransmission queued (behind a pacer, say) is dropped when the switch says,
        // meanwhile, that it holds the contribution; the slot's timer must still run,
        // or the slot would never ask for its result again.
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let (mut protocol, first) = lost_in_the_middle(start, timeout);
        let asked = sent(&mut protocol, start + timeout);
        // Unanswered: the second timeout queues the data again...
        let next = protocol.poll_timeout().unwrap();
        protocol.handle_timeout(next);
        // ...and before it goes out, the answer to the request arrives: held.
        protocol.handle_datagram(next, &pending_of(&asked[0], true), &mut Numbers);
        assert!(sent(&mut protocol, next).is_empty(), "the retransmission is dropped");
        let deadline = protocol.poll_timeout().unwrap();
        assert!(
            deadline < start + Duration::from_secs(1),
            "a slot timer, not the job's: {:?}",
            deadline - start
        );
        protocol.handle_timeout(deadline);
        let request = sent(&mut protocol, deadline);
        assert_eq!(
            PacketRepr::parse(&Packet::new_checked(&request[0][..]).unwrap()).message_type,
            MessageType::Ack
        );
        // The result comes, and the job is done.
        protocol.handle_datagram(deadline, &result_of(&first[1]), &mut Numbers);
        assert_eq!(protocol.status(), &JobStatus::Done);
    }

    #[test]
    fn a_worker_whose_contributions_complete_the_rounds_resends_at_once() {
        // Its own contributions completed the rounds answered: the stalled round waits on
        // it, so its first timeout sends the data again rather than ask.
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let mut protocol = running(start, 3, 3, timeout);
        let first = sent(&mut protocol, start);
        for answered in [&first[0], &first[2]] {
            let mut result = result_of(answered);
            Packet::new_unchecked(&mut result[..]).set_ack_round(1);
            protocol.handle_datagram(start, &result, &mut Numbers);
        }
        protocol.handle_timeout(start + timeout);
        let again = sent(&mut protocol, start + timeout);
        let repr = PacketRepr::parse(&Packet::new_checked(&again[0][..]).unwrap());
        assert_eq!(
            (again.len(), repr.message_type, repr.flags),
            (1, MessageType::Data, Flags::RETRANSMISSION)
        );
    }

    #[test]
    fn a_packet_queued_behind_results_still_coming_is_timed_past_the_timeout() {
        // The timeout learns a queue: slot 0's second packet waits 14 ms, past the 10 ms
        // timeout, while slot 1's result shows the path still delivering in order.
        let start = Instant::now();
        let (ms, timeout) = (Duration::from_millis, Duration::from_millis(10));
        let mut protocol = running(start, 2, 4, timeout);
        let first = sent(&mut protocol, start);
        protocol.handle_datagram(start + ms(1), &result_of(&first[0]), &mut Numbers);
        let second = sent(&mut protocol, start + ms(1));
        protocol.handle_datagram(start + ms(9), &result_of(&first[1]), &mut Numbers);
        sent(&mut protocol, start + ms(9));
        protocol.handle_timeout(start + ms(11));
        assert!(sent(&mut protocol, start + ms(11)).is_empty(), "queued, not lost");
        protocol.handle_datagram(start + ms(15), &result_of(&second[0]), &mut Numbers);
        // (7 · 1 ms + 14 ms) / 8
        assert_eq!(protocol.smoothed_rtt(), Some(Duration::from_micros(2625)));
    }
}
