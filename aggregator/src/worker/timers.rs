//! The slots' retransmission timers, and the round-trip time they follow.
//!
//! The timeout follows the measured round-trip time (RFC 6298's smoothed mean plus four
//! deviations; one packet per round trip is timed, as TCP times one segment, and only
//! while it has been sent once, as Karn's rule says), never below the configured one. A
//! round trip includes waiting for the slowest worker, and a fixed timeout below that
//! makes every worker retransmit rounds that are merely waiting, which slows the switch
//! and the others further: congestion collapse.

use std::cmp::Reverse;
use std::time::{Duration, Instant};

use netagg_wire::PacketRepr;

use super::job::{JobError, JobStatus};
use super::{SlotState, WorkerProtocol};

/// Timeouts beyond a year are taken as a year, so that no deadline can overflow the
/// clock.
pub(super) const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

/// Smoothed round-trip time and its deviation (RFC 6298), in nanoseconds: integer
/// arithmetic, where `Duration`'s costs a normalisation per operation on every result.
/// A lower switch of an aggregation tree times its rounds at the upper switch with it too.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RttEstimate {
    smoothed: u64,
    deviation: u64,
}

impl RttEstimate {
    /// The estimate after round trip `sample`, from `previous` if there is one.
    pub(crate) fn sampled(previous: Option<RttEstimate>, sample: Duration) -> RttEstimate {
        // At most a year, so that no sum below overflows.
        let sample = sample.as_nanos().min(YEAR.as_nanos()) as u64;
        match previous {
            None => RttEstimate { smoothed: sample, deviation: sample / 2 },
            Some(rtt) => {
                let error = sample.abs_diff(rtt.smoothed);
                RttEstimate {
                    smoothed: (rtt.smoothed * 7 + sample) / 8,
                    deviation: (rtt.deviation * 3 + error) / 4,
                }
            }
        }
    }

    /// How long after a later packet's answer a packet's may still come before it is
    /// taken as lost: half the smoothed round trip plus two deviations (see
    /// `early_loss`).
    pub(crate) fn reorder_allowance(&self) -> Duration {
        Duration::from_nanos(self.smoothed / 2 + self.deviation * 2)
    }

    /// The retransmission timeout it gives: the smoothed mean plus four deviations, from
    /// `floor` to `ceiling`.
    pub(crate) fn timeout(&self, floor: Duration, ceiling: Duration) -> Duration {
        Duration::from_nanos(self.smoothed + self.deviation * 4).min(ceiling).max(floor)
    }
}

impl WorkerProtocol {
    /// The smoothed round-trip time measured so far.
    pub fn smoothed_rtt(&self) -> Option<Duration> {
        self.rtt.map(|rtt| Duration::from_nanos(rtt.smoothed))
    }

