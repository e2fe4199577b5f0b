//! Loss detection and recovery: what a slot whose timer fires sends, and what the
//! switch's pending notices tell it.
//!
//! Loss is recovered by per-slot timers with exponential backoff. When a slot's timer
//! fires, the worker first asks whether anything points to a loss: a result of a packet
//! sent *after* the slot's (the switch has moved on without it, as TCP's RACK reasons;
//! for a slot with nothing outstanding, or one of a sparse job, only while its path is
//! seen losing), or a gap in the slot's results. If so, an outstanding contribution is sent again (at the
//! first timeout, while peers' contributions complete the rounds, the slot asks first
//! whether the switch holds it: the round may wait on a peer's loss), and a slot with
//! nothing outstanding, or missing a result, asks for the first round it lacks.
//! If not, the whole thread is waiting, for a late peer or for results lost at the job's
//! end: then one header-only *probe* per 64 slots (8 a timeout at most) asks where the
//! active slots stand; other timers wait for the answers rather than resend a window. The
//! switch's *progress report* gives each slot's open round and whether this worker's
//! contribution is in it: every lost result is asked for and every lost contribution sent
//! at once, one round trip after the probe. The switch answers a request or a repeated
//! contribution for a round still aggregating with a *pending* notice saying whether this
//! worker's contribution is in; a slot known to be in is never sent again, and one the
//! switch lacks is sent at once. Any result ends the wait, and the waiting slots' timers
//! start afresh. A job with no progress for `job_timeout` fails.

use std::time::Instant;

use netagg_wire::packet::{progress_slots, ELEMENT_LEN};
use netagg_wire::{Flags, PacketRepr};

use super::{Probe, Send, SlotState, WorkerProtocol};
use crate::round::is_after;

/// Most probes one timeout of the probing slot sends, so at most this many go out per
/// round trip however many slots a thread has: where reports cover few slots (short
/// packets; one slot each at one element), a probe per stretch of them was a probe per
/// slot, every timeout of a wait. Rounds take turns over the stretches past this many.
/// Eight cover 512 slots of the default 256-element packets.
const PROBES_PER_TIMEOUT: usize = 8;

impl SlotState {
    /// Whether the slot lacks the result of `round`, one of the 64 after `have` (a result
    /// further ahead it could not take).
    pub(super) fn lacks(&self, round: u32) -> bool {
        let offset = round.wrapping_sub(self.have);
        match offset {
            1 => true,
            2..=64 => self.ahead & 1 << (offset - 2) == 0,
            _ => false,
        }
    }

    /// What the slot sends to recover from a loss: its contribution again, unless it has
    /// none or the switch said it holds it; then a request for the first result it lacks.
    fn recovery(&self) -> Send {
        match self.outstanding {
            Some(c) if self.held != Some(c.round) => Send::Data { retransmission: Some(c.round) },
            _ => Send::Request { round: self.have.wrapping_add(1) },
        }
    }
}

impl WorkerProtocol {
    /// Acts on slot `index`'s timer, due at `now`: the slot waits on while results still
    /// come in order or a probe speaks for it, probes while the whole thread waits, and
    /// recovers once something points to a loss.
    pub(super) fn slot_timed_out(&mut self, now: Instant, index: u16) {
        let slot = &mut self.slots[index as usize];
        slot.deadline = None;
        if slot.paced || slot.silent_turn.is_some() {
            // Its contribution was never sent, or its wait has not begun: the pacer's
            // turn arms the timer.
            return;
        }
        let loss_evident = self.loss_evident(index);
        let slot = &mut self.slots[index as usize];
        if !loss_evident && self.probe.is_some_and(|probe| probe.slot != index) {
            // The probe's answer speaks for this slot too: wait for it.
            slot.deferred = true;
            self.expire_timed(index);
            return;
        }
        if !loss_evident && now.saturating_duration_since(self.last_progress) < self.base_timeout {
            // Results are still coming, in the order their packets went out: this
            // slot's is queued behind them, not lost. A timed packet's round trip then
            // measures the queue, which the timeout must learn. The timer runs from the
            // latest result, not from now: were that the last before a lost tail, the
            // wait would otherwise be nearly two timeouts.
            self.arm_timer(index, self.last_progress);
            return;
        }
        // Past this point the wait is for a loss, its recovery or a late peer.
        self.expire_timed(index);
        self.counters.timeouts += 1;
        if loss_evident {
            self.recover(now, index);
        } else {
            self.send_probe(now, index);
        }
    }

