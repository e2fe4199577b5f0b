//! The rules that set one path's rate: the standing delay, overflows, probes and the
//! share lost.

use std::time::{Duration, Instant};

use super::{
    PacingConfig, BURST, DELIVERY_WINDOW, LOSSY_CREEP, LOSSY_PATH_CUTS, LOSS_SAMPLE, LOSS_TOLERANCE,
    MAX_RAISE, MEASURE_SENDINGS, MIN_PERIOD, MIN_RATE, PACING_GAINS, QUANTUM, SAMPLES, STARTUP_FLAT,
    STARTUP_GAIN, STARTUP_GROWTH,
};

/// The results a worker's threads received so far: their bytes, and how many.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Delivered {
    pub(crate) bytes: u64,
    pub(crate) results: u64,
}

/// The round trips since the last decision.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Period {
    /// When it began; `None` before the first sample of a session.
    pub(super) began: Option<Instant>,
    /// Results received when it began.
    pub(super) delivered: Delivered,
    pub(super) samples: u32,
    /// The least round trip in it.
    pub(super) least: Option<Duration>,
    /// The least round trip of the rounds this worker's contribution completed: its own
    /// path's.
    pub(super) least_completed: Option<Duration>,
    /// Data packets sent while paced.
    pub(super) sent: u32,
    /// Data packets sent again: a packet of the worker's was lost, or its result was.
    pub(super) lost: u32,
}

/// The delivery rates of a measured pacer's latest periods, and where it stands in
/// finding the path's rate, as a model-based congestion controller (BBR) does: the most
/// delivered over a window of periods is the path's rate, since a period can deliver
/// less than the path (a stall, a peer's loss recovery, nothing left to send) but not
/// more. It starts up at [`STARTUP_GAIN`] times the measure until the measure stops
/// growing, then cycles through [`PACING_GAINS`].
#[derive(Debug, Clone, Default)]
pub(super) struct Delivery {
    /// The latest periods' delivery rates in bytes per second, oldest overwritten first.
    rates: [f64; DELIVERY_WINDOW],
    /// Periods measured; the next one's place in `rates` is this modulo their length.
    periods: usize,
    /// Starting up: the most delivered so far, and periods in a row that did not raise
    /// it by [`STARTUP_GROWTH`].
    pub(super) startup: Option<(f64, u32)>,
}

impl Delivery {
    /// Starts up from `seed` bytes per second.
    fn start(&mut self, seed: f64) {
        *self = Delivery { startup: Some((seed, 0)), ..Delivery::default() };
        self.rates[0] = seed;
        self.periods = 1;
    }

    /// The path's rate: the most the window's periods delivered.
    pub(super) fn rate(&self) -> f64 {
        self.rates.iter().copied().fold(0.0, f64::max)
    }

    /// The rate to pace at, as a multiple of the path's: see [`PACING_GAINS`].
    pub(super) fn gain(&self) -> f64 {
        match self.startup {
            Some(_) => STARTUP_GAIN,
            None => PACING_GAINS[self.periods % PACING_GAINS.len()],
        }
    }

    pub(super) fn pacing_rate(&self) -> f64 {
        self.rate() * self.gain()
    }

    /// Takes a period's `delivery`; `limited` if the rate held sends back in it.
    fn period_ended(&mut self, delivery: f64, limited: bool) {
        self.rates[self.periods % DELIVERY_WINDOW] = delivery;
        self.periods += 1;
        let rate = self.rate();
        if let Some((best, flat)) = self.startup.as_mut().filter(|_| limited) {
            if rate >= *best * (1.0 + STARTUP_GROWTH) {
                *best = rate;
                *flat = 0;
            } else {
                *flat += 1;
                if *flat >= STARTUP_FLAT {
                    self.startup = None;
                }
            }
        }
    }
}

