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
//! Acknowledgements, requests and probes, header-only and few, pass at once; but behind
//! a queue too short to show delay, slots' timers armed together, which would fire
//! together and draw their answers back at once into that queue, fire spread at the
//! rate the path's results come at ([`LinkPacer::retry_at`]).
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
//!   the rounds up; an unpaced worker that lost more than [`LOSS_TOLERANCE`] of the
//!   results the period brought is losing at random, which delays its peers' rounds as
//!   its own, and stays unpaced;
//! - no standing delay on its own path raises a rate that held sends back, by up to an
//!   eighth, the less the closer the delay is to the target, never far beyond the rate
//!   delivered or measured.
//!
//! A queue of a packet or two holds less than the target: a window many times it shows
//! no delay, loses all but the first few packets of each burst, and the doubling timeouts
//! leave the link idle, a collapse. There loss engages the pacer, and from then on the
//! rate follows the rate the path delivers, as a model-based congestion controller
//! (BBR) paces, not the losses:
//! - a run of [`OVERFLOW_RUN`] of a thread's first sendings lost in a row ([`LossRuns`]),
//!   in whatever order their losses come to light, is a queue's overflow, which drops the
//!   tail of a burst; random loss drops packets apart;
//! - an unpaced worker then paces at the most its path delivered in any of the latest
//!   [`DELIVERY_WINDOW`] periods of [`MEASURE_SENDINGS`] sendings ([`rules::Delivery`]):
//!   a period can deliver less than the path (a stall, a peer's recovery, nothing left
//!   to send) but not more. It starts up from the rate the burst's survivors came back
//!   at (they left the queue back to back, at the path's rate), at twice the measure
//!   until that stops growing, and then cycles through [`PACING_GAINS`]: a period a
//!   little above the measure to find a path that got faster, one below to drain what
//!   that queued, the rest just under it, which leaves the measure's noise (a period's
//!   results come in bunches) no queue to fill;
//! - losses change nothing then. The earlier rules cut the rate on loss, and behind a
//!   1 KB queue could not tell 1 % random loss from an overflow: a sending's loss comes
//!   to light a timeout later, periods after the rate that caused it, and one loss in a
//!   period of 16 sendings is as likely from either. A rate at or below what the path
//!   delivered loses only at random, and the worker's recovery repairs that; a rate
//!   above it delivers no more than the path carries, which the next rate follows;
//! - a worker the standing delay paced that finds more than [`LOSS_TOLERANCE`] of its
//!   data sendings lost paces below the share the path carried, as before; one that
//!   still loses more after [`LOSSY_PATH_CUTS`] such cuts in a row is losing at random,
//!   at any rate, and is unpaced again. A capacity so measured on a path that never showed a
//!   standing queue caps the rate's raises just below it (a raise past it would go
//!   unseen until its losses), creeping up by [`LOSSY_CREEP`] while the rate presses
//!   against it. Nor does it become a measured rate, which has no way
//!   back: random loss behind a deep queue (1 % each way behind 100 ms at 50 Mbit/s)
//!   passes that share now and then, and a measured rate there paced it below its path
//!   for good;
//! - a measured rate paces the worker for the rest of the session, whatever delay its own
//!   rounds show: behind a queue too short to hold a burst, that delay is mostly other
//!   workers' results queued ahead of its own on the way down, which its rate does not
//!   drain, and the delay rule, handed such a worker, paced it far below its path. A
//!   worker the delay rule paces halves its rate on an overflow;
//! - no catch-up burst: the [`BURST`] an idle spell earns elsewhere overflows a queue of
//!   a packet or two. The window is left alone, for the liveness reason above, so the
//!   path's queue is bounded by the rate alone.
//!
//! A data sending is booked at the mean size of the path's results, since the delivery
//! rate measures results and a sending draws one: a sparse stream's contribution may be
//! a bare header while its result, the union of every worker's blocks, is full, and
//! other results are short. Booked at its own size, a paced rate would let results
//! through faster than itself and overflow the path down; booked as a full packet, a
//! rate measured in results' bytes would send fewer than the path carries. Behind a
//! measured rate a sparse worker books the rounds it sends nothing to as well (a turn
//! per such round, taken in order with its sendings), and the requests that draw a
//! result sent again: every result down its path is then booked once, where its
//! sendings alone drew about 1.4 results each (`worker::PacedTurn`).
//!
//! Every worker's thread `t` carries the same rounds, so all of them settle on the
//! slowest path's rate. Until a path shows a standing queue or an overflow the worker is
//! not paced at all, so that a path faster than the worker (a loopback, a fast network) costs nothing.