    /// Whether something points to a loss in slot `index`'s wait: a gap in its results,
    /// or a result of a packet sent after its wait began (the switch moved on without
    /// it, as RACK reasons).
    ///
    /// A silent slot (nothing of its own outstanding, as in a sparse round of others'
    /// blocks) waits for its peers' contributions, whose rounds complete in no relation
    /// to this thread's sendings: later results come while it only waits, and on a clean
    /// path its request mostly crossed its result on the way, which the switch then sent
    /// again. Behind 1 ms links at 50 Mbit/s those answers took a quarter of each
    /// downlink in a sparse job of 4 workers. So a silent slot takes that evidence only
    /// while its path is seen losing (`BroadcastGaps::losing`); on a clean one it waits
    /// on while results come, and probes once they stop. Never taking it, its lost
    /// results waited for gaps or probes: at 15 % loss, sparse jobs took about twice as
    /// long (benches/RESULTS.md, "Silent slots judged by ordering only while their path
    /// loses").
    ///
    /// A sparse round this thread contributes to is no different: it completes when the
    /// last of the peers holding its block contributes, each when the result naming that
    /// block reaches it, so its result comes back out of this thread's order of sending
    /// by as much as the peers' receptions differ. Taking the ordering's evidence there,
    /// each worker of that job asked after a hundred rounds a job that were only
    /// waiting, or whose result was on its way (benches/RESULTS.md, "Sparse time follows
    /// bytes at N = 4 (issue 29, item 3, branch sparse6): false losses traced").
    fn loss_evident(&self, index: u16) -> bool {
        let slot = &self.slots[index as usize];
        let endpoint = &self.endpoints[slot.endpoint];
        let overtaken = endpoint.latest_answered.is_some_and(|answered| answered > slot.waiting_since);
        slot.ahead != 0 || (overtaken && self.order_speaks(index))
    }

    /// Whether slot `index` takes a result of a later sending as evidence of its loss:
    /// with a contribution of a dense job out, always; else only while its path is seen
    /// losing ([`WorkerProtocol::loss_evident`] says why).
    pub(super) fn order_speaks(&self, index: u16) -> bool {
        let slot = &self.slots[index as usize];
        (slot.outstanding.is_some() && !self.sparse_job())
            || self.endpoints[slot.endpoint].gaps.losing(slot.waiting_since)
    }

    /// Nothing answered since slot `index` sent: the thread waits, most likely for a late
    /// peer, or for results lost at the job's end, which no later packet reveals. One
    /// header-only probe per 64 slots asks the switch where every active slot stands, as
    /// TCP's tail-loss probe elicits what the receiver lacks, rather than a window of
    /// retransmissions or a timeout per lost result; at most [`PROBES_PER_TIMEOUT`] of
    /// them, from where the wait's last probes left off.
    fn send_probe(&mut self, now: Instant, index: u16) {
        // The first slot of each stretch of active slots that one report covers.
        let stretch = progress_slots(self.config.packet_elements);
        let (mut bases, mut covered) = (Vec::new(), 0);
        for base in 0..self.slots.len() {
            if base >= covered && self.slots[base].active {
                bases.push(base);
                // A report covers only its switch's slots: the next switch's get a probe
                // of their own.
                covered = (base + stretch).min(self.local_owner_end(base as u16));
            }
        }
        let (count, from) = match self.probe {
            Some(probe) => (probe.count + 1, usize::from(probe.next)),
            // A wait's first probes start at the slot that waited latest: a result its
            // report finds lost, once asked for, is evidence of loss for every slot that
            // waited since earlier (`early_loss`), found in round trips.
            None => {
                let active = (0..self.slots.len()).filter(|&at| self.slots[at].active);
                (1, active.max_by_key(|&at| self.slots[at].waiting_since).unwrap_or(0))
            }
        };
        // Where one round covers every stretch, it goes in their order.
        let first = if bases.len() > PROBES_PER_TIMEOUT {
            bases.iter().rposition(|&base| base <= from).unwrap_or(0)
        } else {
            0
        };
        let probed = bases.len().min(PROBES_PER_TIMEOUT);
        for &base in bases.iter().cycle().skip(first).take(probed) {
            self.pending.push_back((base as u16, Send::Probe));
        }
        let next = bases.iter().cycle().nth(first + probed).map_or(0, |&base| base as u16);
        self.probe = Some(Probe { slot: index, count, next });
        let probing = &mut self.slots[index as usize];
        probing.deferred = false;
        probing.backoff = count;
        // The round trip under way measures the late peer, not the path.
        self.timed = None;
        self.arm_timer(index, now);
    }

