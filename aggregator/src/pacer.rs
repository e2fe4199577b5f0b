//! Pacing of a worker's data packets to the rate its path carries.
//!
//! A fixed window of packets, sent at once, stands in the queue of a link slower than the
//! sender: the whole window waits there, a delay that grows with the window and shrinks
//! with the link's rate (42 ms for 256 KiB at 50 Mbit/s), and a queue shorter than the
//! window drops the rest. The pacer keeps the queue near a small target by spacing the
//! worker's data packets in time, which leaves the window alone.
//!
//! Why spacing, not a smaller window: a slot's next block is released only by its own
//! result, and the result needs every worker's contribution to the same round. A window
//! cut below the slots in use would park some slots on every rank; ranks whose parked
//! sets differ (after a loss, and in every sparse stream) would wait on each other for
//! ever. Time alone releases a paced packet, so a paced run is the unpaced protocol over
//! a link with a bounded delay at the sender, and keeps its liveness.
//!
//! One [`LinkPacer`] serves all of a worker's threads, since they share its link. It
//! paces data: contributions' first sendings and retransmissions, retransmissions first.
//! Acknowledgements, requests and probes, header-only and few, pass at once.
//!
//! The signal is the *standing* queueing delay: the least round trip of a decision
//! period (at least [`SAMPLES`] round trips and 4 ms) less the least round trip
//! of the session. A late peer or a peer's loss recovery lengthens some round trips; only
//! a queue lengthens all of them, so random loss and stragglers never engage the pacer.
//! Nor does a queue deep enough to hold the window, which costs delay, not throughput:
//! an unpaced worker engages only in a period in which it also sent data again.
//! Each result names the rank that completed its round, and only the rounds this worker
//! completed time its own path; the others include waiting for a peer. At the end of each
//! period:
//! - a standing delay on its own path, above the target, sets the rate to the rate the
//!   results arrived at, scaled down so that the excess drains within about a period
//!   (which is never below three quarters of it), and takes that arrival rate as the
//!   path's measured rate;
//! - a standing delay on a peer's path (rounds that waited for others) caps the rate at
//!   the rate the rounds completed, and no lower: sending faster would only queue this
//!   worker's packets on its own link, and slowing below would make it the one that holds
//!   the rounds up;
//! - no standing delay on its own path raises a rate that held sends back, by up to an
//!   eighth, the less the closer the delay is to the target, never far beyond the rate
//!   delivered or measured.
//!
//! A queue of a packet or two holds less than the target: a window many times it shows
//! no delay, loses all but the first few packets of each burst, and the doubling timeouts
//! leave the link idle, a collapse. Loss rules engage the pacer there:
//! - a run of [`OVERFLOW_RUN`] of a thread's first sendings lost in a row ([`LossRuns`])
//!   is a queue's overflow, which drops the tail of a burst; random loss drops packets
//!   apart. An unpaced worker that has measured its path's capacity by loss before (an
//!   earlier job) is paced just below it at once. One that has not is paced at the rate
//!   the burst's results came at, up to the latest of them and over [`MIN_PERIOD`] at
//!   least: the packets the overflow let through left the queue back to back, at the
//!   path's rate. A paced worker's rate is halved. At most once a round trip;
//! - a rate an overflow set probes: each period of [`PROBE_SAMPLE`] sendings paces it a
//!   quarter above the most the path has delivered in one, which a rate past the path's
//!   does not raise; loss beyond [`PROBE_LOSS_TOLERANCE`] ends the probe, and the most
//!   a probing period delivered is the path's capacity (never the rate the probe started
//!   at, a guess from a burst's few results). Losses come to light a timeout after their
//!   sending, periods later: a probe raising its own rate would run far past the path;
//! - a paced worker that finds more than [`LOSS_TOLERANCE`] of its data sendings lost
//!   paces below the share the path carried; one whose share lost stays as high after two
//!   such cuts in a row is losing at random, at any rate, and is unpaced again;
//! - a capacity loss measured on a path that never showed a standing queue caps the
//!   rate's raises just below it: a raise past it would go unseen until its losses. It
//!   creeps up by [`LOSSY_CREEP`] while the rate presses against it.
//!
//! Data sendings and results are booked as full packets, whatever they hold: a sparse
//! stream's contribution may be a bare header while its result, every worker's blocks,
//! is full, and one sending draws at most one result. Booked at their sizes, a paced
//! rate would let results through faster than itself and overflow the path down.
//!
//! Every worker's thread `t` carries the same rounds, so all of them settle on the
//! slowest path's rate. Until a path shows a standing queue the worker is not paced at
//! all, so that a path faster than the worker (a loopback, a fast network) costs nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Round trips per decision at least, of which the least is taken as the standing delay.
pub const SAMPLES: u32 = 4;

/// A decision period's least length. Short periods measure bursts, not rates: a shaper's
/// bucket (tbf's `burst`) lets tens of kilobytes through at once.
const MIN_PERIOD: Duration = Duration::from_millis(4);

/// How far a paced thread may fall behind its schedule and catch up at once: the
/// burst after an idle spell, and the slack for a shell that wakes up late.
const BURST: Duration = Duration::from_millis(2);

/// How far ahead of its schedule a packet may leave: a thread woken for one packet sends
/// what falls due within this too, so that pacing costs a wake-up per few packets, not
/// one per packet.
const QUANTUM: Duration = Duration::from_micros(500);

/// The least rate the pacer sets, in bytes per second: time alone must keep releasing
/// packets, however long the measured delays.
const MIN_RATE: u64 = 8_000;

/// The largest raise per decision, as a fraction: an eighth. The queue must hold the
/// excess a raise sends until the next decision sees it.
const MAX_RAISE: f64 = 0.125;

/// How far above the most the path delivered a probing rate goes: a quarter, as BBR's
/// probes do. Too little and a rate set low climbs slowly; past the path, the excess is
/// lost, found only a timeout later.
const PROBE_RAISE: f64 = 0.25;

/// How far a capacity that loss measured rises in a period whose rate pressed against
/// it: slowly, since passing it costs losses found only a timeout later.
const LOSSY_CREEP: f64 = 1.0 / 64.0;

/// Data sendings that end a probing period, and that its share lost is judged on: the
/// largest delivery rate of periods of a few packets would be that of a lucky few.
const PROBE_SAMPLE: u32 = 16;

/// Consecutive first sendings of one thread found lost that show a queue's overflow: a
/// full queue drops the tail of a burst, random loss drops packets apart. At 30 % loss
/// each way a round trip fails with probability 0.51, and 16 in a row (2e-5 were losses
/// independent) came up often enough in `tests/stress.rs` to pace, and slow, lossy
/// clusters with no queue; 32 in a row (4e-10) against runs of a window less a packet or
/// two in a collapse. Losses are not independent (a stall leaves many sendings
/// unanswered together): 32 still engaged one of the stress test's 1 500 clusters, which
/// the share rule unpaces again.
pub const OVERFLOW_RUN: u32 = 32;

/// The share of a paced period's data sendings found lost that the rate tolerates: random
/// loss of a few percent each way stays below; a rate above a queue too short to show
/// delay loses the excess.
const LOSS_TOLERANCE: f64 = 0.125;

/// The share of a probing period's data sendings found lost that still lets the rate
/// grow: 1 % random loss each way resends about 2 % of them, while a probe past a queue
/// too short to show delay loses far more.
const PROBE_LOSS_TOLERANCE: f64 = 0.02;

