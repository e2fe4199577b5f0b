//! The part of one direction that decides each frame's fate and due time, and when its
//! thread wakes, with no I/O: time comes in as an argument, randomness from a generator the
//! caller seeds.
//!
//! The thread wakes once per batch, not once per frame: it sleeps until the oldest frame
//! held is due (and a little more, `send_slack`, so that one wake-up sends every frame due
//! by then), sends them, and reads every frame that arrived meanwhile. A frame read late
//! is still delayed from its arrival if the kernel stamped it on arrival at this line; one
//! without such a stamp counts as arrived when read, which is why the thread then reads
//! every `send_slack` at least, and why its lateness counts from the earliest it could
//! have arrived: the arrival's uncertainty shows in the lateness the line reports.

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

/// When a frame arrived at the line, as far as its reader knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ArrivalTime {
    /// Known from the kernel's stamp.
    Stamped(Instant),
    /// Read at `read`, having arrived after `after` (the previous read that left nothing
    /// waiting): it counts as arrived at `read`.
    Read { after: Instant, read: Instant },
}

/// The interval in which every frame of one read arrived: after the previous read that left
/// nothing waiting, and by this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ReadWindow {
    pub after: Instant,
    pub read: Instant,
}

/// How far a kernel stamp may lie after its read window and still be taken for an arrival
/// time: the error of converting the kernel's system-clock stamp to the monotonic clock.
const STAMP_TOLERANCE: Duration = Duration::from_micros(20);
/// How far a kernel stamp may lie before its read window and still be taken for an arrival
/// time. The kernel stamps a frame when a device hands it over, and on a busy host may queue
/// it to the socket later, after a read found the socket empty; a stamp further back is not
/// an arrival at this line (a sender's departure time on some kernels).
const STAMP_BACKLOG_ALLOWANCE: Duration = Duration::from_micros(200);

/// The most a thread sleeps past a frame's due time, to send several at one wake-up.
const SEND_SLACK_LIMIT: Duration = Duration::from_micros(100);
/// The shortest interval between reads while frames without stamps come: a line without
/// delay must not spin.
const UNSTAMPED_READ_INTERVAL_MIN: Duration = Duration::from_micros(20);
/// The longest a thread holding frames goes without reading: frames not yet read wait in
/// the socket's buffer, which a long delay at a high rate would otherwise overflow (at 10
/// Gbit/s a 32 MiB buffer of full frames fills in about 10 ms).
const READ_INTERVAL_MAX: Duration = Duration::from_millis(2);

impl ReadWindow {
    /// A frame's arrival: its kernel stamp if the stamp lies in the window (a stamp from
    /// elsewhere, such as a sender's departure time on another clock, does not), else the
    /// time of the read.
    pub fn arrival(&self, stamp: Option<Instant>) -> ArrivalTime {
        match stamp {
            Some(stamp)
                if stamp + STAMP_BACKLOG_ALLOWANCE >= self.after && stamp <= self.read + STAMP_TOLERANCE =>
            {
                ArrivalTime::Stamped(stamp.min(self.read))
            }
            _ => ArrivalTime::Read { after: self.after, read: self.read },
        }
    }
}

/// A frame whose time has come, with the time it was due.
#[derive(Debug, PartialEq)]
pub(super) struct Due<F> {
    pub frame: F,
    pub due: Instant,
    /// The earliest it could have been due: `due` if its arrival is known, else as if it had
    /// arrived just after the previous read. Lateness counts from this.
    pub lateness_from: Instant,
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
    /// The `lateness_from` of the newest frame held so far, which a later frame's is never
    /// before, as its due time never is.
    latest_lateness_from: Option<Instant>,
    /// The last frame to arrive had no arrival stamp: frames must be read often.
    unstamped: bool,
}