    /// Slot `index` has evidence of a loss: it backs off and queues its recovery.
    fn recover(&mut self, now: Instant, index: u16) {
        self.slots[index as usize].backoff += 1;
        if self.probe.is_some_and(|probe| probe.slot == index) {
            // The probing slot itself has evidence now: the thread no longer waits as
            // a whole, and the slots put off behind the probe must not wait for it.
            self.end_wait(now);
        }
        let slot = &self.slots[index as usize];
        let recovery = match slot.recovery() {
            // At the first timeout, while peers complete the rounds, ask whether the
            // switch holds the contribution rather than send it again: a round stalls
            // on one worker's loss, and the others, whose contributions are in, would
            // each send theirs twice. The answer says which; the one that lost its
            // packet sends it then, a round trip later than at once. A worker whose
            // contributions complete the rounds (the last to arrive, or alone) has the
            // stalled round waiting on itself, and sends again at once.
            Send::Data { .. }
                if self.peers_complete
                    && slot.backoff == 1
                    && slot.outstanding.is_some_and(|c| c.round == slot.have.wrapping_add(1)) =>
            {
                Send::Request { round: slot.have.wrapping_add(1) }
            }
            recovery => recovery,
        };
        self.pending.push_back((index, recovery));
        if matches!(recovery, Send::Data { .. }) && slot.ahead != 0 {
            // A gap in its results too: ask for the first it lacks.
            self.pending.push_back((index, Send::Request { round: slot.have.wrapping_add(1) }));
        }
        // The timer runs from now, not only from the sending: a retransmission may
        // wait for the pacer, and be dropped there if the switch meanwhile says it
        // holds the contribution; the slot must not be left without a timer.
        self.arm_timer(index, now);
    }

    /// Takes the switch's word that round `notice.round` of a slot is still aggregating
    /// (unasked, without `CONTRIBUTED`: that it has room again for the contribution it
    /// refused).
    pub(super) fn take_pending(&mut self, now: Instant, index: u16, notice: &PacketRepr) {
        self.answered(now, index);
        let slot = &mut self.slots[index as usize];
        // About a round this slot is not contributing to: it waits for others, as it knew.
        let Some(contribution) = slot.outstanding.filter(|c| c.round == notice.round) else {
            return;
        };
        if notice.flags.contains(Flags::CONTRIBUTED) {
            slot.held = Some(contribution.round);
            // It waits for a peer's repair now, on its regular timer.
            self.arm_timer(index, now);
        } else if slot.held != Some(contribution.round) && !slot.paced {
            // Lost on the way: send it now. The thread was not (only) waiting for a late
            // peer, so the slots put off behind a probe may have lost theirs too.
            self.pending.push_back((index, Send::Data { retransmission: Some(contribution.round) }));
            self.end_wait(now);
        }
    }