/// The pacing state and controller of one path.
#[derive(Debug, Clone)]
pub(crate) struct Pacer {
    pub(super) config: PacingConfig,
    /// Bytes per second; `None` until a standing queue is seen.
    pub(super) rate: Option<u64>,
    /// When the next paced packet may leave.
    pub(super) next_send: Option<Instant>,
    /// When the next slot's timer may fire: see [`Pacer::retry_at`].
    pub(super) next_retry: Option<Instant>,
    /// The deadline of the timer armed last, before any spreading.
    pub(super) last_deadline: Option<Instant>,
    /// The least round trip of the session: the path without a queue.
    pub(super) min_rtt: Option<Duration>,
    pub(super) period: Period,
    /// The path's rate as last measured with a queue standing on it, in bytes per second.
    pub(super) capacity: Option<f64>,
    /// When the current job began, and the results received by then.
    pub(super) job: Option<(Instant, Delivered)>,
    pub(super) last_sample: Option<Instant>,
    /// A data packet waited for the pacer since the last decision: the rate, not the
    /// window or the peers, limited the worker, so it may grow.
    pub(super) limited: bool,
    /// Loss engaged the pacer, behind a queue too short to show delay: the rate follows
    /// the delivery rate measured ([`Delivery`]), not the standing delay, for the rest of
    /// the session.
    pub(super) measured: bool,
    /// The delivery rates of the latest periods, which a measured pacer paces at.
    pub(super) delivery: Delivery,
    /// `capacity` was measured by loss on a path whose queue never showed delay: one too
    /// short to show it, which a raise past the capacity overflows unseen.
    pub(super) lossy_capacity: bool,
    /// A standing queue above the target has set the rate this session.
    pub(super) queue_shown: bool,
    /// When loss last lowered the rate, and how many times it did.
    pub(super) last_cut: Option<Instant>,
    pub(super) cuts: u64,
    /// Data sendings, and losses, of the periods since the share lost was last judged.
    pub(super) judged: (u32, u32),
    /// Cuts in a row for a share lost above the tolerance, with no judgment below it
    /// between them.
    pub(super) lossy_cuts: u32,
}