/// Data sendings a paced worker counts before it judges their share lost: fewer, and a
/// loss or two decides.
const LOSS_SAMPLE: u32 = 64;

/// Results a probe's seed must be measured on to be timed by its latest result: the few
/// survivors of one burst span too little time to time.
const SEED_RESULTS: u64 = 8;

/// How a worker paces its data packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacingConfig {
    /// Pace once a standing queue appears; without it the window alone governs.
    pub enabled: bool,
    /// The standing queueing delay the pacer aims below.
    pub target: Duration,
}

impl PacingConfig {
    /// Pacing on, with a target of 2 ms: below the shortest queue worth emulating (a few
    /// ms), and above the delays a busy host's scheduling adds to round trips.
    pub const DEFAULT: PacingConfig = PacingConfig { enabled: true, target: Duration::from_millis(2) };
}

impl Default for PacingConfig {
    fn default() -> PacingConfig {
        PacingConfig::DEFAULT
    }
}

/// The round trips since the last decision.
#[derive(Debug, Clone, Copy, Default)]
struct Period {
    /// When it began; `None` before the first sample of a session.
    began: Option<Instant>,
    /// Bytes of results received when it began.
    delivered: u64,
    samples: u32,
    /// The least round trip in it.
    least: Option<Duration>,
    /// The least round trip of the rounds this worker's contribution completed: its own
    /// path's.
    least_completed: Option<Duration>,
    /// Data packets sent while paced.
    sent: u32,
    /// Data packets sent again: a packet of the worker's was lost, or its result was.
    lost: u32,
}

/// The pacer of one worker's path, shared by the worker's threads: they send over the
/// same link, so one rate and one schedule cover them all, each thread taking its packets'
/// turns from it. Paced separately, threads would share the link unevenly, and a job
/// ends only when its slowest thread does.
#[derive(Debug)]
pub struct LinkPacer {
    /// The rate in bytes per second, 0 while unpaced: read on every send without the lock.
    rate: AtomicU64,
    /// Bytes of results the threads received.
    delivered: AtomicU64,
    /// When the latest of them came, in nanoseconds after the first: the end of the span
    /// they were delivered in, which an overflow measures the path's rate by.
    latest_result: AtomicU64,
    first_result: OnceLock<Instant>,
    state: Mutex<Pacer>,
}

impl LinkPacer {
    pub fn new(config: PacingConfig) -> Arc<LinkPacer> {
        Arc::new(LinkPacer {
            rate: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            latest_result: AtomicU64::new(0),
            first_result: OnceLock::new(),
            state: Mutex::new(Pacer::new(config)),
        })
    }

    /// The rate set, in bytes per second; `None` while the path is not paced.
    pub fn rate(&self) -> Option<u64> {
        Some(self.rate.load(Ordering::Relaxed)).filter(|&rate| rate > 0)
    }

    /// The state; a thread that panicked holding it left it whole (every update is a
    /// few assignments), so a poisoned lock is taken as it is.
    fn state(&self) -> MutexGuard<'_, Pacer> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn allows(&self, now: Instant) -> bool {
        self.state().allows(now)
    }

    pub(crate) fn ready_at(&self) -> Option<Instant> {
        self.state().ready_at()
    }

    /// Books a data packet sent; nothing to book, and no lock to take, while the path is
    /// not paced (every data packet comes here). A probe's periods end here too: a
    /// collapse times too few round trips to end them.
    pub(crate) fn sent(&self, now: Instant, bytes: usize) {
        if self.rate().is_some() {
            let mut pacer = self.state();
            pacer.sent(now, bytes);
            if pacer.probing {
                pacer.end_period(now, self.delivered.load(Ordering::Relaxed));
                self.rate.store(pacer.rate().unwrap_or(0), Ordering::Relaxed);
            }
        }
    }

    /// A thread starts its slice of a job, with the results it has not yet counted.
    pub(crate) fn job_started(&self, now: Instant, batch: &mut DeliveryBatch) {
        batch.hand_in(self);
        self.state().job_started(now, self.delivered.load(Ordering::Relaxed));
    }

    /// Notes that a thread found its first sending `number` (of `runs`) lost, at `now`:
    /// it sent the data again. A sending made before the rate was last lowered was lost
    /// at the rate before and counts for nothing; the others count towards the period's
    /// losses, and a run of [`OVERFLOW_RUN`] of them in a row shows a queue's overflow.
    pub(crate) fn lost(&self, now: Instant, runs: &mut LossRuns, number: u64, packet_bytes: usize) {
        let mut pacer = self.state();
        if runs.cuts_seen != pacer.cuts {
            runs.cuts_seen = pacer.cuts;
            runs.since = runs.sent + 1;
        }
        if number < runs.since {
            return;
        }
        pacer.period.lost += 1;
        if runs.lost(number)
            && pacer.overflowed(
                now,
                self.delivered.load(Ordering::Relaxed),
                self.latest_result(),
                packet_bytes,
            )
        {
            runs.overflow_taken();
            self.rate.store(pacer.rate().unwrap_or(0), Ordering::Relaxed);
        }
    }

    /// When the latest result handed in came.
    fn latest_result(&self) -> Option<Instant> {
        let first = *self.first_result.get()?;
        Some(first + Duration::from_nanos(self.latest_result.load(Ordering::Relaxed)))
    }

    /// Takes a thread's round trip, with the results it has not yet counted.
    pub(crate) fn sample(
        &self,
        now: Instant,
        rtt: Duration,
        completed_here: bool,
        batch: &mut DeliveryBatch,
    ) {
        batch.hand_in(self);
        let mut pacer = self.state();
        pacer.sample(now, rtt, self.delivered.load(Ordering::Relaxed), completed_here);
        self.rate.store(pacer.rate().unwrap_or(0), Ordering::Relaxed);
    }
}

/// Bytes of results a thread received and has not yet added to its path's count
/// ([`LinkPacer`]'s `delivered`), which the pacer measures the path's rate by. One count
/// shared by every thread of a worker and added to on every result cost the threads a
/// contended cache line per packet: 4-6 % of the client path at the dummy backend's
/// rates. So a thread hands its results in by the batch: once they reach
/// [`DELIVERY_BATCH`] bytes or the first of them is [`DELIVERY_LAG`] old, and whenever
/// the pacer reads the count for this thread (a round trip, a job's start). Another
/// thread's results reach the count at most [`DELIVERY_LAG`] late, against a decision
/// period of at least 4 ms; at slow rates every result is handed in on its own.
#[derive(Debug, Default)]
pub(crate) struct DeliveryBatch {
    bytes: u64,
    /// When the batch is handed in at the latest: [`DELIVERY_LAG`] after its first
    /// result came. Kept as a deadline, so that a result costs a comparison of instants,
    /// not a subtraction.
    due: Option<Instant>,
    /// When the batch's latest result came.
    latest: Option<Instant>,
}

/// The most bytes a thread holds back from its path's count of results.
const DELIVERY_BATCH: u64 = 64 * 1024;

/// The longest a thread holds a result back from its path's count.
const DELIVERY_LAG: Duration = Duration::from_micros(100);

impl DeliveryBatch {
    /// Counts a result of `bytes` received at `now`.
    #[inline]
    pub(crate) fn add(&mut self, pacer: &LinkPacer, now: Instant, bytes: usize) {
        self.bytes += bytes as u64;
        let due = *self.due.get_or_insert_with(|| now + DELIVERY_LAG);
        self.latest = Some(now);
        if self.bytes >= DELIVERY_BATCH || now >= due {
            self.hand_in(pacer);
        }
    }

