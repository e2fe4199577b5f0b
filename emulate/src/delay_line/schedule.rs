//! The part of one direction that decides each frame's fate and due time, with no I/O:
//! time comes in as an argument, randomness from a generator the caller seeds.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::Rng;

use super::Impairment;

/// How much a direction may hold at once; a frame beyond either limit is dropped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct HoldLimit {
    pub frames: usize,
    pub bytes: usize,
}

/// What became of an arriving frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Arrival {
    Held,
    /// Dropped on purpose, as the impairment's loss says.
    Lost,
    /// Dropped because the line already held its limit.
    Overflowed,
}

/// A frame whose time has come, with the time it was due.
#[derive(Debug, PartialEq)]
pub(super) struct Due<F> {
    pub frame: F,
    pub due: Instant,
}

/// Frames of one direction in arrival order, each with the time it is due to leave.
pub(super) struct Schedule<F> {
    impairment: Impairment,
    limit: HoldLimit,
    rng: SmallRng,
    held: VecDeque<Due<F>>,
    held_bytes: usize,
    /// The due time of the newest frame held so far; a later frame is never due before it.
    latest_due: Option<Instant>,
}

impl<F: AsRef<[u8]>> Schedule<F> {
    pub fn new(impairment: Impairment, limit: HoldLimit, rng: SmallRng) -> Self {
        Schedule { impairment, limit, rng, held: VecDeque::new(), held_bytes: 0, latest_due: None }
    }

    /// Takes a frame that arrived at `now`: loses it, refuses it or holds it until due.
    pub fn arrive(&mut self, now: Instant, frame: F) -> Arrival {
        // gen() is in [0, 1): a loss of 0 never drops, a loss of 1 always does.
        if self.impairment.loss > 0.0 && self.rng.gen::<f64>() < self.impairment.loss {
            return Arrival::Lost;
        }
        let size = frame.as_ref().len();
        if self.held.len() >= self.limit.frames || self.held_bytes + size > self.limit.bytes {
            return Arrival::Overflowed;
        }
        let mut due = now + self.sample_delay();
        if let Some(latest) = self.latest_due {
            due = due.max(latest);
        }
        self.latest_due = Some(due);
        self.held_bytes += size;
        self.held.push_back(Due { frame, due });
        Arrival::Held
    }

    /// The oldest frame if it is due at `now`.
    pub fn pop_due(&mut self, now: Instant) -> Option<Due<F>> {
        if self.held.front()?.due > now {
            return None;
        }
        let popped = self.held.pop_front()?;
        self.held_bytes -= popped.frame.as_ref().len();
        Some(popped)
    }

    /// When the oldest frame held is due, if any is held.
    pub fn next_due(&self) -> Option<Instant> {
        self.held.front().map(|oldest| oldest.due)
    }