    /// When [`WorkerProtocol::handle_timeout`] may next have something to do: the
    /// earliest entry of `timers`, which may be before its slot's deadline (entries move
    /// lazily); a wake-up then finds nothing due and moves the entry.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.status != JobStatus::Running {
            return None;
        }
        let job_deadline = self.last_progress + self.config.job_timeout;
        let timer = self.timers.peek().map(|Reverse((at, _))| *at);
        // Asked only with a packet held back: the pacer's lock, which the worker's threads
        // share, is not for every turn of every thread's loop.
        let held = !self.paced.is_empty() || !self.resends.is_empty();
        let paced = if held { self.pacer.ready_at() } else { None };
        [timer, paced].into_iter().flatten().chain([job_deadline]).min()
    }

    /// Fires every timer due at `now`: retransmissions, requests, and the job timeout.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.status != JobStatus::Running {
            return;
        }
        if now.saturating_duration_since(self.last_progress) >= self.config.job_timeout {
            self.fail(JobError::Timeout(self.config.job_timeout));
            return;
        }
        while let Some(index) = self.due_timer(now) {
            self.slot_timed_out(now, index);
        }
    }

    /// The current retransmission timeout of a slot.
    fn retransmit_timeout(&self, slot: &SlotState) -> Duration {
        let base = self.base_timeout;
        if slot.backoff == 0 {
            return base;
        }
        base.saturating_mul(1 << slot.backoff.min(16)).min(self.config.max_retransmit_timeout.max(base))
    }

    /// Takes the round trip that result `repr` of slot `index`, arriving at `now`, ends,
    /// if it answers the timed contribution.
    // Inlined by force into its one caller, which runs per packet: a build of 16 codegen
    // units left it a call (callgrind).
    #[inline(always)]
    pub(super) fn time_round_trip(&mut self, now: Instant, index: u16, repr: &PacketRepr) {
        let Some(timed) = self.timed.filter(|t| t.slot == index && t.round == repr.round) else {
            return;
        };
        self.timed = None;
        let rtt = now.saturating_duration_since(timed.sent);
        if !timed.expired {
            self.sample_rtt(rtt);
        }
        let completed_here = repr.completed_by() == Some(self.config.rank);
        self.pacer.sample(now, rtt, completed_here, &mut self.delivered);
    }

    fn sample_rtt(&mut self, sample: Duration) {
        let rtt = RttEstimate::sampled(self.rtt, sample);
        self.rtt = Some(rtt);
        let ceiling = self.config.max_retransmit_timeout.max(self.config.retransmit_timeout);
        self.base_timeout = rtt.timeout(self.config.retransmit_timeout, ceiling);
    }

    /// Slot `index`'s timed packet, if it is the timed one, no longer measures the path:
    /// its wait is for a loss, its recovery or a peer (Karn's rule, widened).
    pub(super) fn expire_timed(&mut self, index: u16) {
        if let Some(timed) = self.timed.as_mut().filter(|timed| timed.slot == index) {
            timed.expired = true;
        }
    }

    pub(super) fn arm_timer(&mut self, index: u16, now: Instant) {
        let slot = &self.slots[index as usize];
        let timeout = self.retransmit_timeout(slot);
        // Timers armed together would fire together; a path paced at a measured rate
        // spreads them at the rate its results come at.
        let deadline = self.pacer.retry_at(now + timeout, timeout, self.paced_len());
        self.set_deadline(index, deadline);
    }

    /// Slot `index`'s timer fires at `deadline`, earlier or later than it would have.
    pub(super) fn set_deadline(&mut self, index: u16, deadline: Instant) {
        let slot = &mut self.slots[index as usize];
        slot.deadline = Some(deadline);
        if slot.queued.is_none_or(|queued| deadline < queued) {
            slot.queued = Some(deadline);
            self.timers.push(Reverse((deadline, index)));
        }
    }

    pub(super) fn clear_timers(&mut self) {
        self.timers.clear();
        for slot in &mut self.slots {
            slot.deadline = None;
            slot.queued = None;
        }
    }

    /// The next slot whose timer is due at `now`. Entries come off the heap only once
    /// due: a superseded one is dropped, and one whose slot was re-armed since moves to its
    /// slot's deadline, so a slot costs a heap operation per timeout, not per send.
    fn due_timer(&mut self, now: Instant) -> Option<u16> {
        while let Some(&Reverse((at, index))) = self.timers.peek() {
            if at > now {
                return None;
            }
            self.timers.pop();
            let slot = &mut self.slots[index as usize];
            if slot.queued != Some(at) {
                continue;
            }
            slot.queued = None;
            match slot.deadline {
                Some(deadline) if slot.active && deadline <= now => return Some(index),
                Some(deadline) if slot.active => {
                    slot.queued = Some(deadline);
                    self.timers.push(Reverse((deadline, index)));
                }
                // Off the heap now: an inactive slot keeps no timer to re-arm later.
                _ => slot.deadline = None,
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use netagg_wire::{ElementType, Flags, Packet};

    use super::super::testing::{measured_path, pending_of, result_of, running, sent, Numbers};
    use super::super::{Delivery, JobSpec, Layout};
    use super::*;

    #[test]
    fn one_packet_per_round_trip_is_timed() {
        let start = Instant::now();
        let mut protocol = running(start, 4, 8, Duration::from_millis(1));
        let first = sent(&mut protocol, start);
        assert_eq!(first.len(), 4);
        // The first packet's result after 50 ms, the others' after 90 ms: only the first
        // was timed.
        let ms = Duration::from_millis;
        protocol.handle_datagram(start + ms(50), &result_of(&first[0]), &mut Numbers);
        for packet in &first[1..] {
            protocol.handle_datagram(start + ms(90), &result_of(packet), &mut Numbers);
        }
        assert_eq!(protocol.smoothed_rtt(), Some(ms(50)));
        // The next packet sent is timed: 10 ms, weighed in at RFC 6298's 1/8.
        let second = sent(&mut protocol, start + ms(90));
        assert_eq!(second.len(), 4);
        for packet in second.iter().rev() {
            protocol.handle_datagram(start + ms(100), &result_of(packet), &mut Numbers);
        }
        assert_eq!(protocol.smoothed_rtt(), Some(ms(45)));
        assert_eq!(protocol.status(), &JobStatus::Done);
    }

    #[test]
    fn timers_armed_together_behind_a_measured_rate_fire_a_result_s_time_apart() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let config = super::super::testing::config(4, timeout);
        // Results at about 250 MB/s: a result's time is 2 µs at the rate.
        let pacer = measured_path(start, 1_000);
        let mut protocol = WorkerProtocol::with_pacer(config, start, pacer.clone());
        let job = JobSpec {
            job: 1,
            element_type: ElementType::Int32,
            elements: 8,
            layout: Layout::Dense,
            exponents: false,
        };
        protocol.start_job(start, job).unwrap();
        assert_eq!(sent(&mut protocol, start).len(), 4, "within the pacer's quantum");
        // Armed at one instant, the four slots' first timers are due a result's time apart.
        let spacing = Duration::from_nanos(1_000 * 1_000_000_000 / pacer.rate().unwrap());
        let deadlines: Vec<Option<Instant>> = protocol.slots.iter().map(|slot| slot.deadline).collect();
        let expected: Vec<Option<Instant>> =
            (0..4).map(|turn| Some(start + timeout + spacing * turn)).collect();
        assert_eq!(deadlines, expected);
        assert_eq!(protocol.poll_timeout(), Some(start + timeout));
    }

    #[test]
    fn a_retransmitted_packet_is_not_timed() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let mut protocol = running(start, 1, 2, timeout);
        let first = sent(&mut protocol, start);
        protocol.handle_timeout(start + timeout);
        let again = sent(&mut protocol, start + timeout);
        assert_eq!(again.len(), 1, "retransmitted");
        protocol.handle_datagram(start + timeout * 2, &result_of(&first[0]), &mut Numbers);
        assert_eq!(protocol.smoothed_rtt(), None, "either copy may have been answered");
        let later = start + timeout * 3;
        let second = sent(&mut protocol, later);
        protocol.handle_datagram(later + Duration::from_millis(3), &result_of(&second[0]), &mut Numbers);
        assert_eq!(protocol.smoothed_rtt(), Some(Duration::from_millis(3)), "the next one is");
    }

    #[test]
    fn another_slots_retransmission_leaves_the_timed_packet_timed() {
        let start = Instant::now();
        let (ms, timeout) = (Duration::from_millis, Duration::from_millis(10));
        let mut protocol = running(start, 3, 6, timeout);
        let first = sent(&mut protocol, start);
        protocol.handle_datagram(start + ms(1), &result_of(&first[0]), &mut Numbers);
        assert_eq!(protocol.smoothed_rtt(), Some(ms(1)));
        // Slot 0's next block is timed. Slot 2's result shows slot 1's packet, sent
        // before slot 2's, lost: it times out, asks, learns the switch lacks it, and
        // sends it again.
        protocol.handle_datagram(start + ms(1), &result_of(&first[2]), &mut Numbers);
        let timed = sent(&mut protocol, start + ms(1));
        protocol.handle_timeout(start + timeout);
        let asked = sent(&mut protocol, start + timeout);
        protocol.handle_datagram(start + timeout, &pending_of(&asked[0], false), &mut Numbers);
        let again = sent(&mut protocol, start + timeout);
        assert_eq!((timed.len(), asked.len(), again.len()), (2, 1, 1));
        let resent = PacketRepr::parse(&Packet::new_checked(&again[0][..]).unwrap());
        assert_eq!((resent.block, resent.flags), (1, Flags::RETRANSMISSION));
        protocol.handle_datagram(start + timeout + ms(1), &result_of(&timed[0]), &mut Numbers);
        // (7 · 1 ms + 10 ms) / 8
        assert_eq!(protocol.smoothed_rtt(), Some(Duration::from_micros(2125)));
    }

    #[test]
    fn a_result_after_its_deadline_releases_the_next_block_without_a_retransmission() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let mut protocol = running(start, 1, 2, timeout);
        let mut buffer = vec![0; 64];
        let len = protocol.poll_transmit(start, &mut buffer, &mut Numbers).unwrap();
        let first = buffer[..len].to_vec();

        // The result arrives after the timer's deadline, and the timers run before the
        // next block goes out, as a worker thread's loop runs them.
        let late = start + timeout * 2;
        let delivery = protocol.handle_datagram(late, &result_of(&first), &mut Numbers);
        assert_eq!(delivery, Delivery::Accepted);
        protocol.handle_timeout(late);
        let len = protocol.poll_transmit(late, &mut buffer, &mut Numbers).unwrap();
        let second = PacketRepr::parse(&Packet::new_checked(&buffer[..len]).unwrap());
        assert_eq!((second.block, second.flags), (1, Flags::NONE));
        assert_eq!(protocol.poll_transmit(late, &mut buffer, &mut Numbers), None, "sent once");
        assert_eq!((protocol.counters().retransmissions, protocol.counters().timeouts), (0, 0));
    }

    #[test]
    fn a_packet_queued_behind_results_still_coming_is_timed_past_the_timeout() {
        // The timeout learns a queue: slot 0's second packet waits 14 ms, past the 10 ms
        // timeout, while slot 1's result shows the path still delivering in order.
        let start = Instant::now();
        let (ms, timeout) = (Duration::from_millis, Duration::from_millis(10));
        let mut protocol = running(start, 2, 4, timeout);
        let first = sent(&mut protocol, start);
        protocol.handle_datagram(start + ms(1), &result_of(&first[0]), &mut Numbers);
        let second = sent(&mut protocol, start + ms(1));
        protocol.handle_datagram(start + ms(9), &result_of(&first[1]), &mut Numbers);
        sent(&mut protocol, start + ms(9));
        protocol.handle_timeout(start + ms(11));
        assert!(sent(&mut protocol, start + ms(11)).is_empty(), "queued, not lost");
        protocol.handle_datagram(start + ms(15), &result_of(&second[0]), &mut Numbers);
        // (7 · 1 ms + 14 ms) / 8
        assert_eq!(protocol.smoothed_rtt(), Some(Duration::from_micros(2625)));
    }
}