    /// Adds what the batch holds to the path's count.
    fn hand_in(&mut self, pacer: &LinkPacer) {
        if let Some(latest) = self.latest.filter(|_| self.bytes > 0) {
            pacer.delivered.fetch_add(self.bytes, Ordering::Relaxed);
            let first = *pacer.first_result.get_or_init(|| latest);
            let after_first = latest.saturating_duration_since(first).as_nanos() as u64;
            pacer.latest_result.fetch_max(after_first, Ordering::Relaxed);
        }
        *self = DeliveryBatch::default();
    }
}

/// A thread's first sendings of data, numbered in the order they left, and the run of
/// them found lost last. A queue that overflows drops the tail of every burst offered
/// to it: a window many times the queue, sent at once, loses all but its first few
/// packets, in a row. Random loss drops packets apart. A queue too short to show delay
/// (a packet or two, less than the target) so still engages the pacer, and a worker
/// whose round trips are nearly all lost, and so seldom timed, leaves its collapse.
#[derive(Debug, Default)]
pub(crate) struct LossRuns {
    /// First sendings so far.
    sent: u64,
    /// The pacer's cuts of its rate when the thread last looked, and its first sending
    /// after the last of them: losses of earlier ones say nothing of the rate now.
    cuts_seen: u64,
    since: u64,
    /// The latest first sending found lost.
    last_lost: Option<u64>,
    /// Its run: first sendings found lost up to it, one after another.
    run: u32,
}

impl LossRuns {
    /// Numbers a first sending.
    pub(crate) fn first_sending(&mut self) -> u64 {
        self.sent += 1;
        self.sent
    }

    /// Notes that first sending `number` was found lost; true while that makes a run of
    /// at least [`OVERFLOW_RUN`] not yet taken as an overflow: the pacer takes one at most
    /// once a round trip, and one it put off shows again with the run's next loss. A
    /// sending found lost again, or after a later one, is counted already or breaks no
    /// run.
    pub(crate) fn lost(&mut self, number: u64) -> bool {
        match self.last_lost {
            Some(last) if number <= last => return false,
            Some(last) if number == last + 1 => self.run += 1,
            _ => self.run = 1,
        }
        self.last_lost = Some(number);
        self.run >= OVERFLOW_RUN
    }

    /// The pacer took the run as an overflow: a further one takes another full run.
    pub(crate) fn overflow_taken(&mut self) {
        self.run = 0;
    }
}

/// The pacing state and controller of one path.
#[derive(Debug, Clone)]
pub(crate) struct Pacer {
    config: PacingConfig,
    /// Bytes per second; `None` until a standing queue is seen.
    rate: Option<u64>,
    /// When the next paced packet may leave.
    next_send: Option<Instant>,
    /// The least round trip of the session: the path without a queue.
    min_rtt: Option<Duration>,
    period: Period,
    /// The path's rate as last measured with a queue standing on it, in bytes per second.
    capacity: Option<f64>,
    /// When the current job began, and the bytes of results received by then.
    job: Option<(Instant, u64)>,
    last_sample: Option<Instant>,
    /// A data packet waited for the pacer since the last decision: the rate, not the
    /// window or the peers, limited the worker, so it may grow.
    limited: bool,
    /// The rate was set by an overflow, and goes [`PROBE_RAISE`] above the most the path
    /// delivered until loss beyond [`PROBE_LOSS_TOLERANCE`] shows.
    probing: bool,
    /// The highest delivery rate of a probe's periods: not its seed, a guess.
    probed: f64,
    /// `capacity` was measured by loss on a path whose queue never showed delay: one too
    /// short to show it, which a raise past the capacity overflows unseen.
    lossy_capacity: bool,
    /// A standing queue above the target has set the rate this session.
    queue_shown: bool,
    /// When loss last lowered the rate, and how many times it did.
    last_cut: Option<Instant>,
    cuts: u64,
    /// Data sendings, and losses, of the periods since the share lost was last judged.
    judged: (u32, u32),
    /// The share lost that last lowered the rate, and how many cuts in a row it did not
    /// fall.
    share_cut: Option<f64>,
    stayed: u32,
}

impl Pacer {
    pub(crate) fn new(config: PacingConfig) -> Pacer {
        Pacer {
            config,
            rate: None,
            next_send: None,
            min_rtt: None,
            period: Period::default(),
            capacity: None,
            job: None,
            last_sample: None,
            limited: false,
            probing: false,
            probed: 0.0,
            lossy_capacity: false,
            queue_shown: false,
            last_cut: None,
            cuts: 0,
            judged: (0, 0),
            share_cut: None,
            stayed: 0,
        }
    }

    /// The rate set, in bytes per second; `None` while the path is not paced.
    pub(crate) fn rate(&self) -> Option<u64> {
        self.rate
    }

    /// Whether a data packet may leave at `now`. One that may not is held back, which the
    /// pacer notes: its rate limits the worker.
    pub(crate) fn allows(&mut self, now: Instant) -> bool {
        let allowed = self.ready_at().is_none_or(|due| due <= now + QUANTUM);
        self.limited |= !allowed;
        allowed
    }

    /// When the next paced packet falls due, which is when a thread holding one back
    /// should wake; `None` when any may leave at any time.
    pub(crate) fn ready_at(&self) -> Option<Instant> {
        self.rate.and(self.next_send)
    }

    /// Books a data packet of `bytes` sent at `now`.
    pub(crate) fn sent(&mut self, now: Instant, bytes: usize) {
        let Some(rate) = self.rate else {
            return;
        };
        let earliest = now.checked_sub(BURST).unwrap_or(now);
        let start = self.next_send.map_or(earliest, |at| at.max(earliest));
        self.next_send = Some(start + Duration::from_nanos(bytes as u64 * 1_000_000_000 / rate));
        self.period.sent += 1;
    }

    /// Takes a queue's overflow found at `now`, with `delivered` bytes of results received
    /// so far, the latest of them at `latest_result`, each booked as `packet_bytes`: an
    /// unpaced worker that measured its path's capacity before is paced just below it; one
    /// that did not is paced at the rate its burst's results came at ([`Pacer::seed`]) and
    /// probes from there; a paced one halves its rate. At most once a round trip: one
    /// burst's losses come to light over a round trip of timeouts. True if it took the
    /// overflow.
    pub(crate) fn overflowed(
        &mut self,
        now: Instant,
        delivered: u64,
        latest_result: Option<Instant>,
        packet_bytes: usize,
    ) -> bool {
        if !self.config.enabled {
            return false;
        }
        let round_trip = self.period.least.or(self.min_rtt).unwrap_or_default().max(MIN_PERIOD);
        if self.last_cut.is_some_and(|cut| now.saturating_duration_since(cut) < round_trip) {
            return false;
        }
        self.cut(now);
        match (self.rate, self.capacity) {
            (None, Some(capacity)) => self.set_rate(capacity * (1.0 - LOSS_TOLERANCE / 2.0)),
            (None, None) => {
                let seed = self.seed(now, delivered, latest_result, packet_bytes);
                self.set_rate(seed);
                self.probed = 0.0;
                self.probing = true;
            }
            (Some(rate), _) => {
                self.set_rate(rate as f64 / 2.0);
                self.probing = false;
            }
        }
        self.period = Period { began: Some(now), delivered, ..Period::default() };
        self.limited = false;
        true
    }

