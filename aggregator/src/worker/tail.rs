//! A job's tail: losses that no later packet reveals, found by one probe after a short
//! silence rather than by the slots' timers.
//!
//! Within a job, a lost contribution or result shows in the packets after it: a gap in
//! the numbers (`sequence`), a later sending's result overtaking it (`early_loss`). A
//! thread's last sendings of a job have nothing after them, so their losses waited for
//! the slots' timers, which learn the round trips of a window waiting for peers (40-100
//! ms on the 1 % row's 50 Mbit/s links, where the switch answers in a few), and then for
//! a probe's round trip. So once a thread has sent every block of the job and no result
//! has come for the answers' timeout (the switch's own round trip plus four
//! deviations, `early_loss`), it probes at once, as TCP's tail-loss probe does after two
//! round trips of silence: the report names every lost result and every contribution the
//! switch lacks, and they go at once.
//!
//! One round of probes a job, beside the slots' timers, whose waits it changes only by
//! what its reports find: if they find nothing lost, the peers are late, and the timers
//! probe on as they would have. (Taken as the first round of the thread's wait, which
//! defers the slots' timers, and once per silence, it made one cluster of 130 one-element
//! slots at 30 % loss send ten times the probes and take 20 times as long,
//! `tests/stress.rs`.) A thread that has not measured the answers' round trip, having
//! never needed a recovery, sends none.

use std::time::Instant;

use super::{Send, WorkerProtocol};

impl WorkerProtocol {
    /// When the tail probe goes if no result comes first: the answers' timeout after the
    /// latest result, once every block of the job has gone out, once a job, while no
    /// probe of a waiting thread is out; each silence is judged once.
    #[inline]
    pub(super) fn tail_probe_at(&self) -> Option<Instant> {
        let silence = self.answer_timeout?;
        let job = self.job.as_ref()?;
        let unjudged = !self.tail_probed
            && self.blocks_sent >= job.blocks
            && self.probe.is_none()
            && self.tail_judged != Some(self.last_progress);
        unjudged.then(|| self.last_progress + silence)
    }