impl Pacer {
    pub(crate) fn new(config: PacingConfig) -> Pacer {
        Pacer {
            config,
            rate: None,
            next_send: None,
            next_retry: None,
            last_deadline: None,
            min_rtt: None,
            period: Period::default(),
            capacity: None,
            job: None,
            last_sample: None,
            limited: false,
            measured: false,
            delivery: Delivery::default(),
            lossy_capacity: false,
            queue_shown: false,
            last_cut: None,
            cuts: 0,
            judged: (0, 0),
            lossy_cuts: 0,
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
        // Behind a queue too short to show delay, a catch-up burst is lost.
        let burst = if self.measured { Duration::ZERO } else { BURST };
        let earliest = now.checked_sub(burst).unwrap_or(now);
        let start = self.next_send.map_or(earliest, |at| at.max(earliest));
        self.next_send = Some(start + Duration::from_nanos(bytes as u64 * 1_000_000_000 / rate));
        self.period.sent += 1;
    }

    /// When a slot's timer, due at `deadline`, fires: if it is in step with the timer armed
    /// before it (due within a result's time of that one), a result's `bytes` at the rate
    /// after it, and at most `timeout` late; if not, when it is due. Timers armed together fire
    /// together: slots re-armed behind the same results still coming, and backed-off ones,
    /// which stay in step at one backoff. Each round of their requests draws its answers
    /// back at once: a queue of a frame or two passes one or two of them, and the rest
    /// time out together again (15 slots of one worker, down to 11 after 6 rounds, in a
    /// sparse job of 52 times the model behind 1 KB queues; `benches/RESULTS.md`). With
    /// only backed-off timers spread, the collapse matrix's sparse jobs took 3.8-4.8 times
    /// the model (geometric means of 12 seeds), with every one 3.6-3.9. Only a measured
    /// rate's path, whose queue is too short to show delay, needs it: a queue that holds
    /// the answers costs the lockstep nothing, and spread there, random loss behind 100 ms
    /// (`tests/lossy_links.rs`) took its slowest job from 1.14 to 1.26 of the model.
    pub(crate) fn retry_at(&mut self, deadline: Instant, timeout: Duration, bytes: usize) -> Instant {
        let Some(rate) = self.rate.filter(|_| self.measured) else {
            return deadline;
        };
        let spacing = Duration::from_nanos(bytes as u64 * 1_000_000_000 / rate);
        // In step with the timer armed before it: due within a result's time of that one's
        // deadline. A timer not in step fires when it is due, so that a spread's lag ends
        // with the burst that made it, rather than staying with every later timer.
        let in_step =
            self.last_deadline.is_some_and(|last| deadline.max(last) - deadline.min(last) < spacing);
        let at = match self.next_retry {
            Some(next) if in_step => next.max(deadline).min(deadline + timeout),
            _ => deadline,
        };
        self.last_deadline = Some(deadline);
        self.next_retry = Some(at + spacing);
        at
    }

    /// Takes a queue's overflow found at `now`, with `delivered` bytes of results received
    /// so far, the latest of them at `latest_result`, a packet being `packet_bytes`: an
    /// unpaced worker's rate follows the delivery rate from then on, starting up from the
    /// rate the burst's results came at ([`Pacer::seed`]); a rate the standing delay set
    /// is halved. A measured rate takes none: loss is no signal to it. At most once a round trip
    /// after a cut: one burst's losses come to light over a round trip of timeouts. True
    /// if it took the overflow.
    pub(crate) fn overflowed(
        &mut self,
        now: Instant,
        delivered: Delivered,
        latest_result: Option<Instant>,
        packet_bytes: usize,
    ) -> bool {
        if !self.config.enabled || self.measured {
            return false;
        }
        let round_trip = self.period.least.or(self.min_rtt).unwrap_or_default().max(MIN_PERIOD);
        if self.last_cut.is_some_and(|cut| now.saturating_duration_since(cut) < round_trip) {
            return false;
        }
        self.cut(now);
        match self.rate {
            None => {
                let seed = self.seed(now, delivered, latest_result, packet_bytes);
                self.measure(seed);
            }
            // A rate the standing delay set passed a queue too short to hold its bursts
            // (5 ms behind a 64 KiB bucket in tests/paths.rs): halved, it goes on by the
            // delay. Measured from there, it probed into the queue again, and sent a
            // contribution twice in more than 1 % of them.
            Some(rate) => self.set_rate(rate as f64 / 2.0),
        }
        self.period = Period { began: Some(now), delivered, ..Period::default() };
        self.limited = false;
        true
    }

    /// Paces at the delivery rate measured from now on, starting up from `seed`; a
    /// capacity the delay rule measured before keeps only the floor `set_rate` keeps at
    /// half of it.
    fn measure(&mut self, seed: f64) {
        self.measured = true;
        self.delivery.start(seed);
        self.set_rate(self.delivery.pacing_rate());
    }

    /// The rate a measured pacer starts up from after an overflow at `now`. The packets
    /// a burst's overflow let through left the queue back to back, at the path's rate,
    /// and so did their results: the period delivered at about that rate until its
    /// latest result, and then waited for timeouts. Over a short span it is a guess (it
    /// counts results a thread held back from before the period,
    /// [`DeliveryBatch`](super::DeliveryBatch), and survivors a shaper's bucket let
    /// through faster than its link), so the span is taken as [`MIN_PERIOD`] at least:
    /// the start-up finds the rest, and the guess leaves the measures a window later.
    fn seed(
        &self,
        now: Instant,
        delivered: Delivered,
        latest_result: Option<Instant>,
        packet_bytes: usize,
    ) -> f64 {
        let began = self.period.began.unwrap_or(now);
        let bytes = delivered.bytes.saturating_sub(self.period.delivered.bytes).max(packet_bytes as u64);
        let span =
            latest_result.filter(|&latest| latest > began).unwrap_or(now).saturating_duration_since(began);
        bytes as f64 / span.max(MIN_PERIOD).as_secs_f64()
    }

    /// Starts a decision period afresh at a job's start, with `delivered` bytes of
    /// results received so far: a period that spans the idle time between jobs would
    /// measure the caller's pause, not the path. The worker's threads start their slices
    /// one after another: a period a thread's round trip fed lately goes on.
    pub(crate) fn job_started(&mut self, now: Instant, delivered: Delivered) {
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
    pub(crate) fn sample(&mut self, now: Instant, rtt: Duration, delivered: Delivered, completed_here: bool) {
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
    pub(crate) fn end_period(&mut self, now: Instant, delivered: Delivered) {
        let period = &mut self.period;
        let began = *period.began.get_or_insert(now);
        let elapsed = now.saturating_duration_since(began);
        let due = if self.measured { period.sent >= MEASURE_SENDINGS } else { period.samples >= SAMPLES };
        if !due || elapsed < MIN_PERIOD {
            return;
        }
        let min_rtt = self.min_rtt.unwrap_or_default();
        let ended =
            std::mem::replace(&mut self.period, Period { began: Some(now), delivered, ..Period::default() });
        let limited = std::mem::take(&mut self.limited);
        let delivery = delivered.bytes.saturating_sub(ended.delivered.bytes) as f64 / elapsed.as_secs_f64();
        // A zero target (set through the library, which the config refuses) is a tiny one.
        let target = self.config.target.as_secs_f64().max(1e-6);
        let standing = |least: Duration| least.saturating_sub(min_rtt).as_secs_f64();
        if self.measured {
            // Whatever delay its own rounds show: a worker behind a queue too short to
            // hold a burst is losing, not queueing, and the delay its rounds show there is
            // mostly other workers' results ahead of its own on the way down, which its
            // rate does not drain. Handed back to the delay rule on that delay, sparse
            // workers behind 2 KB at 2 Mbit/s paced at 85-107 kB/s on a link of 250 kB/s
            // (benches/RESULTS.md, "A measured pacer stays measured").
            self.measured_period(delivery, limited);
            return;
        }
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
            let lossy_cuts = std::mem::take(&mut self.lossy_cuts);
            if lost > LOSS_TOLERANCE && lossy_cuts >= LOSSY_PATH_CUTS {
                // Each cut paced below what the path carried, which ends a queue's
                // overflow, and the share lost stayed above the tolerance: the loss is the
                // path's, at any rate. Unpaced, the window governs again, as on any lossy
                // path; a queue's overflow would engage the pacer anew. Whether the share
                // fell from one judgment to the next is no test: at 15 % random loss each
                // way, 64 sendings lose 28 % give or take 6 points, so a share that did not
                // fall twice in a row came up too rarely, and cut after cut paced a
                // property test's cluster down to the floor rate for seconds.
                self.rate = None;
                return;
            }
            if lost > LOSS_TOLERANCE {
                // A queue too short to hold the excess dropped it: the path carried what
                // was not lost (at most halving the rate, as losses found in this period
                // may have left in the last). Not a measured rate, which has no way back:
                // a path that shows a standing queue and loses at random (1 % each way
                // behind 100 ms at 50 Mbit/s, tests/lossy_links.rs) loses more than an
                // eighth of its sendings now and then, even of those sent while paced,
                // and measured it took 1.23-1.29 of the model against 1.13.
                let carried = rate as f64 * (1.0 - lost.min(0.5));
                self.capacity = Some(carried);
                self.lossy_capacity = !self.queue_shown;
                self.cut(now);
                self.lossy_cuts = lossy_cuts + 1;
                self.set_rate(carried * (1.0 - LOSS_TOLERANCE / 2.0));
                return;
            }
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
                // nothing, and pacing at that would stall this worker in turn. (A period that
                // did not wait, the tail of a job say, measures the work left, not the path,
                // and changes nothing.)
                let waited = ended.least.map_or(0.0, standing);
                let this_job = self.job.map_or(0.0, |(began, before)| {
                    let elapsed = now.saturating_duration_since(began).as_secs_f64().max(1e-9);
                    delivered.bytes.saturating_sub(before.bytes) as f64 / elapsed
                });
                let ceiling = delivery.max(this_job).max(self.capacity.unwrap_or(0.0));
                // An unpaced worker that lost more than the tolerance of what the period
                // brought is losing at random: its peers' rounds waited on loss recovery
                // as its own did, and no queue of theirs makes it lose. Paced at the rounds'
                // stalls, it was paced down cut after cut (15 % loss each way, 6 workers
                // and no queue: 6.5 s for a job that takes 0.78 s unpaced).
                let results = delivered.results.saturating_sub(ended.delivered.results).max(1);
                let random_loss = ended.lost as f64 / results as f64 > LOSS_TOLERANCE;
                let engages = self.rate.map_or(!random_loss, |rate| rate as f64 > ceiling);
                if waited > target && engages {
                    self.set_rate(ceiling.max(self.rate.map_or(0.0, |rate| rate as f64 / 2.0)));
                }
            }
        }
    }

    /// Ends a measured pacer's period, which delivered at `delivery` bytes per second;
    /// `limited` if the rate held sends back in it. Loss changes nothing here: at a rate
    /// at or below what the path delivered, losses are random, and the worker's recovery
    /// repairs them; a rate above it delivers no more than the path carries, which is
    /// what the next rate follows. A cut on loss cannot tell the two apart: the losses of
    /// a sending come to light a timeout later, periods after it, and 1 % random loss
    /// each way puts one in most periods of 16 sendings.
    fn measured_period(&mut self, delivery: f64, limited: bool) {
        self.delivery.period_ended(delivery, limited);
        self.set_rate(self.delivery.pacing_rate());
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