    /// Acts on a progress report about the slots from `index` on, whose open rounds are
    /// `open_rounds`. Of the slots that waited since before the probe, one whose awaited
    /// round has completed lost its result and asks for it; one whose contribution the
    /// switch lacks lost it and sends it again; one whose contribution is in never sends
    /// it again. All at once: a tail of lost results costs one round trip.
    pub(super) fn take_progress(
        &mut self,
        now: Instant,
        index: u16,
        report: &PacketRepr,
        open_rounds: &[u8],
    ) {
        // The probe carried the thread's transmissions before it, as its packet id.
        let probed = report.packet_id;
        let contributions = report.contributions();
        let mut recovered = false;
        // Past its switch's slots, a report speaks of slots that switch never sees.
        let owned = self.local_owner_end(index) - usize::from(index);
        for (offset, open_round) in open_rounds.chunks_exact(ELEMENT_LEN).take(owned).enumerate() {
            let open_round = u32::from_le_bytes([open_round[0], open_round[1], open_round[2], open_round[3]]);
            let at = index as usize + offset;
            let Some(slot) = self.slots.get_mut(at) else {
                break;
            };
            // A wait that began after the probe left may not show at the switch yet.
            if !slot.active || slot.paced || is_after(slot.waiting_since as u32, probed) {
                continue;
            }
            let awaited = slot.have.wrapping_add(1);
            if is_after(open_round, awaited) {
                // Every round before the open one has completed: each result the slot
                // lacks was lost (a silent worker's stream may have moved on several).
                let lost = (0..open_round.wrapping_sub(awaited).min(64)).map(|i| awaited.wrapping_add(i));
                for round in lost.filter(|&round| slot.lacks(round)) {
                    self.pending.push_back((at as u16, Send::Request { round }));
                }
            } else if let Some(c) = slot.outstanding.filter(|c| c.round == awaited && c.round == open_round) {
                let contributed = contributions & 1 << offset != 0;
                slot.held = contributed.then_some(c.round);
                if contributed {
                    continue;
                }
                self.pending.push_back((at as u16, Send::Data { retransmission: Some(c.round) }));
            } else {
                // Its round waits for peers, as the slot knew.
                continue;
            }
            self.slots[at].deferred = false;
            // Its timer may have fired while deferred: it runs again from now, as after
            // any recovery queued (see `slot_timed_out`).
            self.arm_timer(at as u16, now);
            recovered = true;
        }
        if recovered {
            let endpoint = self.slots[usize::from(index)].endpoint;
            self.endpoints[endpoint].gaps.loss_seen(self.transmissions);
            // A loss, not (only) a late peer: the slots not covered may have lost theirs too.
            self.end_wait(now);
        }
    }

    /// The first of this thread's slot indices past `index` whose switch is another
    /// than `index`'s (the thread's slot count where none is).
    fn local_owner_end(&self, index: u16) -> usize {
        let base = usize::from(self.config.slot_base);
        let end = self.config.keys.owner_end(self.config.slot_base.wrapping_add(index));
        end.saturating_sub(base).min(self.slots.len())
    }

