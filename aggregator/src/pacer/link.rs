//! The pacer one worker's threads share, and the results they hand in to it by the batch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use super::rules::Delivered;
use super::{LossRuns, Pacer, PacingConfig};

/// The pacer of one worker's path, shared by the worker's threads: they send over the
/// same link, so one rate and one schedule cover them all, each thread taking its packets'
/// turns from it. Paced separately, threads would share the link unevenly, and a job
/// ends only when its slowest thread does.
#[derive(Debug)]
pub struct LinkPacer {
    /// The rate in bytes per second, 0 while unpaced: read on every send without the lock.
    /// A line of its own: the counts below change with every batch of results a thread
    /// hands in, and sharing their line would cost every other thread's send a miss.
    pub(super) rate: CachePadded<AtomicU64>,
    /// Bytes of results the threads received, and how many results.
    pub(super) delivered: AtomicU64,
    results: AtomicU64,
    /// When the latest of them came, in nanoseconds after the first: the end of the span
    /// they were delivered in, which an overflow measures the path's rate by.
    latest_result: AtomicU64,
    first_result: OnceLock<Instant>,
    state: Mutex<Pacer>,
}

impl LinkPacer {
    pub fn new(config: PacingConfig) -> Arc<LinkPacer> {
        Arc::new(LinkPacer {
            rate: CachePadded::new(AtomicU64::new(0)),
            delivered: AtomicU64::new(0),
            results: AtomicU64::new(0),
            latest_result: AtomicU64::new(0),
            first_result: OnceLock::new(),
            state: Mutex::new(Pacer::new(config)),
        })
    }

    /// The rate set, in bytes per second; `None` while the path is not paced.
    #[inline]
    pub fn rate(&self) -> Option<u64> {
        Some(self.rate.load(Ordering::Relaxed)).filter(|&rate| rate > 0)
    }

    /// Whether a measured rate paces the path ([`Pacer::measured`]), whose queue is too
    /// short to show delay: a thread then paces the rounds it only waits for too
    /// (`worker::PacedTurn::Silent`). A rate the standing delay set paces sendings
    /// alone: a queue that shows delay holds the results' bursts, and there a turn for
    /// each silent round only slowed a sparse cluster losing 15 % each way, paced by its
    /// peers' waits (`tests/properties.rs`: 2.2 s against its bound of 2).
    pub(crate) fn paces_rounds(&self) -> bool {
        self.rate().is_some() && self.state().measured
    }

    /// The state; a thread that panicked holding it left it whole (every update is a
    /// few assignments), so a poisoned lock is taken as it is.
    pub(super) fn state(&self) -> MutexGuard<'_, Pacer> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn allows(&self, now: Instant) -> bool {
        self.state().allows(now)
    }

    pub(crate) fn ready_at(&self) -> Option<Instant> {
        self.state().ready_at()
    }

    /// Books a data packet sent; nothing to book, and no lock to take, while the path is
    /// not paced (every data packet comes here). A measured pacer's periods end here
    /// too: a collapse times too few round trips to end them.
    // Inlined, so that an unpaced path's packets cost a load and a test, not a call.
    #[inline]
    pub(crate) fn sent(&self, now: Instant, bytes: usize) {
        if self.rate().is_some() {
            self.book_sent(now, bytes);
        }
    }

    /// [`LinkPacer::sent`] on a paced path.
    fn book_sent(&self, now: Instant, bytes: usize) {
        let booked = self.result_len(bytes);
        let mut pacer = self.state();
        pacer.sent(now, booked);
        if pacer.measured {
            pacer.end_period(now, self.delivered());
            self.rate.store(pacer.rate().unwrap_or(0), Ordering::Relaxed);
        }
    }

    /// When a slot's timer, due at `deadline` after `timeout`, fires: spread at the rate
    /// the path's results come at while a measured rate paces it ([`Pacer::retry_at`]), a
    /// data packet being `packet_bytes`; at `deadline` otherwise. Every armed timer comes
    /// here: unpaced, it costs a load of the rate, which every send reads too.
    #[inline]
    pub(crate) fn retry_at(&self, deadline: Instant, timeout: Duration, packet_bytes: usize) -> Instant {
        if self.rate().is_none() {
            return deadline;
        }
        let booked = self.result_len(packet_bytes);
        self.state().retry_at(deadline, timeout, booked)
    }

    /// The bytes a data packet of `packet_bytes` is booked at: the mean size of the
    /// results received, since a sending draws a result, and a path's results, not its
    /// sendings, are what the delivery rate measures. A sparse stream's contribution may
    /// be a bare header while its result, the union of every worker's blocks, is full,
    /// and other results are short: booked at its own size, a sending would let results
    /// through faster than the rate, and booked as a full packet, a rate measured in
    /// results' bytes would send fewer than the path carries. A full packet until a
    /// result has come.
    fn result_len(&self, packet_bytes: usize) -> usize {
        let results = self.results.load(Ordering::Relaxed);
        match self.delivered.load(Ordering::Relaxed).checked_div(results) {
            Some(mean) => mean as usize,
            None => packet_bytes,
        }
    }

    /// A thread starts its slice of a job, with the results it has not yet counted.
    pub(crate) fn job_started(&self, now: Instant, batch: &mut DeliveryBatch) {
        batch.hand_in(self);
        self.state().job_started(now, self.delivered());
    }

    /// Notes that a thread found its first sending `number` (of `runs`) lost, at `now`:
    /// it sent the data again. A sending made before the rate was last lowered was lost
    /// at the rate before and counts for nothing; the others count towards the period's
    /// losses, and a run of [`OVERFLOW_RUN`](super::OVERFLOW_RUN) of them in a row shows a
    /// queue's overflow.
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
        if runs.lost(number) && pacer.overflowed(now, self.delivered(), self.latest_result(), packet_bytes) {
            runs.overflow_taken();
            self.rate.store(pacer.rate().unwrap_or(0), Ordering::Relaxed);
        }
    }

    /// The results handed in so far.
    fn delivered(&self) -> Delivered {
        Delivered {
            bytes: self.delivered.load(Ordering::Relaxed),
            results: self.results.load(Ordering::Relaxed),
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
        pacer.sample(now, rtt, self.delivered(), completed_here);
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
    results: u64,
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
pub(super) const DELIVERY_LAG: Duration = Duration::from_micros(100);

impl DeliveryBatch {
    /// Counts a result of `bytes` received at `now`.
    #[inline]
    pub(crate) fn add(&mut self, pacer: &LinkPacer, now: Instant, bytes: usize) {
        self.bytes += bytes as u64;
        self.results += 1;
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
            pacer.results.fetch_add(self.results, Ordering::Relaxed);
            let first = *pacer.first_result.get_or_init(|| latest);
            let after_first = latest.saturating_duration_since(first).as_nanos() as u64;
            pacer.latest_result.fetch_max(after_first, Ordering::Relaxed);
        }
        *self = DeliveryBatch::default();
    }
}
