//! Loss detection and recovery: what a slot whose timer fires sends, and what the
//! switch's pending notices tell it.
//!
//! Loss is recovered by per-slot timers with exponential backoff. When a slot's timer
//! fires, the worker first asks whether anything points to a loss: a result of a packet
//! sent *after* the slot's (the switch has moved on without it, as TCP's RACK reasons), or
//! a gap in the slot's results. If so, an outstanding contribution is sent again (at the
//! first timeout, while peers' contributions complete the rounds, the slot asks first
//! whether the switch holds it: the round may wait on a peer's loss), and a slot with
//! nothing outstanding, or missing a result, asks for the first round it lacks.
//! If not, the whole thread is waiting, most likely for a late peer: then one slot
//! *probes* with a header-only request, and the other slots' timers wait for its answer
//! rather than resend a window. The switch answers a request or a repeated contribution
//! for a round still aggregating with a *pending* notice saying whether this worker's
//! contribution is in; a slot known to be in is never sent again, and one the switch
//! lacks is sent at once. Any result ends the wait, and the waiting slots' timers start
//! afresh. A job with no progress for `job_timeout` fails.

use std::time::Instant;

use netagg_wire::{Flags, PacketRepr};

use super::{Probe, Send, SlotState, WorkerProtocol};

impl SlotState {
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
        if slot.paced {
            // Its contribution was never sent: the pacer sends it, and arms the timer.
            return;
        }
        // RACK's reasoning: a result for something sent after this slot's packet means
        // the switch moved on without it; so does a gap in its results.
        let loss_evident =
            slot.ahead != 0 || self.latest_answered.is_some_and(|answered| answered > slot.waiting_since);
        if !loss_evident && self.probe.is_some_and(|probe| probe.slot != index) {
            // The probe's answer speaks for this slot too: wait for it.
            slot.deferred = true;
            self.expire_timed(index);
            return;
        }
        if !loss_evident && now.saturating_duration_since(self.last_progress) < self.base_timeout {
            // Results are still coming, in the order their packets went out: this
            // slot's is queued behind them, not lost. A timed packet's round trip then
            // measures the queue, which the timeout must learn.
            self.arm_timer(index, now);
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

    /// Nothing answered since slot `index` sent: the thread waits, most likely for a late
    /// peer. One header-only request asks the switch, as TCP resends one segment on a
    /// timeout, not its window. Its answer maps 64 slots from the one it asks about; a
    /// thread of more slots asks about the next 64 each time.
    fn send_probe(&mut self, now: Instant, index: u16) {
        let (asked, count) = match self.probe {
            None => (index, 1),
            Some(probe) => (self.active_slot_from(probe.slot as usize + 64), probe.count + 1),
        };
        if asked != index {
            self.slots[index as usize].deferred = true;
        }
        let probing = &mut self.slots[asked as usize];
        probing.deferred = false;
        probing.backoff = count;
        self.probe = Some(Probe { slot: asked, sent: self.transmissions, count });
        self.counters.probes += 1;
        // The round trip under way measures the late peer, not the path.
        self.timed = None;
        let round = self.slots[asked as usize].have.wrapping_add(1);
        self.pending.push_back((asked, Send::Request { round }));
        self.arm_timer(asked, now);
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

    /// Takes the switch's word that round `notice.round` of a slot is still aggregating.
    pub(super) fn take_pending(&mut self, now: Instant, index: u16, notice: &PacketRepr) {
        if let Some(probe) = self.probe.filter(|probe| probe.slot == index) {
            self.take_lacking(now, probe, notice.lacking());
        }
        let slot = &mut self.slots[index as usize];
        // About a round this slot is not contributing to: it waits for others, as it knew.
        let Some(contribution) = slot.outstanding.filter(|c| c.round == notice.round) else {
            return;
        };
        if notice.flags.contains(Flags::CONTRIBUTED) {
            slot.held = Some(contribution.round);
        } else if slot.held != Some(contribution.round) && !slot.paced {
            // Lost on the way: send it now. The thread was not (only) waiting for a late
            // peer, so the slots put off behind a probe may have lost theirs too.
            self.pending.push_back((index, Send::Data { retransmission: Some(contribution.round) }));
            self.end_wait(now);
        }
    }

    /// Acts on a probe's answer: the slots whose rounds wait for this worker's
    /// contribution. Those that sent one before the probe lost it, or lost the result it
    /// was answered with, so each sends it again or asks for the result.
    fn take_lacking(&mut self, now: Instant, probe: Probe, mut lacking: u64) {
        let mut resent = false;
        while lacking != 0 {
            let offset = lacking.trailing_zeros();
            lacking &= lacking - 1;
            let index = probe.slot as u32 + offset;
            let Some(slot) = self.slots.get_mut(index as usize) else {
                break;
            };
            if !slot.active || slot.paced || slot.waiting_since > probe.sent || index == probe.slot as u32 {
                continue;
            }
            slot.deferred = false;
            self.pending.push_back((index as u16, slot.recovery()));
            // Its timer fired while deferred: it runs again from now, as after any
            // recovery queued (see `slot_timed_out`).
            self.arm_timer(index as u16, now);
            resent = true;
        }
        if resent {
            // A loss, not (only) a late peer: the other slots may have lost theirs too.
            self.end_wait(now);
        }
    }

    /// The first active slot at or after `from`, wrapping around to slot 0.
    fn active_slot_from(&self, from: usize) -> u16 {
        let slots = self.slots.len();
        let from = if from >= slots { 0 } else { from };
        (from..slots).chain(0..from).find(|&index| self.slots[index].active).unwrap_or(0) as u16
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

    use netagg_wire::packet::HEADER_LEN;
    use netagg_wire::{MessageType, Packet};

    use super::super::testing::{pending_of, result_of, running, sent, Numbers};
    use super::super::JobStatus;
    use super::*;

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
        assert_eq!(request.buffer_len(), HEADER_LEN, "header only");
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
            Packet::new_unchecked(&mut result[..]).set_ack_round(1);
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
}