    /// The rate a probe starts at after an overflow at `now`. The packets a burst's
    /// overflow let through left the queue back to back, at the path's rate, and so did
    /// their results: the period delivered at about that rate until its latest result, and
    /// then waited for timeouts. Only a guess, which no capacity is taken from: a few
    /// results over a short span also count those a thread held back from before the
    /// period ([`DeliveryBatch`]), and a shaper's bucket passes survivors faster than its
    /// link. So the span is taken as [`MIN_PERIOD`] at least, and without [`SEED_RESULTS`]
    /// results in it the period's whole length, up to `now`, is.
    fn seed(&self, now: Instant, delivered: u64, latest_result: Option<Instant>, packet_bytes: usize) -> f64 {
        let began = self.period.began.unwrap_or(now);
        let bytes = delivered.saturating_sub(self.period.delivered);
        let results = bytes / (packet_bytes as u64).max(1);
        let until = latest_result.filter(|&latest| latest > began && results >= SEED_RESULTS).unwrap_or(now);
        bytes as f64 / until.saturating_duration_since(began).max(MIN_PERIOD).as_secs_f64()
    }

    /// Starts a decision period afresh at a job's start, with `delivered` bytes of
    /// results received so far: a period that spans the idle time between jobs would
    /// measure the caller's pause, not the path. The worker's threads start their slices
    /// one after another: a period a thread's round trip fed lately goes on.
    pub(crate) fn job_started(&mut self, now: Instant, delivered: u64) {
        if self.last_sample.is_some_and(|last| now.saturating_duration_since(last) < MIN_PERIOD) {
            return;
        }
        self.limited = false;
        self.period = Period { began: Some(now), delivered, ..Period::default() };
        self.job = Some((now, delivered));
    }

    /// Takes a round trip measured at `now` on a packet sent once, with `delivered` bytes
    /// of results received so far; `completed_here` if this worker's contribution was the
    /// last the round waited for.
    pub(crate) fn sample(&mut self, now: Instant, rtt: Duration, delivered: u64, completed_here: bool) {
        if !self.config.enabled {
            return;
        }
        let min_rtt = self.min_rtt.map_or(rtt, |least| least.min(rtt));
        self.min_rtt = Some(min_rtt);
        self.last_sample = Some(now);
        let period = &mut self.period;
        period.samples += 1;
        period.least = Some(period.least.map_or(rtt, |least| least.min(rtt)));
        if completed_here {
            period.least_completed = Some(period.least_completed.map_or(rtt, |least| least.min(rtt)));
        }
        self.end_period(now, delivered);
    }

    /// Ends the decision period at `now`, with `delivered` bytes of results received so
    /// far, if it is due: [`MIN_PERIOD`] long, and with [`SAMPLES`] round trips unless
    /// the rate probes upwards, which goes by the delivery rate alone (a collapse times
    /// few round trips).
    pub(crate) fn end_period(&mut self, now: Instant, delivered: u64) {
        let period = &mut self.period;
        let began = *period.began.get_or_insert(now);
        let elapsed = now.saturating_duration_since(began);
        let measured = if self.probing { period.sent >= PROBE_SAMPLE } else { period.samples >= SAMPLES };
        if !measured || elapsed < MIN_PERIOD {
            return;
        }
        let min_rtt = self.min_rtt.unwrap_or_default();
        let ended =
            std::mem::replace(&mut self.period, Period { began: Some(now), delivered, ..Period::default() });
        let limited = std::mem::take(&mut self.limited);
        let delivery = delivered.saturating_sub(ended.delivered) as f64 / elapsed.as_secs_f64();
        // A zero target (set through the library, which the config refuses) is a tiny one.
        let target = self.config.target.as_secs_f64().max(1e-6);
        let standing = |least: Duration| least.saturating_sub(min_rtt).as_secs_f64();
        let (sent, lost) = self.judged;
        // Losses of unpaced periods count too (only paced sendings do): a path the delay
        // rule paces then meets its first judgment with a share of its whole past, which
        // the shallow-queue test in tests/paths.rs relies on to cut early; judged only
        // over paced periods, its second job at 50 Mbit/s dropped 945 packets. Saturating:
        // an unpaced session never resets these.
        self.judged = (sent.saturating_add(ended.sent), lost.saturating_add(ended.lost));
        if let Some(rate) = self.rate.filter(|_| self.judged.0 >= LOSS_SAMPLE) {
            let (sent, lost) = std::mem::take(&mut self.judged);
            let lost = lost as f64 / sent as f64;
            let share_cut = self.share_cut.take();
            let stayed = std::mem::take(&mut self.stayed);
            if lost > LOSS_TOLERANCE && share_cut.is_some_and(|share| lost >= share) && stayed >= 1 {
                // The rate fell and the share lost did not: the loss is not a queue's but
                // the path's, at any rate. Unpaced, the window governs again, as on any
                // lossy path; a queue's overflow would engage the pacer anew.
                self.rate = None;
                self.probing = false;
                return;
            }
            if lost > LOSS_TOLERANCE {
                // A queue too short to show delay dropped what exceeded the path: it carried
                // what was not lost (at most halving the rate, as losses found in this
                // period may have left in the last).
                let carried = rate as f64 * (1.0 - lost.min(0.5));
                self.capacity = Some(carried);
                self.lossy_capacity = !self.queue_shown;
                self.probing = false;
                self.cut(now);
                self.stayed = if share_cut.is_some_and(|share| lost >= share) { stayed + 1 } else { 0 };
                self.share_cut = Some(lost);
                self.set_rate(carried * (1.0 - LOSS_TOLERANCE / 2.0));
                return;
            }
        }
        if self.probing {
            // Engaged by an overflow, at a guess: whoever completed the rounds (every worker
            // of a collapse engaged alike), go by what the path delivered until more than
            // random loss shows. Random loss puts a loss or two in most periods of a fast
            // link: growing only in periods without any stalled it near the collapse.
            let tolerated = f64::from(ended.lost) <= PROBE_LOSS_TOLERANCE * f64::from(ended.sent);
            if !limited {
                return;
            }
            // Never beyond what the path delivered in a probing period: results of a
            // sending past the path's rate come to light as lost only a timeout later, and
            // the seed the probe started at was a guess.
            self.probed = self.probed.max(delivery);
            if tolerated {
                self.set_rate(self.probed * (1.0 + PROBE_RAISE));
            } else {
                // Sendings at a probing rate lost beyond random loss: the rate passed the
                // path's, which delivered at most what it carries.
                self.probing = false;
                self.capacity = Some(self.probed);
                self.lossy_capacity = !self.queue_shown;
                self.set_rate(self.probed * (1.0 - LOSS_TOLERANCE / 2.0));
            }
            return;
        }
        match ended.least_completed {
            // A queue that holds the window costs delay, not throughput: only one that
            // overflows, losing packets, engages an unpaced worker.
            _ if self.rate.is_none() && ended.lost == 0 => {}
            Some(least) if standing(least) > target => {
                // A queue on this worker's own path held its rounds up: drain it within
                // about a period like this one, SAMPLES round trips of at least `least`
                // each, which exceeds the excess, so this is above 1 - 1/SAMPLES.
                let horizon = elapsed.as_secs_f64().max(SAMPLES as f64 * least.as_secs_f64());
                let drain = 1.0 - (standing(least) - target) / horizon;
                // A stall in the period (a loss recovered by a timeout) lowers the delivery
                // rate measured, but is no measure of the path: at most halve the rate.
                let base = self.rate.map_or(delivery, |rate| delivery.clamp(rate as f64 / 2.0, rate as f64));
                self.set_rate(base * drain);
                // With a queue standing the whole period, the link was never idle: what it
                // delivered is its rate, which no shaper's burst inflates.
                self.capacity = Some(delivery.max(base));
                self.lossy_capacity = false;
                self.queue_shown = true;
            }
            Some(least) => {
                // This worker's path set the pace, with no queue on it: a rate that held
                // sends back may grow, by less the closer the queue is to the target.
                let Some(rate) = self.rate.filter(|_| limited) else {
                    return;
                };
                // Never far beyond what the path delivered, nor beyond its rate as last
                // measured: a shaper's bucket (tbf's burst) passes an excess unqueued until
                // it empties, so raises could compound far beyond the path before a queue
                // showed. Probing past that measure goes slower, for a path that got faster.
                let raise = 1.0 + MAX_RAISE * (1.0 - standing(least) / target);
                let measured = self.capacity.unwrap_or(f64::INFINITY);
                let raised = rate as f64 * raise;
                if self.lossy_capacity {
                    // Loss measured the path, behind a queue too short to show delay: a
                    // raise past it goes unseen until the losses it causes, so the rate
                    // stays below it, and the measure creeps up for a path that got faster.
                    let ceiling = measured * (1.0 - LOSS_TOLERANCE / 2.0);
                    if raised > ceiling {
                        self.capacity = Some(measured * (1.0 + LOSSY_CREEP));
                    }
                    self.set_rate(raised.min(ceiling).max(rate as f64));
                    return;
                }
                if raised > measured * (1.0 + MAX_RAISE) {
                    self.capacity = Some(measured * (1.0 + MAX_RAISE / 2.0));
                }
                let ceiling = delivery.min(measured) * (1.0 + MAX_RAISE);
                self.set_rate(raised.min(ceiling).max(rate as f64));
            }
            None => {
                // The rounds waited on peers: sending faster than they complete would only
                // queue this worker's packets on its own path. Pace at that rate, and no
                // slower: the worker that holds the rounds up is the one to slow down.
                // Nor below the path's measured rate, nor below the rate of the job so
                // far, nor below half the rate at once: a period in which the rounds
                // stalled (a peer's loss recovery, a peer descheduled) delivers next to
                // nothing, and pacing at that would stall this worker in turn. (A period that did not wait, the tail of a job say,
                // measures the work left, not the path, and changes nothing.)
                let waited = ended.least.map_or(0.0, standing);
                let this_job = self.job.map_or(0.0, |(began, before)| {
                    let elapsed = now.saturating_duration_since(began).as_secs_f64().max(1e-9);
                    delivered.saturating_sub(before) as f64 / elapsed
                });
                let ceiling = delivery.max(this_job).max(self.capacity.unwrap_or(0.0));
                if waited > target && self.rate.is_none_or(|rate| rate as f64 > ceiling) {
                    self.set_rate(ceiling.max(self.rate.map_or(0.0, |rate| rate as f64 / 2.0)));
                }
            }
        }
    }