impl<F: AsRef<[u8]>> Schedule<F> {
    pub fn new(impairment: Impairment, limit: HoldLimit, rng: SmallRng) -> Self {
        Schedule {
            impairment,
            limit,
            rng,
            held: VecDeque::new(),
            held_bytes: 0,
            latest_due: None,
            latest_lateness_from: None,
            unstamped: false,
        }
    }

    /// Takes a frame that arrived at `arrival`: loses it, refuses it or holds it until due.
    pub fn arrive(&mut self, arrival: ArrivalTime, frame: F) -> Arrival {
        let (after, at) = match arrival {
            ArrivalTime::Stamped(at) => (at, at),
            ArrivalTime::Read { after, read } => (after, read),
        };
        self.unstamped = matches!(arrival, ArrivalTime::Read { .. });
        // gen() is in [0, 1): a loss of 0 never drops, a loss of 1 always does.
        if self.impairment.loss > 0.0 && self.rng.gen::<f64>() < self.impairment.loss {
            return Arrival::Lost;
        }
        let size = frame.as_ref().len();
        if self.held.len() >= self.limit.frames || self.held_bytes + size > self.limit.bytes {
            return Arrival::Overflowed;
        }
        let delay = self.sample_delay();
        let (mut due, mut lateness_from) = (at + delay, after + delay);
        if let (Some(latest_due), Some(latest_lateness_from)) = (self.latest_due, self.latest_lateness_from) {
            due = due.max(latest_due);
            lateness_from = lateness_from.max(latest_lateness_from);
        }
        (self.latest_due, self.latest_lateness_from) = (Some(due), Some(lateness_from));
        self.held_bytes += size;
        self.held.push_back(Due { frame, due, lateness_from });
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

    /// When the thread should wake next to send and read, given when it last read every
    /// frame waiting; `None` when nothing is held, and it may wait for a frame instead.
    pub fn next_wake(&self, last_read: Instant) -> Option<Instant> {
        let oldest = self.held.front()?;
        let wake = (oldest.due + self.send_slack()).min(last_read + READ_INTERVAL_MAX);
        // Without stamps, a frame's arrival is known only to within a wake-up interval.
        if self.unstamped {
            return Some(wake.min(last_read + self.send_slack().max(UNSTAMPED_READ_INTERVAL_MIN)));
        }
        Some(wake)
    }

    /// How long past a frame's due time its thread may sleep: a twentieth of the delay (with
    /// jitter), at most `SEND_SLACK_LIMIT`, well inside the lateness at which a run says the
    /// delay was not held.
    fn send_slack(&self) -> Duration {
        ((self.impairment.delay + self.impairment.jitter) / 20).min(SEND_SLACK_LIMIT)
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
    use ArrivalTime::Stamped;

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
        assert_eq!(line.arrive(Stamped(start), vec![1, 2, 3]), Arrival::Held);
        // A twentieth of the delay past it, at most 100 us, so that one wake-up sends
        // several; and, however long the delay, a read every READ_INTERVAL_MAX meanwhile.
        assert_eq!(line.next_wake(start + ms(19)), Some(start + ms(20) + Duration::from_micros(100)));
        assert_eq!(line.next_wake(start), Some(start + READ_INTERVAL_MAX));
        assert_eq!(line.pop_due(start + ms(19)), None);
        let due = line.pop_due(start + ms(21)).expect("due after 20 ms");
        assert_eq!(due, Due { frame: vec![1, 2, 3], due: start + ms(20), lateness_from: start + ms(20) });
        assert_eq!(line.next_wake(start), None);
    }

    #[test]
    fn without_delay_a_frame_is_due_on_arrival() {
        let start = Instant::now();
        let mut line = schedule(Impairment::default(), ROOMY);
        line.arrive(Stamped(start), vec![0]);
        assert_eq!(line.pop_due(start).map(|d| d.due), Some(start));
    }

    #[test]
    fn jitter_stays_in_its_band_and_never_reorders() {
        let start = Instant::now();
        let impairment = Impairment { delay: ms(10), jitter: ms(5), loss: 0.0 };
        let mut line = schedule(impairment, ROOMY);
        let arrivals: Vec<Instant> = (0..10_000).map(|i| start + Duration::from_micros(i * 100)).collect();
        for (i, &arrival) in arrivals.iter().enumerate() {
            line.arrive(Stamped(arrival), (i as u32).to_le_bytes().to_vec());
        }
        let mut previous_due = start;
        let mut jittered_below_delay = false;
        for (i, &arrival) in arrivals.iter().enumerate() {
            let Due { frame, due, .. } = line.pop_due(start + Duration::from_secs(10)).expect("all are due");
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
            line.arrive(Stamped(arrival), vec![0]);
            let due = line.pop_due(arrival + ms(100)).expect("due").due;
            assert!(due >= arrival && due <= arrival + ms(51));
        }
    }

    #[test]
    fn loss_drops_about_its_share_and_the_extremes_exactly() {
        let start = Instant::now();
        let count_held = |loss: f64| {
            let mut line = schedule(Impairment { loss, ..Impairment::default() }, ROOMY);
            (0..10_000).filter(|_| line.arrive(Stamped(start), vec![0]) == Arrival::Held).count()
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
        assert_eq!(line.arrive(Stamped(start), vec![0; 10]), Arrival::Held);
        assert_eq!(line.arrive(Stamped(start), vec![0; 10]), Arrival::Held);
        assert_eq!(line.arrive(Stamped(start), vec![0; 10]), Arrival::Overflowed);
        assert!(line.pop_due(start).is_some());
        assert_eq!(line.arrive(Stamped(start), vec![0; 10]), Arrival::Held);

        let mut line = schedule(Impairment::default(), HoldLimit { frames: 100, bytes: 1000 });
        assert_eq!(line.arrive(Stamped(start), vec![0; 600]), Arrival::Held);
        assert_eq!(line.arrive(Stamped(start), vec![0; 600]), Arrival::Overflowed);
        assert_eq!(line.arrive(Stamped(start), vec![0; 400]), Arrival::Held);
        assert!(line.pop_due(start).is_some());
        assert_eq!(line.arrive(Stamped(start), vec![0; 600]), Arrival::Held);
    }

    fn us(micros: u64) -> Duration {
        Duration::from_micros(micros)
    }

    #[test]
    fn a_stamp_is_the_arrival_only_within_its_read_window() {
        let after = Instant::now() + Duration::from_secs(1);
        let window = ReadWindow { after, read: after + ms(2) };
        let read = ArrivalTime::Read { after, read: after + ms(2) };
        assert_eq!(window.arrival(Some(after + ms(1))), Stamped(after + ms(1)));
        assert_eq!(window.arrival(None), read);
        // A sender's departure time, or a time on another clock, lies outside the window.
        assert_eq!(window.arrival(Some(after - ms(1))), read);
        // A frame stamped on arrival may reach the socket a little after a read found it empty.
        assert_eq!(window.arrival(Some(after - us(150))), Stamped(after - us(150)));
        assert_eq!(window.arrival(Some(after - Duration::from_secs(1))), read);
        assert_eq!(window.arrival(Some(after + ms(3))), read);
        // Within the clocks' conversion error, a stamp is taken and clamped to the read.
        assert_eq!(window.arrival(Some(after + ms(2) + us(10))), Stamped(after + ms(2)));
    }

    #[test]
    fn frames_read_in_one_batch_keep_their_stamps_and_leave_in_one_wake_up() {
        let start = Instant::now();
        let mut line = schedule(Impairment { delay: ms(1), ..Impairment::default() }, ROOMY);
        // Ten frames 30 us apart, read together 400 us after the first arrived.
        let window = ReadWindow { after: start, read: start + us(400) };
        for i in 0..10u8 {
            assert_eq!(
                line.arrive(window.arrival(Some(start + us(30 * u64::from(i)))), vec![i]),
                Arrival::Held
            );
        }
        // Sleeping until the oldest is due and a twentieth of the delay more sends two.
        let wake = line.next_wake(window.read).expect("frames held");
        assert_eq!(wake, start + ms(1) + us(50));
        let sent: Vec<Due<Vec<u8>>> = std::iter::from_fn(|| line.pop_due(wake)).collect();
        assert_eq!(sent.iter().map(|due| due.frame[0]).collect::<Vec<_>>(), [0, 1]);
        for due in &sent {
            let arrived = start + us(30 * u64::from(due.frame[0]));
            assert_eq!((due.due, due.lateness_from), (arrived + ms(1), arrived + ms(1)));
        }
        // Stamped frames need no early read: the next wake-up is for the next frame due.
        assert_eq!(line.next_wake(window.read), Some(start + us(60) + ms(1) + us(50)));
    }

    /// Runs a direction's thread in virtual time over frames arriving at `arrivals`, each
    /// stamped or not, as `forward_once` does; returns per frame its true due time, when it
    /// was sent and the time its reported lateness counts from.
    fn drive(
        line: &mut Schedule<Vec<u8>>,
        arrivals: &[Instant],
        stamped: bool,
    ) -> Vec<(Instant, Instant, Instant)> {
        let delay = line.impairment.delay;
        let (mut now, mut last_emptied, mut next_unread) = (arrivals[0], arrivals[0], 0);
        let mut sent = Vec::new();
        for _ in 0..1_000_000 {
            while let Some(due) = line.pop_due(now) {
                let index = u32::from_le_bytes(due.frame[..4].try_into().expect("4 bytes")) as usize;
                sent.push((arrivals[index] + delay, now, due.lateness_from));
            }
            if sent.len() == arrivals.len() {
                return sent;
            }
            // Wake when told, or holding nothing, when the next frame arrives.
            now = line.next_wake(last_emptied).unwrap_or_else(|| arrivals[next_unread]).max(now);
            let window = ReadWindow { after: last_emptied, read: now };
            while next_unread < arrivals.len() && arrivals[next_unread] <= now {
                let stamp = stamped.then_some(arrivals[next_unread]);
                line.arrive(window.arrival(stamp), (next_unread as u32).to_le_bytes().to_vec());
                next_unread += 1;
            }
            last_emptied = now;
        }
        panic!("the thread did not send every frame in a million wake-ups");
    }

    #[test]
    fn lateness_is_bounded_by_the_slack_and_reported_in_full() {
        let start = Instant::now();
        let arrivals: Vec<Instant> = (0..2000).map(|i| start + Duration::from_nanos(i * 17_000)).collect();
        for stamped in [true, false] {
            let mut line = schedule(Impairment { delay: ms(1), ..Impairment::default() }, ROOMY);
            let sent = drive(&mut line, &arrivals, stamped);
            let mut wake_ups: Vec<Instant> = sent.iter().map(|&(_, at, _)| at).collect();
            wake_ups.dedup();
            for (i, &(true_due, sent_at, lateness_from)) in sent.iter().enumerate() {
                assert!(sent_at >= true_due, "frame {i} left before its delay had passed");
                // Stamped: late by the slack at most; unstamped, also read up to a slack late.
                let bound = if stamped { us(50) } else { us(100) };
                assert!(sent_at - true_due <= bound, "frame {i} late by {:?}", sent_at - true_due);
                // The lateness reported never understates the true lateness.
                assert!(lateness_from <= true_due, "frame {i}: lateness counted from after its due time");
            }
            // Frames 17 us apart, sent up to 50 us late: a wake-up sends two or more.
            assert!(
                wake_ups.len() * 2 <= sent.len(),
                "{} wake-ups for {} frames",
                wake_ups.len(),
                sent.len()
            );
        }
    }
}
