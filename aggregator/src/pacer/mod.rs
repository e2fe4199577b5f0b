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
//!   a probing period delivered is the path's capacity (the rate the probe started at
//!   only if timed as well as a period: a few results over a short span are a guess).
//!   Losses come to light a timeout after their sending, periods later: a probe raising
//!   its own rate would run far past the path;
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
/// grow, and one loss more: 1 % random loss each way resends about 2 % of them, one in a
/// period of 16 sendings as often as not, while a probe past a queue too short to show
/// delay loses far more.
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