    /// Ends the thread's wait behind a probe, on progress or on evidence of a loss: the
    /// slots whose timers were put off behind the probe get their timers back, from now.
    pub(super) fn end_wait(&mut self, now: Instant) {
        self.probe = None;
        for index in 0..self.slots.len() {
            let slot = &mut self.slots[index];
            if std::mem::take(&mut slot.deferred) && slot.active && !slot.paced {
                self.arm_timer(index as u16, now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use netagg_wire::packet::{CHECKSUM_LEN, HEADER_LEN};
    use netagg_wire::{MessageType, Packet};

    use super::super::{Delivery, WorkerConfig};

    use super::super::testing::{
        config, numbered, parsed, pending_of, progress_of, result_of, running, running_sparse, sent,
        sparse_result, Numbers,
    };
    use super::super::{JobSpec, JobStatus, Layout};
    use super::*;

    /// A thread of 4 slots of 8-element blocks, whose progress reports cover 8 slots,
    /// running a dense job of 8 blocks; every packet of its first window sent.
    fn probing_thread(start: Instant, timeout: Duration) -> (WorkerProtocol, Vec<Vec<u8>>) {
        let config = WorkerConfig { packet_elements: 8, ..config(4, timeout) };
        let mut protocol = WorkerProtocol::new(config, start);
        let job = JobSpec {
            job: 1,
            element_type: netagg_wire::ElementType::Int32,
            elements: 64,
            layout: Layout::Dense,
            exponents: false,
        };
        protocol.start_job(start, job).unwrap();
        let first = sent(&mut protocol, start);
        assert_eq!(first.len(), 4);
        (protocol, first)
    }

    #[test]
    fn results_lost_at_the_end_are_all_asked_for_after_one_probe_even_if_probes_are_lost() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let (mut protocol, first) = probing_thread(start, timeout);
        for packet in &first {
            protocol.handle_datagram(start, &result_of(packet), &mut Numbers);
        }
        let last = sent(&mut protocol, start);
        assert_eq!(last.iter().map(|p| parsed(p).block).collect::<Vec<_>>(), [4, 5, 6, 7]);
        // Every result of the last window is lost: nothing shows it, and one timeout
        // later the thread sends one probe about all four slots.
        protocol.handle_timeout(start + timeout);
        let probe = sent(&mut protocol, start + timeout);
        assert_eq!(probe.len(), 1);
        let asked = parsed(&probe[0]);
        assert_eq!(
            (asked.message_type, asked.slot, asked.buffer_len()),
            (MessageType::Probe, 0, HEADER_LEN + CHECKSUM_LEN)
        );
        // The probe is lost: the next goes out after twice the timeout, not before.
        let before = start + timeout * 3 - Duration::from_micros(1);
        protocol.handle_timeout(before);
        assert!(sent(&mut protocol, before).is_empty());
        protocol.handle_timeout(start + timeout * 3);
        let probe = sent(&mut protocol, start + timeout * 3);
        assert_eq!(probe.len(), 1);
        // Its report: every slot's round 1 has completed. All four ask at once.
        let now = start + timeout * 3;
        protocol.handle_datagram(now, &progress_of(&probe[0], &[2, 2, 2, 2], 0), &mut Numbers);
        let requests = sent(&mut protocol, now);
        let rounds: Vec<_> =
            requests.iter().map(|p| (parsed(p).message_type, parsed(p).slot, parsed(p).round)).collect();
        assert_eq!(rounds, (0..4).map(|slot| (MessageType::Ack, slot, 1)).collect::<Vec<_>>());
        for packet in &last {
            protocol.handle_datagram(now, &result_of(packet), &mut Numbers);
        }
        assert_eq!(protocol.status(), &JobStatus::Done);
        let counters = protocol.counters();
        assert_eq!((counters.probes, counters.progress_reports, counters.retransmissions), (2, 1, 0));
    }

    #[test]
    fn a_thread_of_one_element_slots_probes_eight_a_timeout_taking_turns_over_its_slots() {
        // 20 slots of one element: a report covers one slot, so a probe per stretch was a
        // probe per slot, every timeout.
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let mut protocol = running(start, 20, 20, timeout);
        assert_eq!(sent(&mut protocol, start).len(), 20);
        // Nothing answers: each doubling timeout probes 8 slots, from where the last left,
        let mut now = start;
        let mut probed = Vec::new();
        for backoff in 0..4 {
            now += timeout * (1 << backoff);
            protocol.handle_timeout(now);
            let probes = sent(&mut protocol, now);
            assert!(probes.iter().all(|p| parsed(p).message_type == MessageType::Probe));
            probed.push(probes.iter().map(|p| parsed(p).slot).collect::<Vec<_>>());
        }
        // the first from slot 19, sent last.
        let expected: [Vec<u16>; 4] = [
            [19].into_iter().chain(0..7).collect(),
            (7..15).collect(),
            (15..20).chain(0..3).collect(),
            (3..11).collect(),
        ];
        assert_eq!(probed, expected);
        assert_eq!(protocol.counters().probes, 32);
    }

    #[test]
    fn a_thread_whose_slots_two_switches_share_keys_and_probes_each_with_its_own() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        // Slots 0 and 1 are switch A's (session 5), 2 and 3 switch B's (session 6).
        let key = |session| crate::worker::SessionKey { session, token: u64::from(session) * 100 };
        let keys = crate::worker::SessionKeys::sharded([(0..2, key(5)), (2..4, key(6))]).unwrap();
        let config = WorkerConfig { packet_elements: 8, keys, ..config(4, timeout) };
        let mut protocol = WorkerProtocol::new(config, start);
        let job = JobSpec {
            job: 1,
            element_type: netagg_wire::ElementType::Int32,
            elements: 64,
            layout: Layout::Dense,
            exponents: false,
        };
        protocol.start_job(start, job).unwrap();
        let first = sent(&mut protocol, start);
        let keyed: Vec<_> =
            first.iter().map(|p| (parsed(p).slot, parsed(p).session, parsed(p).token)).collect();
        assert_eq!(keyed, [(0, 5, 500), (1, 5, 500), (2, 6, 600), (3, 6, 600)]);
        // A result for slot 2 under switch A's key is not switch B's.
        let mut misdirected = result_of(&first[2]);
        Packet::new_unchecked(&mut misdirected[..]).set_session(5);
        Packet::new_unchecked(&mut misdirected[..]).set_token(500);
        Packet::new_unchecked(&mut misdirected[..]).seal();
        assert_eq!(
            protocol.handle_datagram(start, &misdirected, &mut Numbers),
            Delivery::Rejected(crate::worker::RejectReason::WrongSession)
        );
        // Nothing comes back: one probe per switch, though one report could cover all four.
        protocol.handle_timeout(start + timeout);
        let probes = sent(&mut protocol, start + timeout);
        let asked: Vec<_> =
            probes.iter().map(|p| (parsed(p).message_type, parsed(p).slot, parsed(p).session)).collect();
        assert_eq!(asked, [(MessageType::Probe, 0, 5), (MessageType::Probe, 2, 6)]);
        // Switch A's report covers the slots from 0 on, as an engine's does: it holds the
        // contributions of its own (rounds 0 open) and knows nothing of slots 2 and 3, which
        // are left alone rather than resent.
        let now = start + timeout;
        let report = progress_of(&probes[0], &[0, 0, 0, 0], 0b0011);
        assert_eq!(protocol.handle_datagram(now, &report, &mut Numbers), Delivery::Progress);
        assert!(sent(&mut protocol, now).is_empty());
        // Switch B's report: neither of its slots has this worker's contribution.
        let report = progress_of(&probes[1], &[0, 0], 0);
        assert_eq!(protocol.handle_datagram(now, &report, &mut Numbers), Delivery::Progress);
        let resent: Vec<_> =
            sent(&mut protocol, now).iter().map(|p| (parsed(p).slot, parsed(p).session)).collect();
        assert_eq!(resent, [(2, 6), (3, 6)]);
    }

    #[test]
    fn a_report_is_read_for_the_threads_slots_that_waited_since_before_the_probe() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let (mut protocol, first) = probing_thread(start, timeout);
        protocol.handle_timeout(start + timeout);
        let probe = sent(&mut protocol, start + timeout);
        // Slot 0's result comes with the report, before its next block goes out: the
        // switch cannot have had that block when it answered.
        let now = start + timeout;
        protocol.handle_datagram(now, &result_of(&first[0]), &mut Numbers);
        // Slot 1's round 0 completed (its result lost), slot 2 holds this worker's
        // contribution, slot 3 lacks it; slots 4 to 7 are another thread's.
        let report = progress_of(&probe[0], &[1, 1, 0, 0, 9, 9, 9, 9], 0b1111_0100);
        assert_eq!(protocol.handle_datagram(now, &report, &mut Numbers), Delivery::Progress);
        let recovery: Vec<_> = sent(&mut protocol, now)
            .iter()
            .map(|p| (parsed(p).message_type, parsed(p).slot, parsed(p).block, parsed(p).flags))
            .collect();
        assert_eq!(
            recovery,
            [
                (MessageType::Data, 0, 4, Flags::NONE),
                (MessageType::Ack, 1, 0, Flags::WANT_RESULT),
                (MessageType::Data, 3, 3, Flags::RETRANSMISSION)
            ]
        );
        // Slot 2's contribution is in: its next timeout asks after it, never resends it.
        protocol.handle_datagram(now, &result_of(&first[1]), &mut Numbers);
        protocol.handle_datagram(now, &result_of(&first[3]), &mut Numbers);
        sent(&mut protocol, now);
        let later = now + timeout * 4;
        protocol.handle_timeout(later);
        let asked: Vec<_> =
            sent(&mut protocol, later).iter().map(|p| parsed(p)).filter(|p| p.slot == 2).collect();
        assert_eq!(asked.iter().map(|p| p.message_type).collect::<Vec<_>>(), [MessageType::Ack]);
    }

    /// A job of three blocks whose second packet is taken as lost (the third's result
    /// came, the first's too), when its timer fires.
    fn lost_in_the_middle(start: Instant, timeout: Duration) -> (WorkerProtocol, Vec<Vec<u8>>) {
        let mut protocol = running(start, 3, 3, timeout);
        let first = sent(&mut protocol, start);
        for answered in [&first[0], &first[2]] {
            protocol.handle_datagram(start, &result_of(answered), &mut Numbers);
        }
        assert!(sent(&mut protocol, start).is_empty());
        protocol.handle_timeout(start + timeout);
        (protocol, first)
    }

    #[test]
    fn a_timeout_asks_whether_the_switch_holds_the_contribution_before_resending_it() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let (mut protocol, _) = lost_in_the_middle(start, timeout);
        let asked = sent(&mut protocol, start + timeout);
        assert_eq!(asked.len(), 1);
        let request = PacketRepr::parse(&Packet::new_checked(&asked[0][..]).unwrap());
        assert_eq!(
            (request.message_type, request.slot, request.flags),
            (MessageType::Ack, 1, Flags::WANT_RESULT)
        );
        assert_eq!(request.buffer_len(), HEADER_LEN + CHECKSUM_LEN, "header only");
        // The switch holds it: nothing is sent again, and the slot keeps asking.
        protocol.handle_datagram(start + timeout, &pending_of(&asked[0], true), &mut Numbers);
        assert!(sent(&mut protocol, start + timeout).is_empty());
        let next = protocol.poll_timeout().unwrap();
        protocol.handle_timeout(next);
        let again = sent(&mut protocol, next);
        let request = PacketRepr::parse(&Packet::new_checked(&again[0][..]).unwrap());
        assert_eq!((again.len(), request.message_type), (1, MessageType::Ack));
        assert_eq!(protocol.counters().retransmissions, 0);
        // The second timeout of a slot that knows nothing sends its data.
        let (mut unanswered, _) = lost_in_the_middle(start, timeout);
        sent(&mut unanswered, start + timeout);
        let next = unanswered.poll_timeout().unwrap();
        unanswered.handle_timeout(next);
        let resent = sent(&mut unanswered, next);
        let repr = PacketRepr::parse(&Packet::new_checked(&resent[0][..]).unwrap());
        assert_eq!((repr.message_type, repr.flags), (MessageType::Data, Flags::RETRANSMISSION));
    }