    /// Books a cut of the rate for loss at `now`.
    fn cut(&mut self, now: Instant) {
        self.last_cut = Some(now);
        self.cuts += 1;
        self.judged = (0, 0);
    }

    /// Sets the rate, never below half the path's measured rate: no single period's
    /// figures, however odd, may pace a worker to a standstill.
    fn set_rate(&mut self, rate: f64) {
        let floor = self.capacity.map_or(0.0, |capacity| capacity / 2.0);
        self.rate = Some((rate.max(floor) as u64).max(MIN_RATE));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A target of 1 ms, for round figures.
    const CONFIG: PacingConfig = PacingConfig { enabled: true, target: MS };

    /// The bytes a data packet and its result are booked as.
    const PACKET: usize = 100;

    /// A path as a pacer sees it: a clock, and the results delivered so far.
    struct Path {
        pacer: Pacer,
        now: Instant,
        delivered: u64,
        /// Whether this worker's contributions complete the rounds timed.
        completing: bool,
    }

    impl Path {
        fn new(config: PacingConfig) -> Path {
            let now = Instant::now();
            let mut pacer = Pacer::new(config);
            pacer.job_started(now, 0);
            Path { pacer, now, delivered: 0, completing: true }
        }

        /// Round trips of `rtts` one after another, with results arriving at `rate`
        /// bytes per second.
        fn round_trips(&mut self, rtts: &[Duration], rate: u64) -> &mut Path {
            for &rtt in rtts {
                self.now += rtt;
                self.delivered += (rate as f64 * rtt.as_secs_f64()) as u64;
                self.pacer.sample(self.now, rtt, self.delivered, self.completing);
            }
            self
        }

        /// One decision period of round trips of `rtt`, at `rate`.
        fn period(&mut self, rtt: Duration, rate: u64) -> &mut Path {
            let count = (MIN_PERIOD.as_nanos().div_ceil(rtt.as_nanos()) as u32).max(SAMPLES);
            self.round_trips(&vec![rtt; count as usize], rate)
        }

        /// A period of 100 µs round trips, then one of `rtt` ones, at `rate`, in which the
        /// queue overflowed: the worker sent data again.
        fn queue(&mut self, rtt: Duration, rate: u64) -> &mut Path {
            self.period(MS / 10, rate);
            self.pacer.period.lost = 1;
            self.period(rtt, rate)
        }

        fn rate(&self) -> Option<u64> {
            self.pacer.rate()
        }

        /// Sends what the pacer lets through now, so that it holds the next back.
        fn fill(&mut self) -> &mut Path {
            assert!(self.pacer.rate().is_some(), "an unpaced path lets everything through");
            while self.pacer.allows(self.now) {
                self.pacer.sent(self.now, 100_000);
            }
            self
        }
    }

    /// Within a thousandth of `expected`.
    fn near(rate: Option<u64>, expected: f64) -> bool {
        rate.is_some_and(|rate| (rate as f64 / expected - 1.0).abs() < 1e-3)
    }

    #[test]
    fn a_path_without_a_standing_queue_is_not_paced() {
        let mut path = Path::new(CONFIG);
        // Round trips of 100 µs, some lengthened by a late peer or a loss.
        let mut rtts = vec![MS / 10; 200];
        for long in [3, 50, 51, 120] {
            rtts[long] = MS * 12;
        }
        path.round_trips(&rtts, 10_000_000);
        // Queues shorter than the target.
        path.round_trips(&[MS * 9 / 10; 100], 10_000_000);
        assert_eq!(path.rate(), None);
        assert!(path.pacer.allows(Instant::now()));
    }

    #[test]
    fn a_queue_that_holds_the_window_does_not_engage_the_pacer() {
        // 10 ms of standing queue, but nothing lost: the queue holds the window.
        let mut path = Path::new(CONFIG);
        path.period(MS / 10, 10_000_000).period(MS * 10, 10_000_000).period(MS * 10, 10_000_000);
        assert_eq!(path.rate(), None);
        // A loss in a period with the queue standing engages it.
        path.pacer.period.lost = 1;
        path.period(MS * 10, 10_000_000);
        assert!(path.rate().is_some());
    }

    #[test]
    fn a_standing_queue_on_its_own_path_sets_the_rate_below_the_delivery_rate() {
        // 5.1 ms round trips (5 ms of queue) at 10 MB/s.
        let mut path = Path::new(CONFIG);
        path.queue(MS * 51 / 10, 10_000_000);
        // The excess of 4 ms drains over 4 round trips of 5.1 ms: 0.80 of the delivery
        // rate.
        let drain = 1.0 - 4.0 / (4.0 * 5.1);
        assert!(near(path.rate(), 10e6 * drain), "{:?}", path.rate());
        // However long the queue, never below three quarters.
        let mut path = Path::new(CONFIG);
        path.queue(MS * 1000, 10_000_000);
        assert!(path.rate().is_some_and(|rate| (7_500_000..7_510_000).contains(&rate)));
    }

    #[test]
    fn a_limited_rate_grows_while_the_queue_stays_below_the_target() {
        let mut path = Path::new(CONFIG);
        path.queue(MS * 10, 10_000_000);
        let engaged = path.rate().unwrap() as f64;
        // Not held back: the rate stays.
        path.period(MS / 10, engaged as u64);
        assert!(near(path.rate(), engaged));
        // Held back, with no queue: an eighth more.
        path.fill().period(MS / 10, engaged as u64);
        assert!(near(path.rate(), engaged * 1.125), "{:?}", path.rate());
        // Held back, with half the target queued: a sixteenth more.
        path.fill().period(MS * 6 / 10, (engaged * 1.125) as u64);
        assert!(near(path.rate(), engaged * 1.125 * 1.0625), "{:?}", path.rate());
    }

    #[test]
    fn a_raise_stays_near_the_delivery_rate_and_never_lowers_the_rate() {
        let mut path = Path::new(CONFIG);
        path.queue(MS * 10, 10_000_000);
        let engaged = path.rate().unwrap() as f64;
        // Held back, but the path delivered only 0.95 of the rate: an eighth beyond that.
        path.fill().period(MS / 10, (engaged * 0.95) as u64);
        assert!(near(path.rate(), engaged * 0.95 * 1.125), "{:?}", path.rate());
        // A period that delivered little (a stall) does not lower it.
        let raised = path.rate().unwrap() as f64;
        path.fill().period(MS / 10, 1_000);
        assert!(near(path.rate(), raised), "{:?}", path.rate());
    }

    #[test]
    fn raises_beyond_the_measured_rate_probe_slowly() {
        // Measured at 10 MB/s with a queue standing; then, however fast a shaper's
        // bucket lets the results through, the rate stops an eighth above that...
        let mut path = Path::new(CONFIG);
        path.queue(MS * 10, 10_000_000);
        for _ in 0..4 {
            path.fill().period(MS / 10, 100_000_000);
        }
        assert!(near(path.rate(), 11.25e6), "{:?}", path.rate());
        // ...and each further period raises that ceiling by a sixteenth.
        for _ in 0..8 {
            path.fill().period(MS / 10, 100_000_000);
        }
        let rate = path.rate().unwrap() as f64;
        assert!(near(Some(rate as u64), 11.25e6 * 1.0625f64.powi(8)), "{rate}");
    }

    #[test]
    fn a_queue_on_a_peer_s_path_caps_the_rate_at_the_rounds_and_no_lower() {
        // Rounds completed by peers, which wait 5 ms: pace at the rate they complete at.
        let mut path = Path::new(CONFIG);
        path.completing = false;
        path.queue(MS * 51 / 10, 4_000_000);
        assert!(near(path.rate(), 4e6), "{:?}", path.rate());
        // No queue: unchanged.
        path.period(MS / 10, 2_000_000);
        assert!(near(path.rate(), 4e6), "{:?}", path.rate());
        // A period of little delivered: no lower than the job's rate so far (2.16 MB/s),
        // nor than half.
        path.period(MS * 51 / 10, 1_000);
        let job = path.delivered as f64 / 0.0488;
        assert!(near(path.rate(), job), "{:?} against {job}", path.rate());

        // A path measured at 10 MB/s, with the rounds then stalled on a peer: never
        // below that, however little a period delivers.
        let mut path = Path::new(CONFIG);
        path.queue(MS * 10, 10_000_000);
        path.completing = false;
        for _ in 0..10 {
            path.period(MS * 20, 1_000);
        }
        assert!(path.rate().is_some_and(|rate| rate >= 5_000_000), "{:?}", path.rate());
    }

    #[test]
    fn sends_are_spaced_at_the_rate_in_quanta_with_a_bounded_burst() {
        let mut path = Path::new(CONFIG);
        path.queue(MS * 10, 100_000_000);
        let pacer = &mut path.pacer;
        let rate = pacer.rate().unwrap() as f64;
        let start = Instant::now() + Duration::from_secs(1);
        // After an idle spell, BURST's and a QUANTUM's worth go at once.
        let packet = 1_000;
        let mut sent = 0;
        while pacer.allows(start) {
            pacer.sent(start, packet);
            sent += 1;
        }
        let burst = ((BURST + QUANTUM).as_secs_f64() * rate / packet as f64).ceil() as usize;
        assert_eq!(sent, burst);
        // Then a quantum's worth at each wake-up.
        let next = pacer.ready_at().unwrap();
        assert!(next > start + QUANTUM && next <= start + QUANTUM * 11 / 10, "{:?}", next - start);
        let mut sent = 0;
        while pacer.allows(next) {
            pacer.sent(next, packet);
            sent += 1;
        }
        let quantum = QUANTUM.as_secs_f64() * rate / packet as f64;
        assert!((sent as f64 - quantum).abs() <= 1.0, "{sent} against {quantum}");
    }

    #[test]
    fn the_rate_never_falls_below_the_floor() {
        let mut path = Path::new(CONFIG);
        path.queue(MS * 500, 0);
        for _ in 0..10 {
            path.period(MS * 500, 0);
        }
        assert_eq!(path.rate(), Some(MIN_RATE));
    }

    #[test]
    fn disabled_pacing_never_paces() {
        let mut path = Path::new(PacingConfig { enabled: false, ..CONFIG });
        path.queue(MS * 10, 10_000_000);
        assert_eq!(path.rate(), None);
    }

    #[test]
    fn only_a_run_of_first_sendings_lost_in_a_row_shows_an_overflow() {
        let mut runs = LossRuns::default();
        // Every other sending lost, as random loss might: never a run.
        assert!(!(2..200).step_by(2).any(|number| runs.lost(number)));
        // One short of a run, then one found again or out of order: no run yet.
        let run = OVERFLOW_RUN as u64;
        assert!(!(300..300 + run - 1).any(|number| runs.lost(number)));
        assert!(!runs.lost(300 + run - 2) && !runs.lost(310));
        // The last of the run shows it, and every further loss of the run until the pacer
        // takes it; then another full run is needed.
        assert!(runs.lost(300 + run - 1) && runs.lost(300 + run));
        runs.overflow_taken();
        assert!(!(300 + run + 1..300 + 2 * run).any(|number| runs.lost(number)));
        assert!(runs.lost(300 + 2 * run));
        runs.overflow_taken();
        assert!(!(300 + 2 * run + 1..300 + 3 * run).any(|number| runs.lost(number)));
        // A gap starts a new run.
        assert!(!(401..400 + run).any(|number| runs.lost(number)));
        assert!(runs.lost(400 + run));
    }

    #[test]
    fn an_overflow_paces_at_the_rate_delivered_then_halves_it_at_most_once_a_round_trip() {
        let mut path = Path::new(CONFIG);
        path.round_trips(&[MS / 2], 1_000_000);
        // 10 ms in which a collapsing path delivered 2 000 bytes: 200 kB/s.
        path.now += MS * 10;
        path.delivered += 2_000;
        let since = path.delivered - path.pacer.period.delivered;
        let elapsed = path.now - path.pacer.period.began.unwrap();
        path.pacer.overflowed(path.now, path.delivered, None, PACKET);
        assert!(near(path.rate(), since as f64 / elapsed.as_secs_f64()), "{:?}", path.rate());
        assert!(path.pacer.probing);
        let engaged = path.rate().unwrap() as f64;
        // Another within the period's least, 4 ms: the same burst's losses.
        path.pacer.overflowed(path.now + MS * 3, path.delivered, None, PACKET);
        assert!(near(path.rate(), engaged));
        path.pacer.overflowed(path.now + MS * 5, path.delivered, None, PACKET);
        assert!(near(path.rate(), engaged / 2.0), "{:?}", path.rate());
        assert!(!path.pacer.probing);
    }

    /// One probing period: sent enough to be judged, `lost` of them lost, delivering at
    /// `rate`.
    fn probe_period(path: &mut Path, lost: u32, rate: u64) {
        path.fill();
        path.pacer.period.sent = PROBE_SAMPLE;
        path.pacer.period.lost = lost;
        path.period(MS, rate);
    }

    #[test]
    fn an_overflow_paces_at_the_rate_its_burst_was_delivered_at() {
        // The burst's survivors came back within 5 ms, 10 000 bytes of them: 2 MB/s,
        // although the 20 ms up to the overflow delivered only 500 kB/s.
        let overflow = |latest_after: Duration, bytes: u64| {
            let mut path = Path::new(CONFIG);
            let began = path.now;
            path.now += MS * 20;
            path.delivered += bytes;
            assert!(path.pacer.overflowed(path.now, path.delivered, Some(began + latest_after), PACKET));
            assert!(path.pacer.probing);
            path.rate()
        };
        assert!(near(overflow(MS * 5, 10_000), 2e6), "{:?}", overflow(MS * 5, 10_000));
        // Within 1 ms: timed over 4 ms, since a short span may hold results from before
        // the period, or a shaper's burst.
        assert!(near(overflow(MS, 10_000), 2.5e6), "{:?}", overflow(MS, 10_000));
        // Fewer than 8 results: the period's whole length.
        assert!(near(overflow(MS * 5, 700), 3.5e4), "{:?}", overflow(MS * 5, 700));
        // Without a result in the period, the period's own rate.
        let mut path = Path::new(CONFIG);
        path.now += MS * 10;
        path.delivered += 2_000;
        path.pacer.overflowed(path.now, path.delivered, Some(path.now - MS * 20), PACKET);
        assert!(near(path.rate(), 2e5), "{:?}", path.rate());
    }

    #[test]
    fn a_probe_s_seed_never_becomes_the_capacity() {
        // A burst's results timed high: 10 MB/s over a path that carries 1 MB/s.
        let mut path = Path::new(CONFIG);
        let began = path.now;
        path.now += MS * 10;
        path.delivered += 50_000;
        path.pacer.overflowed(path.now, path.delivered, Some(began + MS * 5), PACKET);
        assert!(near(path.rate(), 1e7), "{:?}", path.rate());
        // Its first period loses beyond random loss: the capacity is what it delivered.
        probe_period(&mut path, 4, 1_000_000);
        assert!(!path.pacer.probing);
        assert!(path.pacer.capacity.is_some_and(|capacity| (capacity / 1e6 - 1.0).abs() < 0.01));
        assert!(near(path.rate(), 1e6 * 15.0 / 16.0), "{:?}", path.rate());
        // Delivered below the seed without loss (a shaper's bucket emptied): a quarter
        // above the delivery, not above the seed.
        let mut path = Path::new(CONFIG);
        let began = path.now;
        path.now += MS * 10;
        path.delivered += 50_000;
        path.pacer.overflowed(path.now, path.delivered, Some(began + MS * 5), PACKET);
        probe_period(&mut path, 0, 1_000_000);
        assert!(near(path.rate(), 1.25e6), "{:?}", path.rate());
    }

    #[test]
    fn a_probe_paces_a_quarter_above_the_most_delivered_until_loss_shows() {
        let mut path = Path::new(CONFIG);
        let began = path.now;
        path.now += MS * 10;
        path.delivered += 10_000;
        path.pacer.overflowed(path.now, path.delivered, Some(began + MS * 5), PACKET);
        // Delivered as fast as it was sent: a quarter more. Whoever completed the rounds.
        path.completing = false;
        probe_period(&mut path, 0, 2_000_000);
        assert!(near(path.rate(), 2.5e6), "{:?}", path.rate());
        probe_period(&mut path, 0, 3_000_000);
        assert!(near(path.rate(), 3.75e6), "{:?}", path.rate());
        // A rate past the path's: what it delivered, not what was sent, raises the rate,
        // since the losses show only a timeout later.
        probe_period(&mut path, 0, 3_200_000);
        probe_period(&mut path, 0, 3_200_000);
        assert!(near(path.rate(), 4e6), "{:?}", path.rate());
        // 1 in 16 lost: past random loss. The path carries what it delivered at most.
        probe_period(&mut path, 1, 3_200_000);
        assert!(!path.pacer.probing);
        assert_eq!(path.pacer.capacity, Some(3.2e6));
        assert!(near(path.rate(), 3e6), "{:?}", path.rate());
    }

    #[test]
    fn a_capacity_loss_measured_caps_raises_and_creeps_up() {
        let mut path = Path::new(CONFIG);
        path.now += MS * 10;
        path.delivered += 2_000;
        path.pacer.overflowed(path.now, path.delivered, None, PACKET);
        probe_period(&mut path, 8, 200_000);
        let capacity = path.pacer.capacity.unwrap();
        assert!(path.pacer.lossy_capacity && near(path.rate(), capacity * 15.0 / 16.0));
        // Held back, no queue, all delivered: no raise past the capacity, which creeps up
        // by a sixty-fourth a period.
        for period in 1..=4 {
            let rate = path.rate().unwrap();
            path.fill().period(MS / 10, rate);
            let crept = capacity * (1.0 + LOSSY_CREEP).powi(period);
            assert!(near(path.rate(), crept / (1.0 + LOSSY_CREEP) * 15.0 / 16.0), "{:?}", path.rate());
            assert!((path.pacer.capacity.unwrap() / crept - 1.0).abs() < 1e-9);
        }
        // Unpaced (by the share rule, say), a further overflow paces it at once below the
        // capacity, without a probe.
        path.pacer.rate = None;
        path.now += MS * 10;
        path.pacer.overflowed(path.now, path.delivered, None, PACKET);
        let capacity = path.pacer.capacity.unwrap();
        assert!(near(path.rate(), capacity * 15.0 / 16.0) && !path.pacer.probing, "{:?}", path.rate());
    }

    #[test]
    fn a_rate_an_overflow_set_recovers_on_a_fast_link_with_random_loss() {
        // A 64-packet outage on a 10 MB/s link engages the pacer at what the collapse
        // delivered, 200 kB/s; then 1 % of the sendings are lost in every period.
        let mut path = Path::new(CONFIG);
        path.now += MS * 10;
        path.delivered += 2_000;
        let mut runs = LossRuns::default();
        let outage: Vec<u64> = (0..64).map(|_| runs.first_sending()).collect();
        assert!(outage.into_iter().any(|number| runs.lost(number)));
        path.pacer.overflowed(path.now, path.delivered, None, PACKET);
        let engaged = path.rate().unwrap();
        for _ in 0..20 {
            let rate = path.rate().unwrap().min(10_000_000);
            path.fill();
            path.pacer.period.sent = 200;
            path.pacer.period.lost = 2;
            path.period(MS, rate);
        }
        assert!(path.rate().is_some_and(|rate| rate >= 10_000_000), "{:?} from {engaged}", path.rate());
    }

    #[test]
    fn a_paced_worker_losing_more_than_it_tolerates_paces_below_what_was_carried() {
        let mut path = Path::new(CONFIG);
        path.queue(MS * 10, 1_000_000);
        let paced = path.rate().unwrap() as f64;
        // 64 sendings, 4 of them lost (6 %): tolerated.
        path.pacer.period.sent = LOSS_SAMPLE;
        path.pacer.period.lost = 4;
        path.period(MS, 1_000_000);
        assert!(path.rate().is_some_and(|rate| rate as f64 >= paced), "{:?}", path.rate());
        let paced = path.rate().unwrap() as f64;
        // 64 sendings over two periods, 16 lost (25 %): the path carried three quarters.
        for _ in 0..2 {
            path.pacer.period.sent = LOSS_SAMPLE / 2;
            path.pacer.period.lost = 8;
            path.period(MS, 1_000_000);
        }
        let carried = paced * 0.75;
        assert!(near(path.rate(), carried * (1.0 - LOSS_TOLERANCE / 2.0)), "{:?}", path.rate());
        assert_eq!(path.pacer.capacity, Some(carried));
        // Loss that falls with the rate was the queue's: below the tolerance, the rate
        // stays; above it again, it is cut again.
        let mut cut_again = path.pacer.clone();
        for (pacer, lost) in [(&mut path.pacer, 4), (&mut cut_again, 12)] {
            pacer.period.sent = LOSS_SAMPLE;
            pacer.period.lost = lost;
        }
        let rate = path.rate();
        path.period(MS, 1_000_000);
        assert_eq!(path.rate(), rate);
        std::mem::swap(&mut path.pacer, &mut cut_again);
        path.period(MS, 1_000_000);
        assert!(path.rate() < rate, "{:?}", path.rate());
        // Loss that stays as the rate falls, twice, is the path's, at any rate: unpaced
        // again.
        let mut rates = Vec::new();
        for _ in 0..2 {
            path.pacer.period.sent = LOSS_SAMPLE;
            path.pacer.period.lost = 12;
            path.period(MS, 1_000_000);
            rates.push(path.rate());
        }
        assert!(rates[0].is_some() && rates[1].is_none(), "{rates:?}");
    }

    /// Random loss never lines up a run of first sendings lost in a row: it leaves
    /// the worker unpaced. Losses of sendings made before a cut count for nothing after it.
    #[test]
    fn isolated_losses_never_engage_the_pacer_and_old_ones_never_count_after_a_cut() {
        let pacer = LinkPacer::new(CONFIG);
        let mut runs = LossRuns::default();
        let now = Instant::now();
        let mut batch = DeliveryBatch::default();
        pacer.job_started(now, &mut batch);
        for sending in 0..1000 {
            let number = runs.first_sending();
            if sending % 3 != 0 {
                pacer.lost(now, &mut runs, number, PACKET);
            }
        }
        assert_eq!(pacer.rate(), None);
        let first = runs.first_sending();
        let numbers: Vec<u64> = (0..OVERFLOW_RUN).map(|_| runs.first_sending()).collect();
        for &number in &numbers {
            pacer.lost(now + MS, &mut runs, number, PACKET);
        }
        assert!(pacer.rate().is_some(), "a run of {OVERFLOW_RUN} engages it");
        let counted = pacer.state().period.lost;
        pacer.lost(now + MS * 2, &mut runs, first, PACKET);
        assert_eq!(pacer.state().period.lost, counted, "a sending from before the cut");
        let after = runs.first_sending();
        pacer.lost(now + MS * 2, &mut runs, after, PACKET);
        assert_eq!(pacer.state().period.lost, counted + 1);
    }

    /// Another thread's run that completes within a round trip of a cut is put off, not
    /// lost: its next loss after the round trip takes it.
    #[test]
    fn an_overflow_put_off_by_a_recent_cut_is_taken_with_the_run_s_next_loss() {
        let pacer = LinkPacer::new(CONFIG);
        let start = Instant::now();
        let mut batch = DeliveryBatch::default();
        pacer.job_started(start, &mut batch);
        // 100 kB delivered in 10 ms: 10 MB/s.
        let now = start + MS * 10;
        batch.add(&pacer, now, 100_000);
        let (mut first, mut second) = (LossRuns::default(), LossRuns::default());
        let lose_run = |runs: &mut LossRuns, count: u32, at: Instant| {
            let numbers: Vec<u64> = (0..count).map(|_| runs.first_sending()).collect();
            numbers.into_iter().for_each(|number| pacer.lost(at, runs, number, PACKET));
        };
        let before_the_cut = second.first_sending();
        lose_run(&mut first, OVERFLOW_RUN, now);
        let engaged = pacer.rate().expect("a run of OVERFLOW_RUN engages the pacer");
        // The second thread learns of the cut; its later sendings count.
        pacer.lost(now + MS, &mut second, before_the_cut, PACKET);
        lose_run(&mut second, OVERFLOW_RUN, now + MS);
        assert_eq!(pacer.rate(), Some(engaged), "within a round trip of the cut");
        lose_run(&mut second, 1, now + MIN_PERIOD * 2);
        assert!(engaged > 2 * MIN_RATE, "{engaged}");
        assert_eq!(pacer.rate(), Some(engaged / 2));
        // Taken, the run starts afresh.
        lose_run(&mut second, OVERFLOW_RUN - 1, now + MIN_PERIOD * 4);
        assert_eq!(pacer.rate(), Some(engaged / 2));
    }

    /// A thread's results reach the path's count by the batch: at 64 KiB, once the first
    /// is 100 µs old, and whenever the pacer reads the count for the thread; and a path
    /// that is not paced books no sending.
    #[test]
    fn results_reach_the_path_s_count_by_the_batch_and_at_every_reading() {
        let pacer = LinkPacer::new(CONFIG);
        let count = |pacer: &LinkPacer| pacer.delivered.load(Ordering::Relaxed);
        let start = Instant::now();
        let mut batch = DeliveryBatch::default();
        for _ in 0..63 {
            batch.add(&pacer, start, 1024);
        }
        assert_eq!(count(&pacer), 0, "63 KiB within the lag stay with the thread");
        batch.add(&pacer, start, 1024);
        assert_eq!(count(&pacer), 64 * 1024, "the 64th KiB hands the batch in");
        batch.add(&pacer, start + MS, 100);
        assert_eq!(count(&pacer), 64 * 1024);
        batch.add(&pacer, start + MS + DELIVERY_LAG, 100);
        assert_eq!(count(&pacer), 64 * 1024 + 200, "a batch as old as the lag is handed in");
        batch.add(&pacer, start + 2 * MS, 300);
        pacer.sample(start + 2 * MS, MS, true, &mut batch);
        assert_eq!(count(&pacer), 64 * 1024 + 500, "a round trip reads the thread's results");
        batch.add(&pacer, start + 3 * MS, 400);
        pacer.job_started(start + 3 * MS, &mut batch);
        assert_eq!(count(&pacer), 64 * 1024 + 900, "so does a job's start");
        pacer.sent(start + 3 * MS, 1000);
        assert_eq!(pacer.state().next_send, None, "an unpaced path books no sending");
    }
}
