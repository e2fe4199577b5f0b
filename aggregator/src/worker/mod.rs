//! The worker side of the protocol, without I/O: one instance per worker thread.
//!
//! A thread owns a contiguous range of the session's slots. Its share of a job is cut
//! into blocks of one packet's elements of its type (`packet_elements` 4-byte ones, twice
//! as many 16-bit ones); block `b` travels through local slot `b % slots`, so
//! every slot carries a *stream* of blocks `s, s + slots, s + 2·slots, …`, and every rank
//! maps the same elements to the same slot.
//!
//! Payloads never pass through this core: [`BlockIo`] loads a block into an outgoing
//! packet and stores a result, so the caller does pre- and post-processing in place.
//!
//! The protocol's state and public surface are here; its mechanisms each have a module:
//! - `job`: a job's description, and how it starts, finishes and fails.
//! - `streams`: which block each slot contributes next, dense (SwitchML's self-clocked
//!   window) or sparse (OmniReduce's streams of non-zero blocks).
//! - `send`: building packets, data going out through the pacer of the worker's path.
//! - `receive`: taking results and pending notices from the switch.
//! - `timers`: the slots' retransmission timers, and the round-trip time they follow.
//! - `recovery`: what a slot whose timer fires does: loss detection, resends, requests
//!   and probes, and what the switch's answers to them tell it.
//! - `sequence`: lost results found as gaps in the switch's numbering of its
//!   broadcasts, in a few packets; and this thread's numbering of its first sendings,
//!   in which the switch finds lost contributions.
//! - `early_loss`: loss found and repaired in round trips of the path, not timeouts:
//!   a slot overtaken by later results, or whose recovery goes unanswered.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use netagg_wire::packet::END_OF_STREAM;
use netagg_wire::{Integrity, WireError};

use crate::overtaking::Sendings;
use crate::pacer::{DeliveryBatch, LinkPacer, LossRuns, PacingConfig};

mod early_loss;
mod job;
mod keys;
mod queue;
mod receive;
mod recovery;
mod send;
mod sequence;
mod streams;
#[cfg(test)]
mod testing;
mod timers;

pub use job::{thread_blocks, JobError, JobSpec, JobStatus};
pub use keys::{SessionKey, SessionKeys};
pub use streams::{BlockMask, Layout};

use queue::SendQueue;
pub(crate) use timers::RttEstimate;
use timers::YEAR;

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

/// Parameters of one worker thread in one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// The session's id and token of each slot's switch.
    pub keys: SessionKeys,
    pub rank: u16,
    /// This thread's slots are `slot_base..slot_base + slots`.
    pub slot_base: u16,
    pub slots: u16,
    /// Elements of 4 bytes in a packet: fixes its payload bytes, so 16-bit packets carry
    /// twice as many.
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
    /// Whether the packets sent are sealed and the datagrams received checked: always,
    /// but on a link in this process's memory that no fault injector corrupts.
    pub integrity: Integrity,
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
    /// A progress report, answering a probe.
    Progress,
    /// Not a result for this worker.
    Rejected(RejectReason),
}

/// Why a datagram from the switch was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    #[error("malformed packet: {0}")]
    Malformed(WireError),
    /// The checksum did not match ([`WireError::Checksum`], which says so).
    #[error("{0}")]
    Corrupt(WireError),
    #[error("neither a result, a pending notice nor a progress report")]
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
        /// Header-only probes sent while the whole thread waited: one per 64 slots (at
        /// most 8) per timeout of the probing slot, instead of a window of
        /// retransmissions.
        pub probes: u64,
        /// First sendings the pacer held back, to space them at the rate the path carries.
        pub paced: u64,
        pub results_received: u64,
        /// Bytes of the new results received, headers included.
        pub bytes_received: u64,
        pub duplicates: u64,
        pub stale: u64,
        pub rejected: u64,
        /// Datagrams whose checksum did not match their bytes: corrupted on their way,
        /// dropped, and recovered as lost.
        pub corrupt: u64,
        /// Pending notices received: a round asked about is still aggregating.
        pub pending: u64,
        /// Progress reports received, each answering a probe.
        pub progress_reports: u64,
        /// Requests for a result sent because a gap in the switch's numbering of its
        /// broadcasts showed one lost.
        pub gap_requests: u64,
        /// Contributions sent again because the switch's notice named their first
        /// sending's number lost.
        pub lost_notices: u64,
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
    /// A probe: where do this slot and the next ones stand at the switch? Dropped if the
    /// thread's wait ended while it was queued.
    Probe,
}

