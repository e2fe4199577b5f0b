use std::sync::atomic::Ordering;
use std::time::Instant;

use super::link::DELIVERY_LAG;
use super::rules::Delivered;
use super::*;

const MS: Duration = Duration::from_millis(1);

/// A target of 1 ms, for round figures.
const CONFIG: PacingConfig = PacingConfig { enabled: true, target: MS };

/// The bytes a data packet and its result are booked as.
const PACKET: usize = 100;

/// `bytes` of results, each of a packet's bytes.
fn results(bytes: u64) -> Delivered {
    Delivered { bytes, results: bytes / PACKET as u64 }
}

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
        pacer.job_started(now, Delivered::default());
        Path { pacer, now, delivered: 0, completing: true }
    }

    /// Round trips of `rtts` one after another, with results arriving at `rate`
    /// bytes per second.
    fn round_trips(&mut self, rtts: &[Duration], rate: u64) -> &mut Path {
        for &rtt in rtts {
            self.now += rtt;
            self.delivered += (rate as f64 * rtt.as_secs_f64()) as u64;
            self.pacer.sample(self.now, rtt, results(self.delivered), self.completing);
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

/// Rounds that wait on peers' loss recovery, while this worker loses more than the
/// tolerance of what it receives, show random loss, not a peer's queue: unpaced it stays.
#[test]
fn random_loss_delaying_the_peers_rounds_does_not_engage_the_pacer() {
    let mut path = Path::new(CONFIG);
    path.completing = false;
    path.period(MS / 10, 4_000_000);
    // Periods of four 5.1 ms round trips at 4 MB/s bring 816 results of PACKET bytes.
    let lose = |path: &mut Path, lost: u32| {
        path.pacer.period.lost = lost;
        path.period(MS * 51 / 10, 4_000_000);
    };
    lose(&mut path, 200);
    assert_eq!(path.rate(), None, "a quarter of the results' sendings lost");
    lose(&mut path, 40);
    assert!(near(path.rate(), 4e6), "a twentieth lost: {:?}", path.rate());
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

/// Behind a shaper's bucket the survivors' next blocks are found lost before the tail
/// of the burst that went ahead of them: the run shows whatever order its losses come to
/// light in, and losses too far behind the latest found are forgotten.
#[test]
fn a_run_found_out_of_order_shows_an_overflow() {
    let mut runs = LossRuns::default();
    let run = OVERFLOW_RUN as u64;
    // The burst's survivors' next blocks, 129-142, then its tail from 18 up.
    assert!(!(129..143).any(|number| runs.lost(number)));
    assert!(!(18..18 + run - 1).any(|number| runs.lost(number)));
    assert!(runs.lost(18 + run - 1), "{run} in a row, found in two pieces");
    runs.overflow_taken();
    // A run whose first half lies more than LOST_SPAN behind its second is no run.
    assert!(!(1000..1000 + run / 2).any(|number| runs.lost(number)));
    assert!(!(1300..1300 + run / 2).any(|number| runs.lost(number)));
    assert!(!(1000 + run / 2..1000 + run).any(|number| runs.lost(number)), "forgotten");
}

/// One measured period of [`MEASURE_SENDINGS`] sendings held back by the rate, over
/// [`MIN_PERIOD`], `lost` of them lost, delivering at `rate`.
fn measured_period(path: &mut Path, lost: u32, rate: f64) {
    path.fill();
    path.pacer.period.sent = MEASURE_SENDINGS;
    path.pacer.period.lost = lost;
    path.now += MIN_PERIOD;
    path.delivered += (rate * MIN_PERIOD.as_secs_f64()) as u64;
    path.pacer.end_period(path.now, results(path.delivered));
}

/// Engages a fresh path's pacer by an overflow whose burst delivered `bytes` over
/// `span` after the period began, found 20 ms after it began.
fn overflowed(span: Duration, bytes: u64) -> Path {
    let mut path = Path::new(CONFIG);
    let began = path.now;
    path.now += MS * 20;
    path.delivered += bytes;
    assert!(path.pacer.overflowed(path.now, results(path.delivered), Some(began + span), PACKET));
    assert!(path.pacer.measured);
    path
}

/// Timers due together fire a result's time apart behind a measured rate, and never
/// more than their timeout late; unpaced, or paced by the standing delay (a queue that
/// holds their answers), when they are due.
#[test]
fn timers_due_together_are_spread_at_a_measured_rate() {
    let mut path = Path::new(CONFIG);
    let due = path.now + MS * 80;
    assert_eq!(path.pacer.retry_at(due, MS * 40, 1_000), due, "unpaced");
    path.queue(MS * 10, 10_000_000);
    assert_eq!(path.pacer.retry_at(due, MS * 40, 1_000), due, "paced by the delay");
    assert_eq!(path.pacer.retry_at(due, MS * 40, 1_000), due, "paced by the delay");

    let pacer = &mut overflowed(MS * 5, 10_000).pacer;
    let spacing = Duration::from_nanos(1_000 * 1_000_000_000 / pacer.rate().unwrap());
    let fired: Vec<Instant> = (0..4).map(|_| pacer.retry_at(due, MS * 40, 1_000)).collect();
    let expected: Vec<Instant> = (0..4).map(|turn| due + spacing * turn).collect();
    assert_eq!(fired, expected);
    // A timer due later than the schedule's next turn fires when it is due.
    assert_eq!(pacer.retry_at(due + MS * 30, MS * 40, 1_000), due + MS * 30);
    // However many are queued ahead, one timeout late at most.
    for _ in 0..1_000 {
        pacer.retry_at(due, MS * 5, 100_000);
    }
    assert_eq!(pacer.retry_at(due, MS * 5, 1_000), due + MS * 5);
}

/// A spread's lag ends with the burst that made it: after 64 timers due at once, timers
/// armed a result's time apart, each due a result's time after the one before, fire when
/// they are due, not 63 turns late for the rest of the session.
#[test]
fn timers_armed_at_the_rate_after_a_burst_fire_when_due() {
    let due = Instant::now() + MS * 80;
    let pacer = &mut overflowed(MS * 5, 10_000).pacer;
    let spacing = Duration::from_nanos(1_000 * 1_000_000_000 / pacer.rate().unwrap());
    let burst: Vec<Instant> = (0..64).map(|_| pacer.retry_at(due, MS * 400, 1_000)).collect();
    assert_eq!(burst[63], due + spacing * 63);
    for turn in 1..8 {
        let later = due + spacing * turn;
        assert_eq!(pacer.retry_at(later, MS * 400, 1_000), later, "turn {turn}");
    }
}

#[test]
fn an_overflow_starts_up_from_the_rate_its_burst_was_delivered_at() {
    // The burst's survivors came back within 5 ms, 10 000 bytes of them: 2 MB/s,
    // although the 20 ms up to the overflow delivered only 500 kB/s.
    assert!(near(overflowed(MS * 5, 10_000).rate(), 2e6 * STARTUP_GAIN));
    // Within 1 ms: timed over 4 ms, since a short span may hold results from before
    // the period, or a shaper's burst.
    assert!(near(overflowed(MS, 10_000).rate(), 2.5e6 * STARTUP_GAIN));
    // Without a result in the period, the period's own rate.
    let mut path = Path::new(CONFIG);
    path.now += MS * 10;
    path.delivered += 2_000;
    path.pacer.overflowed(path.now, results(path.delivered), Some(path.now - MS * 20), PACKET);
    assert!(near(path.rate(), 2e5 * STARTUP_GAIN), "{:?}", path.rate());
}

#[test]
fn a_measured_rate_starts_up_until_the_delivery_stops_growing_then_cycles_around_it() {
    let mut path = overflowed(MS * 5, 10_000);
    // Delivered as fast as it was sent: twice that, whoever completed the rounds.
    path.completing = false;
    measured_period(&mut path, 0, 4e6);
    assert!(near(path.rate(), 8e6), "{:?}", path.rate());
    // The path carries 5 MB/s: growth of a quarter goes on, then three periods without
    // it end the start-up.
    measured_period(&mut path, 0, 5e6);
    for _ in 0..STARTUP_FLAT - 1 {
        measured_period(&mut path, 0, 5e6);
        assert!(near(path.rate(), 1e7), "{:?}", path.rate());
    }
    measured_period(&mut path, 0, 5e6);
    assert!(path.pacer.delivery.startup.is_none());
    let mut gains = Vec::new();
    for _ in 0..PACING_GAINS.len() {
        gains.push(path.rate().unwrap() as f64 / 5e6);
        measured_period(&mut path, 0, 5e6);
    }
    // Over a cycle: one period above the path, the next below, the rest just under it.
    let above = gains.iter().position(|&gain| gain > 1.0).unwrap();
    assert!((gains[(above + 1) % gains.len()] - 0.8).abs() < 1e-3, "{gains:?}");
    gains.sort_by(f64::total_cmp);
    let mut expected = PACING_GAINS;
    expected.sort_by(f64::total_cmp);
    assert!(gains.iter().zip(expected).all(|(gain, expected)| (gain - expected).abs() < 1e-3), "{gains:?}");
}

#[test]
fn a_measured_rate_keeps_the_most_delivered_over_its_window_whatever_is_lost() {
    let mut path = overflowed(MS * 5, 10_000);
    for _ in 0..STARTUP_FLAT + 1 {
        measured_period(&mut path, 0, 2e6);
    }
    let pacer = path.pacer.clone();
    let began = (path.now, path.delivered);
    // A stall, or random loss: periods that deliver less, or lose many of their
    // sendings, leave the rate at the most delivered until the window forgets it.
    let mut lossy = Path { pacer: pacer.clone(), ..path };
    for _ in 0..DELIVERY_WINDOW - 1 {
        measured_period(&mut lossy, MEASURE_SENDINGS / 2, 1e6);
        assert!(near(lossy.rate(), 2e6 * lossy.pacer.delivery.gain()), "{:?}", lossy.rate());
    }
    // The same periods without losses pace alike.
    let mut clean = Path { pacer, now: began.0, delivered: began.1, completing: lossy.completing };
    for _ in 0..DELIVERY_WINDOW - 1 {
        measured_period(&mut clean, 0, 1e6);
    }
    assert_eq!(clean.rate(), lossy.rate());
    // A path that got slower: once the window holds only its rate, the rate follows.
    measured_period(&mut lossy, 0, 1e6);
    assert!(lossy.pacer.delivery.rate() == 1e6, "{}", lossy.pacer.delivery.rate());
    // A further overflow changes nothing: loss is no signal to a measured rate.
    let rate = lossy.rate();
    lossy.now += MS * 100;
    assert!(!lossy.pacer.overflowed(lossy.now, results(lossy.delivered), None, PACKET));
    assert_eq!(lossy.rate(), rate);
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
    // Loss still above the tolerance after three cuts in a row is the path's, at any
    // rate: unpaced again.
    let mut rates = Vec::new();
    for _ in 0..2 {
        path.pacer.period.sent = LOSS_SAMPLE;
        path.pacer.period.lost = 12;
        path.period(MS, 1_000_000);
        rates.push(path.rate());
    }
    assert!(rates[0].is_some() && rates[1].is_none(), "{rates:?}");
}

#[test]
fn random_loss_above_the_tolerance_unpaces_after_three_cuts_however_its_share_wavers() {
    // A quarter of the sendings lost at random, as samples of 64 see it: a few points up
    // or down from one judgment to the next, whatever the rate. Whether the share fell is
    // no test of that: it falls as often as not.
    let judge = |path: &mut Path, lost: u32| {
        path.pacer.period.sent = LOSS_SAMPLE;
        path.pacer.period.lost = lost;
        path.period(MS, 1_000_000);
        path.rate()
    };
    let mut path = Path::new(CONFIG);
    path.queue(MS * 10, 1_000_000);
    let mut rates = vec![path.rate()];
    rates.extend([19, 14, 18, 15].map(|lost| judge(&mut path, lost)));
    assert!(rates[..4].windows(2).all(|pair| pair[1] < pair[0]), "three cuts: {rates:?}");
    assert_eq!(rates[4], None, "{rates:?}");
    // A judgment within the tolerance between cuts shows loss that fell with the rate:
    // the count starts again.
    let mut path = Path::new(CONFIG);
    path.queue(MS * 10, 1_000_000);
    let rates = [19, 14, 4, 18, 15, 17, 16].map(|lost| judge(&mut path, lost));
    assert!(rates[..6].iter().all(Option::is_some), "{rates:?}");
    assert_eq!(rates[6], None, "{rates:?}");
}

#[test]
fn an_overflow_halves_a_rate_the_standing_delay_set() {
    let mut path = Path::new(CONFIG);
    path.queue(MS * 10, 1_000_000);
    let paced = path.rate().unwrap() as f64;
    path.now += MS * 100;
    assert!(path.pacer.overflowed(path.now, results(path.delivered), None, PACKET));
    assert!(!path.pacer.measured);
    // Never below half the path's measured rate.
    let floor = path.pacer.capacity.unwrap() / 2.0;
    assert!(near(path.rate(), (paced / 2.0).max(floor)), "{:?}", path.rate());
}

/// Behind a queue of a frame or two, a worker's own rounds wait mostly behind other
/// workers' results on the way down: a delay its rate does not drain, and no reason to
/// leave the rate the path delivers.
#[test]
fn a_measured_rate_stays_whatever_delay_its_own_round_trips_show() {
    let mut path = overflowed(MS * 5, 10_000);
    // Round trips of 100 µs: the path without a queue, and no standing delay.
    path.round_trips(&[MS / 10], 2_000_000);
    measured_period(&mut path, 0, 2e6);
    // A period whose own rounds all took 5 ms, 4.9 ms above the least, delivering 3 MB/s.
    path.fill();
    path.pacer.period.sent = MEASURE_SENDINGS;
    path.round_trips(&[MS * 5], 3_000_000);
    assert!(path.pacer.measured);
    assert!(path.pacer.delivery.rate() >= 3e6 * 0.999, "{}", path.pacer.delivery.rate());
    assert!(near(path.rate(), path.pacer.delivery.pacing_rate()), "{:?}", path.rate());
}

#[test]
fn a_measured_rate_sends_no_catch_up_burst() {
    let mut path = overflowed(MS * 5, 10_000);
    let rate = path.rate().unwrap() as f64;
    path.fill();
    // Long idle: the next packets go one a packet's time apart, not BURST's worth at once.
    path.now += MS * 100;
    let mut sent = 0;
    while path.pacer.allows(path.now) {
        path.pacer.sent(path.now, PACKET);
        sent += 1;
    }
    let quantum = (QUANTUM.as_secs_f64() * rate / PACKET as f64).ceil() as usize;
    assert!(sent <= quantum + 1, "{sent} at once, against {quantum} in a quantum");
}

#[test]
fn a_paced_sending_is_booked_at_the_mean_result_s_size() {
    let pacer = LinkPacer::new(CONFIG);
    let now = Instant::now();
    let mut batch = DeliveryBatch::default();
    // Results of 100 and 300 bytes: 200 on average.
    for (i, bytes) in [100, 300, 100, 300].into_iter().enumerate() {
        batch.add(&pacer, now + DELIVERY_LAG * i as u32, bytes);
    }
    pacer.job_started(now, &mut batch);
    pacer.state().rate = Some(1_000_000);
    pacer.rate.store(1_000_000, Ordering::Relaxed);
    pacer.sent(now, 1_000);
    let next = pacer.ready_at().unwrap();
    // 200 bytes at 1 MB/s after the start, which BURST may put back.
    assert_eq!(next + BURST, now + Duration::from_micros(200));
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

/// Once a run engaged the pacer, other threads' runs, within a round trip or long
/// after, leave the rate to the deliveries it measures.
#[test]
fn further_runs_leave_a_measured_rate_alone() {
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
    lose_run(&mut first, OVERFLOW_RUN, now);
    let engaged = pacer.rate().expect("a run of OVERFLOW_RUN engages the pacer");
    assert!(near(Some(engaged), 1e7 * STARTUP_GAIN), "{engaged}");
    lose_run(&mut second, OVERFLOW_RUN, now + MS);
    lose_run(&mut second, OVERFLOW_RUN, now + MIN_PERIOD * 4);
    assert_eq!(pacer.rate(), Some(engaged));
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