    /// The delay plus a jitter uniform in [-jitter, +jitter], never below zero.
    fn sample_delay(&mut self) -> Duration {
        let Impairment { delay, jitter, .. } = self.impairment;
        if jitter.is_zero() {
            return delay;
        }
        let jitter_nanos = jitter.as_nanos() as i128;
        let offset = self.rng.gen_range(-jitter_nanos..=jitter_nanos);
        let nanos = (delay.as_nanos() as i128 + offset).max(0);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    const ROOMY: HoldLimit = HoldLimit { frames: 1_000_000, bytes: usize::MAX };

    fn schedule(impairment: Impairment, limit: HoldLimit) -> Schedule<Vec<u8>> {
        Schedule::new(impairment, limit, SmallRng::seed_from_u64(7))
    }

    fn ms(millis: u64) -> Duration {
        Duration::from_millis(millis)
    }

    #[test]
    fn a_frame_is_due_after_the_delay_and_not_before() {
        let start = Instant::now();
        let mut line = schedule(Impairment { delay: ms(20), ..Impairment::default() }, ROOMY);
        assert_eq!(line.arrive(start, vec![1, 2, 3]), Arrival::Held);
        assert_eq!(line.next_due(), Some(start + ms(20)));
        assert_eq!(line.pop_due(start + ms(19)), None);
        let due = line.pop_due(start + ms(21)).expect("due after 20 ms");
        assert_eq!(due, Due { frame: vec![1, 2, 3], due: start + ms(20) });
        assert_eq!(line.next_due(), None);
    }

    #[test]
    fn without_delay_a_frame_is_due_on_arrival() {
        let start = Instant::now();
        let mut line = schedule(Impairment::default(), ROOMY);
        line.arrive(start, vec![0]);
        assert_eq!(line.pop_due(start).map(|d| d.due), Some(start));
    }

    #[test]
    fn jitter_stays_in_its_band_and_never_reorders() {
        let start = Instant::now();
        let impairment = Impairment { delay: ms(10), jitter: ms(5), loss: 0.0 };
        let mut line = schedule(impairment, ROOMY);
        let arrivals: Vec<Instant> = (0..10_000).map(|i| start + Duration::from_micros(i * 100)).collect();
        for (i, &arrival) in arrivals.iter().enumerate() {
            line.arrive(arrival, (i as u32).to_le_bytes().to_vec());
        }
        let mut previous_due = start;
        let mut jittered_below_delay = false;
        for (i, &arrival) in arrivals.iter().enumerate() {
            let Due { frame, due } = line.pop_due(start + Duration::from_secs(10)).expect("all are due");
            assert_eq!(frame, (i as u32).to_le_bytes().to_vec(), "frames leave in arrival order");
            assert!(due >= previous_due, "frame {i} due before the one ahead of it");
            assert!(due >= arrival + ms(5), "frame {i} earlier than delay - jitter");
            // Only holding a frame behind an earlier one may push it past delay + jitter.
            assert!(due <= (arrival + ms(15)).max(previous_due), "frame {i} later than it need be");
            jittered_below_delay |= due < arrival + ms(10);
            previous_due = due;
        }
        assert!(jittered_below_delay, "jitter never shortened the delay");
    }

    #[test]
    fn jitter_larger_than_the_delay_is_clamped_at_no_delay() {
        let start = Instant::now();
        let mut line = schedule(Impairment { delay: ms(1), jitter: ms(50), loss: 0.0 }, ROOMY);
        for i in 0..1000 {
            let arrival = start + Duration::from_secs(i);
            line.arrive(arrival, vec![0]);
            let due = line.pop_due(arrival + ms(100)).expect("due").due;
            assert!(due >= arrival && due <= arrival + ms(51));
        }
    }

    #[test]
    fn loss_drops_about_its_share_and_the_extremes_exactly() {
        let start = Instant::now();
        let count_held = |loss: f64| {
            let mut line = schedule(Impairment { loss, ..Impairment::default() }, ROOMY);
            (0..10_000).filter(|_| line.arrive(start, vec![0]) == Arrival::Held).count()
        };
        assert_eq!(count_held(0.0), 10_000);
        assert_eq!(count_held(1.0), 0);
        let half = count_held(0.5);
        assert!((4_700..=5_300).contains(&half), "{half} of 10000 held at loss 0.5");
        let tenth = count_held(0.1);
        assert!((8_800..=9_200).contains(&tenth), "{tenth} of 10000 held at loss 0.1");
    }

    #[test]
    fn frames_beyond_the_limit_overflow_until_room_is_made() {
        let start = Instant::now();
        let mut line = schedule(Impairment::default(), HoldLimit { frames: 2, bytes: 1000 });
        assert_eq!(line.arrive(start, vec![0; 10]), Arrival::Held);
        assert_eq!(line.arrive(start, vec![0; 10]), Arrival::Held);
        assert_eq!(line.arrive(start, vec![0; 10]), Arrival::Overflowed);
        assert!(line.pop_due(start).is_some());
        assert_eq!(line.arrive(start, vec![0; 10]), Arrival::Held);

        let mut line = schedule(Impairment::default(), HoldLimit { frames: 100, bytes: 1000 });
        assert_eq!(line.arrive(start, vec![0; 600]), Arrival::Held);
        assert_eq!(line.arrive(start, vec![0; 600]), Arrival::Overflowed);
        assert_eq!(line.arrive(start, vec![0; 400]), Arrival::Held);
        assert!(line.pop_due(start).is_some());
        assert_eq!(line.arrive(start, vec![0; 600]), Arrival::Held);
    }
}