    #[test]
    fn a_recovery_dropped_before_it_is_sent_leaves_the_slot_its_timer() {
        // A retransmission queued (behind a pacer, say) is dropped when the switch says,
        // meanwhile, that it holds the contribution; the slot's timer must still run,
        // or the slot would never ask for its result again.
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let (mut protocol, first) = lost_in_the_middle(start, timeout);
        let asked = sent(&mut protocol, start + timeout);
        // Unanswered: the second timeout queues the data again...
        let next = protocol.poll_timeout().unwrap();
        protocol.handle_timeout(next);
        // ...and before it goes out, the answer to the request arrives: held.
        protocol.handle_datagram(next, &pending_of(&asked[0], true), &mut Numbers);
        assert!(sent(&mut protocol, next).is_empty(), "the retransmission is dropped");
        let deadline = protocol.poll_timeout().unwrap();
        assert!(
            deadline < start + Duration::from_secs(1),
            "a slot timer, not the job's: {:?}",
            deadline - start
        );
        protocol.handle_timeout(deadline);
        let request = sent(&mut protocol, deadline);
        assert_eq!(
            PacketRepr::parse(&Packet::new_checked(&request[0][..]).unwrap()).message_type,
            MessageType::Ack
        );
        // The result comes, and the job is done.
        protocol.handle_datagram(deadline, &result_of(&first[1]), &mut Numbers);
        assert_eq!(protocol.status(), &JobStatus::Done);
    }

