//! A session's slow start: its first sendings paced from a small window that doubles
//! every round trip, as TCP's slow start grows, until the path shows a queue or loses.

use std::time::Duration;

use super::{LOSS_TOLERANCE, STARTUP_GAIN};

/// Packets a session's first burst may hold: the rest of the window waits for the first
/// round trips, which a queue of a packet or two would otherwise drop a timeout at a time.
const INITIAL_WINDOW: u64 = 10;

/// The round trip taken before any was measured: the initial window leaves at once, and
/// the next one over this, until the first result times the path.
pub(super) const INITIAL_RTT: Duration = Duration::from_millis(4);

/// Losses a slow start takes at least before their share may end it: one or two random
/// losses among its first few sendings are no overflow.
const OVERFLOW_LOSSES: u32 = 4;

/// A slow start in progress: a window of the initial one plus every byte of results
/// delivered since, sent over the least round trip, so that it doubles each round trip
/// while the path delivers all it is sent. A rate, not a window, since time alone must
/// release paced packets (see [`crate::pacer`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SlowStart {
    /// The bytes a data packet is booked at, from the first one sent.
    packet_bytes: Option<u64>,
    /// The most a decision period of the slow start delivered, in bytes per second.
    best_delivery: f64,
    /// Data sendings made, and found lost, since it began.
    sent: u32,
    lost: u32,
}

impl SlowStart {
    /// Books a data sending of `bytes`.
    pub(super) fn sent(&mut self, bytes: usize) {
        self.packet_bytes.get_or_insert(bytes as u64);
        self.sent += 1;
    }

    /// The rate to pace at, in bytes per second, with `delivered` bytes of results
    /// received since the slow start began and `min_rtt` the least round trip measured;
    /// `None` before the first sending. Never above [`STARTUP_GAIN`] times the most a
    /// period delivered: losses come to light a timeout later, and a window grown by
    /// every result over a round trip far shorter than that timeout would have passed
    /// the path many times over by then.
    pub(super) fn rate(&self, delivered: u64, min_rtt: Option<Duration>) -> Option<f64> {
        let window = INITIAL_WINDOW * self.packet_bytes? + delivered;
        let rtt = min_rtt.unwrap_or(INITIAL_RTT).max(Duration::from_micros(1));
        let rate = window as f64 / rtt.as_secs_f64();
        Some(match self.best_delivery {
            0.0 => rate,
            best => rate.min(best * STARTUP_GAIN),
        })
    }

    /// Takes a decision period's delivery rate, in bytes per second.
    pub(super) fn period_ended(&mut self, delivery: f64) {
        self.best_delivery = self.best_delivery.max(delivery);
    }

    /// The most a period delivered: the rate a measured pacer starts up from when an
    /// overflow ends the slow start.
    pub(super) fn best_delivery(&self) -> f64 {
        self.best_delivery
    }

    /// Books a sending found lost; true if the losses show a queue's overflow: more than
    /// [`LOSS_TOLERANCE`] of the sendings, which random loss of a few percent stays below.
    pub(super) fn lost(&mut self) -> bool {
        self.lost += 1;
        self.lost >= OVERFLOW_LOSSES && self.lost as f64 > LOSS_TOLERANCE * self.sent as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_window_grows_by_what_is_delivered_over_the_least_round_trip() {
        let mut start = SlowStart::default();
        assert_eq!(start.rate(0, None), None, "no packet size before the first sending");
        start.sent(1000);
        // 10 packets over the assumed 4 ms, then over the measured 1 ms.
        assert_eq!(start.rate(0, None), Some(2_500_000.0));
        assert_eq!(start.rate(0, Some(MS)), Some(10_000_000.0));
        // A window's worth delivered doubles it.
        assert_eq!(start.rate(10_000, Some(MS)), Some(20_000_000.0));
        // Capped at twice the most a period delivered.
        start.period_ended(3_000_000.0);
        start.period_ended(1_000_000.0);
        assert_eq!(start.rate(10_000, Some(MS)), Some(6_000_000.0));
        assert_eq!(start.best_delivery(), 3_000_000.0);
    }

    #[test]
    fn an_overflow_is_a_share_of_the_sendings_lost_not_a_loss_or_two() {
        let mut start = SlowStart::default();
        (0..20).for_each(|_| start.sent(1000));
        // 3 of 20 is above the tolerance, but too few to tell.
        assert!(!start.lost() && !start.lost() && !start.lost());
        assert!(start.lost(), "4 of 20");
        let mut random = SlowStart::default();
        (0..100).for_each(|_| random.sent(1000));
        assert!(!(0..12).any(|_| random.lost()), "12 of 100");
        assert!(random.lost(), "13 of 100");
    }
}
