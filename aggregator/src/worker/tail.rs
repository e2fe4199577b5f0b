//! A dense job's tail: losses among a thread's last sendings, which nothing later
//! reveals, found by one probe after a short silence.
//!
//! Mid-job, a lost packet shows in round trips: later results overtake it
//! (`early_loss`), the switch's numbers skip it (`sequence`). Once a thread has sent
//! every block of its share once, no later packet of its own will: a lost last
//! contribution, or a result lost after the thread's last broadcast, waits for a slot's
//! timer, a smoothed round trip and four deviations of rounds that waited behind queues
//! and peers (80-110 ms at the emulated 1 % row's 50 Mbit/s, where the path takes 2-5
//! ms). A worker's every thread has such a tail, and a round stalled in one stalls it for
//! every rank. So once the thread is in its tail and has heard nothing for the timeout
//! of the switch's immediate answers (a round trip of the path and four deviations, at
//! least the configured floor), one round of probes asks where all its slots stand, as
//! TCP's tail-loss probe does: the report names every lost result and contribution at
//! once (`recovery`). Once per silence: a report that finds nothing lost means peers are
//! late, which the slots' own timers then wait for.
//!
//! The round goes beside the slots' timers, not as a wait's probe: none waits for its
//! report or is re-armed by it. Taking over a slot's timer, as a wait's probe does, put
//! off recoveries whose answers were overdue, and where one round cannot cover every
//! slot (one-element packets), slots waited behind it for reports that never named
//! them: at 30 % loss, jobs of `tests/stress.rs` took 600-700 ms against a bound of 500.
//! So where one round cannot cover them all, there is no tail probe.

use std::time::{Duration, Instant};

use super::recovery::PROBES_PER_TIMEOUT;
use super::{Contribution, Layout, Send, WorkerProtocol};

/// Where a thread stands in its job's tail.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Tail {
    /// Blocks of the running dense job not yet sent once; none for a sparse job, whose
    /// streams' end each worker's own blocks do not mark.
    unsent: Option<u32>,
    /// When the last of them went out.
    began: Option<Instant>,
    /// The latest result's time whose silence a tail probe already asked about.
    probed_after: Option<Instant>,
}

impl Tail {
    /// The tail of a job of `blocks` laid out as `layout`, not yet begun.
    pub(super) fn of_job(layout: &Layout, blocks: u32) -> Tail {
        let unsent = matches!(layout, Layout::Dense).then_some(blocks);
        Tail { unsent, began: None, probed_after: None }
    }
}

impl WorkerProtocol {
    /// Books `contribution`'s first sending at `now`: the job's last block sent once
    /// begins the tail.
    #[inline]
    pub(super) fn sent_once(&mut self, now: Instant, contribution: Contribution) {
        if contribution.exponent_round {
            return;
        }
        if let Some(unsent) = self.tail.unsent.as_mut() {
            *unsent = unsent.saturating_sub(1);
            if *unsent == 0 && self.tail.began.is_none() {
                self.tail.began = Some(now);
            }
        }
    }

    /// When the tail's silence has lasted long enough to probe: the answers' timeout
    /// after the later of the tail's start and the latest result, unless a probe is out
    /// or this silence was probed already.
    pub(super) fn tail_deadline(&self) -> Option<Instant> {
        let began = self.tail.began?;
        if self.probe.is_some() || self.tail.probed_after == Some(self.last_progress) {
            return None;
        }
        Some(began.max(self.last_progress) + self.answer_timeout()?)
    }

    /// How long the switch's immediate answers may take: their smoothed round trip and
    /// four deviations, from the configured floor to the ceiling.
    fn answer_timeout(&self) -> Option<Duration> {
        let ceiling = self.config.max_retransmit_timeout.max(self.config.retransmit_timeout);
        Some(self.answer_rtt?.timeout(self.config.retransmit_timeout, ceiling))
    }

    /// The tail has been silent past its deadline: one probe per stretch of active
    /// slots asks where they all stand. Beside the slots' timers, which run on as they
    /// were: a recovery's overdue answer is still sent again at its time, and no slot
    /// waits for the report (lost, it would hold them all a backed-off timeout).
    pub(super) fn probe_tail(&mut self) {
        self.tail.probed_after = Some(self.last_progress);
        let bases = self.probe_bases();
        if bases.len() > PROBES_PER_TIMEOUT {
            // One round cannot ask about every slot (reports of a few slots each, as of
            // one-element packets): the timers' rounds take turns over them instead.
            return;
        }
        for base in bases {
            self.pending.push_back((base as u16, Send::TailProbe));
        }
    }
}

#[cfg(test)]
mod tests {
    use netagg_wire::{Flags, MessageType};