    #[test]
    fn a_worker_whose_contributions_complete_the_rounds_resends_at_once() {
        // Its own contributions completed the rounds answered: the stalled round waits on
        // it, so its first timeout sends the data again rather than ask.
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let mut protocol = running(start, 3, 3, timeout);
        let first = sent(&mut protocol, start);
        for answered in [&first[0], &first[2]] {
            let mut result = result_of(answered);
            let mut view = Packet::new_unchecked(&mut result[..]);
            view.set_ack_round(1);
            view.seal();
            protocol.handle_datagram(start, &result, &mut Numbers);
        }
        protocol.handle_timeout(start + timeout);
        let again = sent(&mut protocol, start + timeout);
        let repr = PacketRepr::parse(&Packet::new_checked(&again[0][..]).unwrap());
        assert_eq!(
            (again.len(), repr.message_type, repr.flags),
            (1, MessageType::Data, Flags::RETRANSMISSION)
        );
    }

    /// A sparse thread's slot 0 falls silent in round 1 (a peer's block 2 is next), or,
    /// `contributing`, sends its block 4 to it, while slot 1's contribution to round 1,
    /// sent after slot 0's wait began, is answered at 2 ms: a later sending's result. The
    /// broadcasts are numbered from `first`; with `gap`, the third skips three numbers,
    /// the first of them then taken as lost. Returns what the thread sends when slot 0's
    /// timer (10 ms) fires at 11 ms, and at 12 ms, a timeout after the latest result.
    fn sparse_slot_overtaken(
        first: u8,
        gap: bool,
        contributing: bool,
    ) -> (WorkerProtocol, Vec<PacketRepr>, Vec<PacketRepr>) {
        let start = Instant::now();
        let ms = Duration::from_millis(1);
        let mut protocol = running_sparse(start, 10 * ms);
        let third = first.wrapping_add(if gap { 5 } else { 2 });
        let slot_0_next = if contributing { 4 } else { 2 };
        let results = [
            (sparse_result(0, 0, 0, slot_0_next, 0), first, start + ms),
            (sparse_result(1, 0, 1, 3, 0), first.wrapping_add(1), start + ms),
            (sparse_result(1, 1, 3, 5, 1), third, start + 2 * ms),
        ];
        for (result, number, at) in results {
            assert_eq!(
                protocol.handle_datagram(at, &numbered(result, number), &mut Numbers),
                Delivery::Accepted
            );
            let sent = sent(&mut protocol, at);
            assert!(sent.iter().all(|p| !parsed(p).flags.contains(Flags::WANT_RESULT)), "no request yet");
        }
        let mut after = |at| {
            protocol.handle_timeout(start + at * ms);
            sent(&mut protocol, start + at * ms).iter().map(|p| parsed(p)).collect::<Vec<_>>()
        };
        let (at_11, at_12) = (after(11), after(12));
        (protocol, at_11, at_12)
    }