mod link;
mod loss_runs;
mod rules;
#[cfg(test)]
mod tests;

use std::time::Duration;

pub(crate) use link::DeliveryBatch;
pub use link::LinkPacer;
pub(crate) use loss_runs::LossRuns;
pub(crate) use rules::Pacer;

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
pub(crate) const QUANTUM: Duration = Duration::from_micros(500);

/// The least rate the pacer sets, in bytes per second: time alone must keep releasing
/// packets, however long the measured delays.
const MIN_RATE: u64 = 8_000;

/// The largest raise per decision, as a fraction: an eighth. The queue must hold the
/// excess a raise sends until the next decision sees it.
const MAX_RAISE: f64 = 0.125;

/// Data sendings that end a measured pacer's period: the delivery rate of a period of a
/// few packets is that of a lucky few.
const MEASURE_SENDINGS: u32 = 16;

/// Periods whose delivery rates a measured pacer takes the most of.
const DELIVERY_WINDOW: usize = 10;

/// A measured pacer's rate as a multiple of the path's measured rate, period after
/// period: a tenth above, to find a path that got faster; a fifth below, to drain what
/// that queued; then a tenth below, since the measure is the most of noisy periods and a
/// queue of a packet or two holds none of its excess. BBR's quarter above and below
/// paced later dense jobs of `tests/collapse.rs` at 1.9-2.0 of the model (geometric
/// mean), these at 1.6-1.7.
const PACING_GAINS: [f64; 8] = [1.1, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9];

/// A starting measured pacer's rate as a multiple of the most delivered so far.
const STARTUP_GAIN: f64 = 2.0;

/// How much a starting pacer's measure must grow in a period to go on starting up.
const STARTUP_GROWTH: f64 = 0.25;

/// Periods in a row without that growth that end the start-up.
const STARTUP_FLAT: u32 = 3;

/// How far a capacity that loss measured rises in a period whose rate pressed against
/// it: slowly, since passing it costs losses found only a timeout later.
const LOSSY_CREEP: f64 = 1.0 / 64.0;

/// Consecutive first sendings of one thread found lost that show a queue's overflow: a
/// full queue drops the tail of a burst, random loss drops packets apart. At 30 % loss
/// each way a round trip fails with probability 0.51, and 16 in a row (2e-5 were losses
/// independent) came up often enough in `tests/stress.rs` to pace, and slow, lossy
/// clusters with no queue; 32 in a row (4e-10) against runs of a window less a packet or
/// two in a collapse. Losses are not independent (a stall leaves many sendings
/// unanswered together): 32 still engaged one of the stress test's 1 500 clusters, which
/// the measured rate then paces at the most its path delivered.
pub const OVERFLOW_RUN: u32 = 32;

/// The share of the data sendings found lost that a rate the standing delay set
/// tolerates: random loss of a few percent each way stays below; a rate above a queue
/// too short to show delay loses the excess.
const LOSS_TOLERANCE: f64 = 0.125;

/// Data sendings a paced worker counts before it judges their share lost: fewer, and a
/// loss or two decides.
const LOSS_SAMPLE: u32 = 64;

/// Cuts in a row for a share lost above [`LOSS_TOLERANCE`] after which a loss still above
/// it is taken as the path's, at any rate: a cut paces below what the path carried, which
/// ends a queue's overflow at once, or within a cut or two where the rate it cut did not
/// limit the worker (and overstated what the path carried).
const LOSSY_PATH_CUTS: u32 = 3;

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