/// A contribution's first sending: the one send the pacer may hold back.
const FIRST_SENDING: Send = Send::Data { retransmission: None };

/// A slot's turn in the pacer's queue: each round a paced thread takes part in draws one
/// result down its path, whether or not it sends anything to the round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PacedTurn {
    /// The slot's contribution's first sending, held back.
    Contribution(u16),
    /// A round of a sparse stream that names only other workers' blocks: nothing to
    /// send, but its result comes down this worker's path as every other does. Booked
    /// at the pacer like a sending, so that the rate paces the results a thread's
    /// rounds draw, not only the packets it sends: paced by its sendings alone, each of
    /// four workers let the rounds of the others' blocks through unpaced, their results
    /// came down at 1.4 times the rate each measured, and the rounds, taken in a
    /// different order by each worker, completed in bursts that a queue of a frame or
    /// two dropped (`benches/RESULTS.md`, "Rounds paced, not packets"). Taken in the
    /// order of the results that released them, as the peers take theirs, the turns
    /// keep the workers' rounds in step, as a dense job's are. Names the slot and the
    /// round.
    Silent(u16, u32),
}

/// What a thread knows of one switch endpoint it sends to. Each endpoint answers in its
/// own order and numbers its own broadcasts (a switch of a sharded session sits behind
/// queues of its own; lanes of one switch run on threads of their own): a result from
/// one is no evidence that a packet to another was lost. Taken as such, the results of a switch
/// behind a shorter queue made the sendings to another look overtaken, and each worker
/// of a sharded session resent up to a seventh of its packets on lossless links.
#[derive(Debug, Default)]
struct EndpointState {
    /// This job's first sendings to the endpoint not yet judged for loss, in the order
    /// they went out.
    first_sendings: Sendings<u64, u32>,
    /// The latest `waiting_since` of a slot of the endpoint whose wait a result
    /// answered, this job: a slot of the endpoint waiting since earlier has evidence of
    /// a loss.
    latest_answered: Option<u64>,
    /// What the thread has seen of the endpoint's numbering of its broadcasts.
    gaps: sequence::BroadcastGaps,
    /// The numbers of this thread's first sendings to the endpoint.
    first_numbers: sequence::FirstSendingNumbers,
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
    /// The slot waits for a round it has nothing to send to, whose turn waits in the
    /// pacer's queue ([`PacedTurn::Silent`]): its peers take their turns for the round
    /// about when this thread takes its own, so its wait, and its timer, begin then.
    /// Holds the round waited for: a turn queued for an earlier round, whose result came
    /// before the turn was taken, must not begin this round's wait early.
    silent_turn: Option<u32>,
    /// The number of its contribution's first sending among the thread's (`loss_runs`).
    first_sending: u64,
    /// Consecutive timeouts of this slot; each doubles its timeout.
    backoff: u32,
    /// When the slot last sent a request or a retransmission that the switch has not
    /// answered yet.
    recovery_sent: Option<Instant>,
    /// The round of the slot's latest result that answered its contribution, and the
    /// `waiting_since` of the wait it ended: when a notice of a lost first sending comes
    /// behind that result, when the packet that showed the loss went out.
    answered_wait: (u32, u64),
    /// The wait (its `waiting_since`) in which a gap in the broadcasts' numbers had this
    /// slot ask for its result: asked once a wait, so the next gap guesses another slot.
    gap_asked: Option<u64>,
    /// The session as this slot's switch knows it.
    key: SessionKey,
    /// The index of this slot's owner among the session's endpoints
    /// ([`SessionKeys::owner`]), looked up once rather than at every result.
    endpoint: usize,
    /// When this slot's retransmission timer fires; re-armed at every send.
    deadline: Option<Instant>,
    /// The deadline of this slot's live entry in `timers`. Re-arming to a later deadline
    /// leaves that entry alone (it moves when it reaches the top), so that a send costs
    /// no heap operation: a timer is re-armed at every send but fires once per timeout.
    queued: Option<Instant>,
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

/// The probes out while every slot of the thread waits.
#[derive(Debug, Clone, Copy)]
struct Probe {
    /// The slot whose timer sends the next probes.
    slot: u16,
    /// Rounds of probes sent in this wait; each doubles the timeout to the next.
    count: u32,
    /// The slot the next round starts from: where a round covers only some of the
    /// thread's slots, the next takes the others' turn.
    next: u16,
}

/// The worker-side protocol core of one worker thread.
#[derive(Debug)]
pub struct WorkerProtocol {
    config: WorkerConfig,
    slots: Vec<SlotState>,
    job: Option<Job>,
    status: JobStatus,
    broken: bool,
    pending: SendQueue<(u16, Send)>,
    /// Slots whose turn waits for the pacer, in the order they were queued: a
    /// contribution's first sending, or a round this thread only waits for.
    paced: VecDeque<PacedTurn>,
    /// Retransmissions waiting for the pacer, which go before the first sendings.
    resends: VecDeque<(u16, Send)>,
    /// The pacer of this worker's path, which its other threads may share.
    pacer: Arc<LinkPacer>,
    /// Results received and not yet in the pacer's count.
    delivered: DeliveryBatch,
    /// The thread's first sendings, and the run of them found lost, for the pacer.
    loss_runs: LossRuns,
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
    /// The probes out while the whole thread waits without evidence of a loss.
    probe: Option<Probe>,
    /// How long the switch takes to answer a request or a retransmission, which it does
    /// at once: the path's round trip, without waiting for any peer.
    answer_rtt: Option<RttEstimate>,
    /// The latest result's round was completed by another worker's contribution.
    peers_complete: bool,
    /// What the thread knows of each switch endpoint it sends to, one per range of
    /// [`WorkerConfig::keys`].
    endpoints: Vec<EndpointState>,
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
            .map(|index| SlotState {
                key: config.keys.key(config.slot_base.wrapping_add(index)),
                endpoint: config.keys.owner(config.slot_base.wrapping_add(index)),
                next_round: 0,
                active: false,
                have: u32::MAX,
                ahead: 0,
                outstanding: None,
                my_next: END_OF_STREAM,
                end_round: None,
                acked: u32::MAX,
                waiting_since: 0,
                answered_wait: (0, 0),
                held: None,
                deferred: false,
                paced: false,
                silent_turn: None,
                first_sending: 0,
                backoff: 0,
                recovery_sent: None,
                gap_asked: None,
                deadline: None,
                queued: None,
            })
            .collect();
        let endpoints = (0..config.keys.endpoints()).map(|_| EndpointState::default()).collect();
        WorkerProtocol {
            base_timeout: config.retransmit_timeout,
            pacer,
            delivered: DeliveryBatch::default(),
            loss_runs: LossRuns::default(),
            config,
            slots,
            job: None,
            status: JobStatus::Idle,
            broken: false,
            pending: SendQueue::new(),
            paced: VecDeque::new(),
            resends: VecDeque::new(),
            timers: BinaryHeap::new(),
            last_progress: now,
            rtt: None,
            timed: None,
            transmissions: 0,
            probe: None,
            answer_rtt: None,
            peers_complete: false,
            endpoints,
            counters: WorkerCounters::default(),
        }
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
}