    /// The silence since the latest result has lasted the answers' timeout, after the
    /// job's last blocks went out: the thread probes, unless it has something to send.
    pub(super) fn tail_timed_out(&mut self) {
        self.tail_judged = Some(self.last_progress);
        let queued = !self.pending.is_empty() || !self.paced.is_empty() || !self.resends.is_empty();
        if queued {
            return;
        }
        self.queue_probes(Send::TailProbe);
        self.tail_probed = true;
        self.counters.tail_probes += 1;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use netagg_wire::{Flags, MessageType};

    use super::super::testing::{
        next_sending, parsed, pending_of, progress_of, result_of, running, sent, Numbers,
    };
    use super::*;

    const FLOOR: Duration = Duration::from_millis(10);
    const MS: Duration = Duration::from_millis(1);

    /// A thread of 4 slots running a dense job of 8 blocks, first window at `start`. Slot
    /// 0's result at 8 ms (a timeout of 24 ms) releases block 4; slot 2's at 11 ms
    /// releases block 6 and shows slot 1's contribution overtaken: its request at 23 ms
    /// is answered at 27 ms (held), the answers' round trip 4 ms and their timeout 12 ms.
    /// Slots 1's and 3's results at 30 ms release the last blocks, 5 and 7, and the
    /// results of blocks 4 and 6 come at 35 ms. Returns the thread and the packets of
    /// blocks 5 and 7, whose results and contributions nothing later can show lost.
    fn in_its_tail(start: Instant) -> (WorkerProtocol, Vec<Vec<u8>>) {
        let mut protocol = running(start, 4, 8, FLOOR);
        let first = sent(&mut protocol, start);
        protocol.handle_datagram(start + 8 * MS, &result_of(&first[0]), &mut Numbers);
        let block4 = sent(&mut protocol, start + 8 * MS);
        protocol.handle_timeout(start + 10 * MS);
        protocol.handle_datagram(start + 11 * MS, &result_of(&first[2]), &mut Numbers);
        let block6 = sent(&mut protocol, start + 11 * MS);
        let (asked_at, asked) = next_sending(&mut protocol);
        assert_eq!(asked_at, start + 23 * MS);
        assert_eq!(parsed(&asked[0]).flags, Flags::WANT_RESULT);
        protocol.handle_datagram(start + 27 * MS, &pending_of(&asked[0], true), &mut Numbers);
        assert_eq!(protocol.answer_timeout, Some(12 * MS));
        let mut last = Vec::new();
        for packet in [&first[1], &first[3]] {
            protocol.handle_datagram(start + 30 * MS, &result_of(packet), &mut Numbers);
            last.extend(sent(&mut protocol, start + 30 * MS));
        }
        assert_eq!(last.iter().map(|p| parsed(p).block).collect::<Vec<_>>(), [5, 7]);
        for packet in [&block4[0], &block6[0]] {
            protocol.handle_datagram(start + 35 * MS, &result_of(packet), &mut Numbers);
        }
        assert!(sent(&mut protocol, start + 35 * MS).is_empty());
        (protocol, last)
    }

    #[test]
    fn a_thread_that_sent_its_last_contributions_probes_after_the_answers_timeout_of_silence() {
        let start = Instant::now();
        let (mut protocol, last) = in_its_tail(start);
        // 12 ms after the latest result, long before the slots' timers: a probe for each
        // waiting slot (a report covers one slot of one element).
        let (probe_at, probes) = next_sending(&mut protocol);
        assert_eq!(probe_at, start + 47 * MS);
        let probed: Vec<_> = probes.iter().map(|p| (parsed(p).message_type, parsed(p).slot)).collect();
        assert_eq!(probed, [(MessageType::Probe, 1), (MessageType::Probe, 3)]);
        // Slot 1's round 1 lacks this worker's contribution; slot 3's has completed.
        let now = probe_at + 4 * MS;
        protocol.handle_datagram(now, &progress_of(&probes[0], &[1], 0), &mut Numbers);
        protocol.handle_datagram(now, &progress_of(&probes[1], &[2], 0), &mut Numbers);
        let recovery: Vec<_> =
            sent(&mut protocol, now).iter().map(|p| parsed(p)).map(|p| (p.slot, p.round, p.flags)).collect();
        assert_eq!(recovery, [(1, 1, Flags::RETRANSMISSION), (3, 1, Flags::WANT_RESULT)]);
        for packet in &last {
            protocol.handle_datagram(now + 4 * MS, &result_of(packet), &mut Numbers);
        }
        assert_eq!(protocol.status(), &crate::worker::JobStatus::Done);
        let counters = protocol.counters();
        assert_eq!((counters.tail_probes, counters.probes, counters.timeouts), (1, 2, 1));
    }

    #[test]
    fn a_tail_probe_that_finds_nothing_lost_leaves_the_next_probes_to_the_timers() {
        let start = Instant::now();
        let (mut protocol, _) = in_its_tail(start);
        let (probe_at, probes) = next_sending(&mut protocol);
        assert_eq!(probe_at, start + 47 * MS);
        // Both contributions are in: the peers are late.
        let now = probe_at + 4 * MS;
        for probe in &probes {
            protocol.handle_datagram(now, &progress_of(probe, &[1], 1), &mut Numbers);
        }
        assert!(sent(&mut protocol, now).is_empty());
        // No second tail probe: the next probes go a timeout after the tail probe, from
        // which the probed slots' timers run.
        let (at, again) = next_sending(&mut protocol);
        assert_eq!(at, probe_at + protocol.base_timeout);
        assert!(again.iter().all(|p| parsed(p).message_type == MessageType::Probe), "{again:?}");
        assert_eq!((protocol.counters().tail_probes, protocol.counters().probes), (1, 4));
    }

    #[test]
    fn a_silence_before_the_last_contributions_or_without_a_measured_answer_sends_no_tail_probe() {
        // Slots 1 and 3 have blocks to send after the ones out, and the latest result came
        // at 11 ms: past the answers' timeout of silence, nothing.
        let start = Instant::now();
        let mut protocol = running(start, 4, 8, FLOOR);
        let first = sent(&mut protocol, start);
        protocol.handle_datagram(start + 8 * MS, &result_of(&first[0]), &mut Numbers);
        protocol.handle_timeout(start + 10 * MS);
        protocol.handle_datagram(start + 11 * MS, &result_of(&first[2]), &mut Numbers);
        sent(&mut protocol, start + 11 * MS);
        let (_, asked) = next_sending(&mut protocol);
        protocol.handle_datagram(start + 27 * MS, &pending_of(&asked[0], true), &mut Numbers);
        assert_eq!(protocol.answer_timeout, Some(12 * MS));
        protocol.handle_timeout(start + 28 * MS);
        assert!(sent(&mut protocol, start + 28 * MS).is_empty());
        assert!(protocol.poll_timeout().is_some_and(|at| at > start + 28 * MS));
        assert_eq!(protocol.counters().tail_probes, 0);
        // A thread that never needed a recovery: its last window goes unanswered until
        // its slots' timers probe, a timeout after the latest result.
        let mut lossless = running(start, 4, 4, FLOOR);
        let first = sent(&mut lossless, start);
        lossless.handle_datagram(start + 3 * MS, &result_of(&first[0]), &mut Numbers);
        assert_eq!(lossless.answer_timeout, None);
        let (at, probes) = next_sending(&mut lossless);
        assert_eq!(at, start + 3 * MS + FLOOR);
        assert!(probes.iter().all(|p| parsed(p).message_type == MessageType::Probe));
        assert_eq!(lossless.counters().tail_probes, 0);
    }
}