    use super::super::testing::{parsed, pending_of, progress_of, result_of, running, sent, Numbers};
    use super::super::JobStatus;
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A thread of 4 one-element slots running a dense job of 8 blocks: its rounds take
    /// 8 ms (a timeout of 24 ms), the switch answers a request in 2 ms (an answers'
    /// timeout of 10 ms, the floor). Slot 1's first result is lost and recovered by a
    /// request; slot 1 then sends the job's last block, and the other slots' last results
    /// come a millisecond later. Returns the thread and slot 1's last contribution.
    fn in_its_tail(start: Instant) -> (WorkerProtocol, Vec<u8>) {
        let mut protocol = running(start, 4, 8, 10 * MS);
        let first = sent(&mut protocol, start);
        for answered in [&first[0], &first[2], &first[3]] {
            protocol.handle_datagram(start + 8 * MS, &result_of(answered), &mut Numbers);
        }
        let second = sent(&mut protocol, start + 8 * MS);
        assert_eq!(second.iter().map(|p| parsed(p).block).collect::<Vec<_>>(), [4, 6, 7]);
        // Overtaken: slot 1 asks for its result once the reorder allowance has passed.
        let (asked_at, asked) = (1..40)
            .map(|ms| start + ms * MS)
            .find_map(|at| {
                protocol.handle_timeout(at);
                Some(sent(&mut protocol, at)).filter(|asked| !asked.is_empty()).map(|asked| (at, asked))
            })
            .unwrap();
        assert!(parsed(&asked[0]).flags.contains(Flags::WANT_RESULT));
        // The switch answers that the round still aggregates, then its result comes.
        let answered_at = asked_at + 2 * MS;
        protocol.handle_datagram(answered_at, &pending_of(&asked[0], true), &mut Numbers);
        protocol.handle_datagram(answered_at, &result_of(&first[1]), &mut Numbers);
        let last = sent(&mut protocol, answered_at);
        assert_eq!((last.len(), parsed(&last[0]).block), (1, 5), "the job's last block");
        for answered in &second {
            protocol.handle_datagram(answered_at + MS, &result_of(answered), &mut Numbers);
        }
        assert!(sent(&mut protocol, answered_at + MS).is_empty());
        (protocol, last.into_iter().next().unwrap())
    }

    /// The last block's result is lost: nothing later reveals it, and the slot's own
    /// timer would probe a timeout of 24 ms after the last result. The thread probes once
    /// its tail has been silent for the answers' timeout, and asks for the result the
    /// report shows lost at once.
    #[test]
    fn a_silent_tail_is_probed_after_the_answers_timeout_and_its_lost_result_asked_for() {
        let start = Instant::now();
        let (mut protocol, last) = in_its_tail(start);
        let last_result_at = protocol.last_progress;
        let probe_at = last_result_at + 10 * MS;
        assert_eq!(protocol.poll_timeout(), Some(probe_at));
        protocol.handle_timeout(probe_at - Duration::from_nanos(1));
        assert!(sent(&mut protocol, probe_at).is_empty(), "not before the answers' timeout");
        protocol.handle_timeout(probe_at);
        let probes = sent(&mut protocol, probe_at);
        let probe = parsed(&probes[0]);
        assert_eq!((probes.len(), probe.message_type, probe.slot), (1, MessageType::Probe, 1));
        // The report: slot 1's round 1 completed, so its result was lost.
        let reported_at = probe_at + 2 * MS;
        protocol.handle_datagram(reported_at, &progress_of(&probes[0], &[2], 0b1), &mut Numbers);
        let asked = sent(&mut protocol, reported_at);
        let request = parsed(&asked[0]);
        assert_eq!(
            (asked.len(), request.message_type, request.slot, request.round),
            (1, MessageType::Ack, 1, 1)
        );
        assert!(request.flags.contains(Flags::WANT_RESULT));
        protocol.handle_datagram(reported_at + 2 * MS, &result_of(&last), &mut Numbers);
        assert_eq!(protocol.status(), &JobStatus::Done);
        assert!(reported_at + 2 * MS < last_result_at + 24 * MS, "done before the slot's timeout");
    }

    /// A report that finds nothing lost (a peer is late) ends the tail probe's part: the
    /// same silence is not probed again, and the slot's timer takes over.
    #[test]
    fn a_silence_is_probed_once() {
        let start = Instant::now();
        let (mut protocol, _) = in_its_tail(start);
        let probe_at = protocol.poll_timeout().unwrap();
        protocol.handle_timeout(probe_at);
        let probes = sent(&mut protocol, probe_at);
        assert_eq!(probes.len(), 1);
        protocol.handle_datagram(probe_at + 2 * MS, &progress_of(&probes[0], &[1], 0b1), &mut Numbers);
        assert!(sent(&mut protocol, probe_at + 2 * MS).is_empty(), "its contribution is in");
        assert_eq!(protocol.tail_deadline(), None, "this silence was probed");
        let next = protocol.poll_timeout().unwrap();
        protocol.handle_timeout(next);
        assert!(sent(&mut protocol, next).is_empty(), "the slot's timer, with results this recent");
    }

    /// A sparse job's streams have no tail a worker's own blocks mark: it never probes
    /// early.
    #[test]
    fn a_sparse_job_has_no_tail() {
        let tail = Tail::of_job(&Layout::Sparse(super::super::BlockMask::new(8)), 8);
        assert_eq!(tail.unsent, None);
        assert_eq!(Tail::of_job(&Layout::Dense, 8).unsent, Some(8));
    }
}