    #[test]
    fn a_silent_slot_on_a_clean_path_takes_no_later_sendings_result_as_a_loss() {
        let (protocol, at_11, at_12) = sparse_slot_overtaken(10, false, false);
        // Results came 9 ms ago: its timer runs on from the latest one, and a timeout
        // after it the thread probes where its slots stand rather than ask for round 1.
        assert!(at_11.is_empty(), "{at_11:?}");
        assert!(!at_12.is_empty() && at_12.iter().all(|p| p.message_type == MessageType::Probe), "{at_12:?}");
        assert_eq!((protocol.counters().timeouts, protocol.counters().acks_sent), (1, 1));
    }

    #[test]
    fn a_silent_slot_on_a_losing_path_asks_for_its_round_once_a_later_sendings_result_came() {
        // The gap is seen in the numbers as they wrap.
        let (protocol, at_11, _) = sparse_slot_overtaken(253, true, false);
        let asked: Vec<_> = at_11
            .iter()
            .map(|p| (p.message_type, p.slot, p.round, p.flags.contains(Flags::WANT_RESULT)))
            .collect();
        assert_eq!(asked, [(MessageType::Ack, 0, 1, true)]);
        // Its timer asked, not the gap's guess, which takes contributing slots only.
        assert_eq!(protocol.counters().gap_requests, 0);
    }

    #[test]
    fn a_sparse_contribution_on_a_clean_path_takes_no_later_sendings_result_as_a_loss() {
        // Its round waits for the peers holding block 4, which send it when the result
        // naming it reaches them: its result comes when they are in, not in this thread's
        // order of sending. It neither asks nor sends again while results come, and a
        // timeout after the latest one the thread probes.
        let (protocol, at_11, at_12) = sparse_slot_overtaken(10, false, true);
        assert!(at_11.is_empty(), "{at_11:?}");
        assert!(!at_12.is_empty() && at_12.iter().all(|p| p.message_type == MessageType::Probe), "{at_12:?}");
        let counters = protocol.counters();
        assert_eq!((counters.timeouts, counters.retransmissions, counters.gap_requests), (1, 0, 0));
    }
}
