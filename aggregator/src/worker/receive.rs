//! Receiving: results, each stored and taken into its slot's window of results held,
//! where it may release the slot's next contribution or end its stream; and pending
//! notices and progress reports, which answer a slot's question or a probe (see
//! `recovery`).

use std::time::Instant;

use netagg_wire::packet::BROADCAST_RANK;
use netagg_wire::{Flags, MessageType, PacketRepr, WireError};

use super::job::{block_len, JobStatus};
use super::streams::Layout;
use super::{BlockIo, Contribution, Delivery, Job, RejectReason, Send, WorkerProtocol};
use crate::round::is_after;

impl WorkerProtocol {
    /// Takes one datagram from the switch.
    pub fn handle_datagram(&mut self, now: Instant, datagram: &[u8], io: &mut impl BlockIo) -> Delivery {
        match self.receive(now, datagram, io) {
            Ok(delivery) => {
                match delivery {
                    Delivery::Accepted => {
                        self.counters.results_received += 1;
                        self.counters.bytes_received += datagram.len() as u64;
                        self.delivered.add(&self.pacer, now, datagram.len());
                    }
                    Delivery::Duplicate => self.counters.duplicates += 1,
                    Delivery::Stale => self.counters.stale += 1,
                    Delivery::Pending => self.counters.pending += 1,
                    Delivery::Progress => self.counters.progress_reports += 1,
                    Delivery::Rejected(_) => {}
                }
                delivery
            }
            Err(reason) => {
                match reason {
                    RejectReason::Corrupt(_) => self.counters.corrupt += 1,
                    _ => self.counters.rejected += 1,
                }
                Delivery::Rejected(reason)
            }
        }
    }

    /// What became of a datagram from the switch, or why it is rejected: the steps of
    /// [`WorkerProtocol::handle_datagram`], which counts the outcome.
    ///
    /// Every result passes through these steps, each a function of its own for the
    /// reader, not for the machine: inlined, as when they were one function. Left to
    /// the compiler, the client path with the dummy backend lost 2-4 %
    /// (allreduce_benchmark, before and after alternating); the steps that call others
    /// are inlined by force, since a build of 16 codegen units left them calls (about 15
    /// instructions a call, callgrind).
    #[inline]
    fn receive(
        &mut self,
        now: Instant,
        datagram: &[u8],
        io: &mut impl BlockIo,
    ) -> Result<Delivery, RejectReason> {
        let packet = self.config.integrity.check(datagram).map_err(|error| match error {
            WireError::Checksum { .. } => RejectReason::Corrupt(error),
            _ => RejectReason::Malformed(error),
        })?;
        let repr = PacketRepr::parse(&packet);
        let index = self.addressed_slot(&repr)?;
        if repr.rank == BROADCAST_RANK {
            // Numbered whatever its job: a late one still fills its gap.
            self.take_sequence(index, repr.sequence);
        }
        if repr.message_type == MessageType::Pending && repr.flags.contains(Flags::LOST) {
            // About another slot's first sending: it counts while the job runs, even
            // behind the result that ended the stream of the slot it came on.
            if !self.job_running(&repr) {
                return Ok(Delivery::Stale);
            }
            self.take_lost_notice(index, &repr);
            return Ok(Delivery::Pending);
        }
        let Some(job) = self.running_job(index, &repr) else {
            return Ok(Delivery::Stale);
        };
        match repr.message_type {
            MessageType::Pending => {
                self.take_pending(now, index, &repr);
                return Ok(Delivery::Pending);
            }
            MessageType::Progress => {
                self.take_progress(now, index, &repr, packet.payload());
                return Ok(Delivery::Progress);
            }
            _ => {}
        }
        let Some(result) = self.check_result(job, index, &repr)? else {
            return Ok(Delivery::Duplicate);
        };
        let exponent_round = result.answered.is_some_and(|c| c.exponent_round);
        if !exponent_round {
            io.store(repr.block, packet.payload(), result.answered.and_then(|c| c.exponent));
        }
        if repr.rank == self.config.rank {
            // Sent to this worker alone: an answer to its request or retransmission.
            self.answered(now, index);
        }
        self.record_result(now, index, &repr, result);
        let queued_before = self.pending.len();
        self.release_next(index, &repr, exponent_round);
        if self.probe.is_some() {
            self.end_wait(now);
        }
        if self.stream_ended(index) {
            self.finish_slot(index);
        } else {
            self.await_next(now, index, queued_before);
        }
        // After the result is taken, which may be the evidence that overtakes the
        // contributions to ask after.
        self.ask_after_gaps(index);
        Ok(Delivery::Accepted)
    }

    /// The slot of this thread that `repr` is about, if it is a result, a pending notice
    /// or a progress report of this session for this worker.
    #[inline]
    fn addressed_slot(&self, repr: &PacketRepr) -> Result<u16, RejectReason> {
        // A notice or report is about one worker's contribution, so it is never broadcast.
        let answer = match repr.message_type {
            MessageType::Result => false,
            MessageType::Pending | MessageType::Progress => true,
            MessageType::Data | MessageType::Ack | MessageType::Probe => {
                return Err(RejectReason::NotAResult)
            }
        };
        let index = repr.slot.wrapping_sub(self.config.slot_base);
        let Some(slot) = self.slots.get(usize::from(index)) else {
            return Err(RejectReason::WrongSlot);
        };
        if repr.session != slot.key.session {
            return Err(RejectReason::WrongSession);
        }
        if repr.token != slot.key.token {
            return Err(RejectReason::WrongToken);
        }
        if repr.rank != self.config.rank && (answer || repr.rank != BROADCAST_RANK) {
            return Err(RejectReason::WrongRank);
        }
        Ok(index)
    }

    /// The running job, if `repr` is of it and slot `index` takes part in it.
    #[inline]
    fn running_job(&self, index: u16, repr: &PacketRepr) -> Option<&Job> {
        let job = self.job.as_ref()?;
        (self.slots[index as usize].active && self.job_running(repr)).then_some(job)
    }

    /// Whether `repr` is of the job this thread is running.
    #[inline]
    fn job_running(&self, repr: &PacketRepr) -> bool {
        self.job.as_ref().is_some_and(|job| repr.job == job.spec.job) && self.status == JobStatus::Running
    }

    /// Checks result `repr` against slot `index` of `job`: `None` if the slot holds it
    /// already.
    #[inline]
    fn check_result(
        &self,
        job: &Job,
        index: u16,
        repr: &PacketRepr,
    ) -> Result<Option<NewResult>, RejectReason> {
        let slot = &self.slots[index as usize];
        let offset = repr.round.wrapping_sub(slot.have);
        if offset == 0 || !is_after(repr.round, slot.have) {
            return Ok(None);
        }
        if offset > 64 {
            return Err(RejectReason::RoundOutOfWindow);
        }
        if offset >= 2 && slot.ahead & (1 << (offset - 2)) != 0 {
            return Ok(None);
        }
        let sparse = matches!(job.spec.layout, Layout::Sparse(_));
        if !sparse && slot.outstanding.is_none_or(|c| c.round != repr.round || c.block != repr.block) {
            return Err(RejectReason::WrongBlock);
        }
        let answered = slot.outstanding.filter(|c| c.round == repr.round);
        let exponent_round = answered.is_some_and(|c| c.exponent_round);
        if sparse && repr.block as u64 % self.config.slots as u64 != index as u64 {
            return Err(RejectReason::WrongBlock);
        }
        if repr.block >= job.blocks
            || (repr.element_count != 0
                && repr.element_count != block_len(&job.spec, repr.block, self.config.packet_elements))
            || (!sparse && (repr.element_count == 0) != exponent_round)
        {
            return Err(RejectReason::WrongLength);
        }
        Ok(Some(NewResult { offset, answered }))
    }

    /// Takes new result `repr`, arriving at `now`, into slot `index`'s window of results
    /// held; it ends the wait of the contribution it answers, and shows the job making
    /// progress.
    #[inline(always)]
    fn record_result(&mut self, now: Instant, index: u16, repr: &PacketRepr, result: NewResult) {
        let slot = &mut self.slots[index as usize];
        let offset = result.offset;
        if offset == 1 {
            slot.have = repr.round;
            while slot.ahead & 1 != 0 {
                slot.have = slot.have.wrapping_add(1);
                slot.ahead >>= 1;
            }
            slot.ahead >>= 1;
        } else {
            slot.ahead |= 1 << (offset - 2);
        }
        if result.answered.is_some() {
            slot.outstanding = None;
            slot.answered_wait = (repr.round, slot.waiting_since);
        }
        slot.backoff = 0;
        self.last_progress = now;
        self.peers_complete = repr.completed_by().is_some_and(|rank| rank != self.config.rank);
        let (waited_since, endpoint) = (slot.waiting_since, slot.endpoint);
        let path = &mut self.endpoints[endpoint];
        path.latest_answered = path.latest_answered.max(Some(waited_since));
        if result.answered.is_some() {
            self.time_round_trip(now, index, repr);
            self.overtaken_by(now, index, endpoint, waited_since);
        }
    }

    /// Slot `index`'s stream is over: the slot rests until the next job, whose stream
    /// starts at the round after its last, and the job is done once every slot rests.
    #[inline]
    fn finish_slot(&mut self, index: u16) {
        let slot = &mut self.slots[index as usize];
        slot.next_round = slot.have.wrapping_add(1);
        slot.active = false;
        if self.slots.iter().all(|s| !s.active) {
            self.finish_job();
        }
    }

    /// Leaves slot `index` waiting for its next result after one that did not end its
    /// stream: a silent slot acknowledges a batch of results, and the timer runs from
    /// `now` unless a packet queued for the slot since `queued_before` will arm it.
    #[inline(always)]
    fn await_next(&mut self, now: Instant, index: u16, queued_before: usize) {
        let slot = &mut self.slots[index as usize];
        // A silent worker acknowledges every depth/2 results, so the aggregator can free
        // sets before a stream needs them again.
        let batch = (self.config.depth as u32 / 2).max(1);
        if slot.outstanding.is_none() && slot.have.wrapping_sub(slot.acked) >= batch {
            self.pending.push_back((index, Send::Ack));
        }
        // The next wait begins now, or at the first sending of the contribution queued (a
        // probe's report, which may come before that sending, must not take it as lost).
        slot.waiting_since = self.transmissions;
        if self.pending.len() != queued_before || slot.silent_turn.is_some() {
            // The packet queued for the slot arms its timer when it is sent, and a silent
            // turn queued for it when it is taken; until then the timer of the packet
            // just answered must not fire.
            slot.deadline = None;
        } else {
            self.arm_timer(index, now);
        }
    }
}

/// A result new to its slot, as [`WorkerProtocol::check_result`] found it.
#[derive(Debug, Clone, Copy)]
struct NewResult {
    /// How far its round is past the slot's `have`: 1 for the next in order.
    offset: u32,
    /// The slot's outstanding contribution it answers, if any.
    answered: Option<Contribution>,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use netagg_wire::packet::HEADER_LEN;
    use netagg_wire::Packet;

    use super::super::testing::{parsed, pending_of, result_of, running, sent, Numbers};
    use super::*;

    #[test]
    fn a_result_is_taken_once_and_only_from_the_session_for_this_worker() {
        let start = Instant::now();
        let mut protocol = running(start, 2, 4, Duration::from_millis(10));
        let first = sent(&mut protocol, start);
        let result = result_of(&first[1]);
        let altered = |change: fn(&mut Packet<&mut [u8]>)| {
            let mut bytes = result.clone();
            let mut view = Packet::new_unchecked(&mut bytes[..]);
            change(&mut view);
            view.seal();
            bytes
        };
        // A bit flipped on the way: dropped and counted as corrupt, before anything else.
        let mut corrupted = result.clone();
        corrupted[HEADER_LEN] ^= 0x40;
        assert!(matches!(
            protocol.handle_datagram(start, &corrupted, &mut Numbers),
            Delivery::Rejected(RejectReason::Corrupt(WireError::Checksum { .. }))
        ));
        let cases = [
            (altered(|p| p.set_session(9)), Delivery::Rejected(RejectReason::WrongSession)),
            (altered(|p| p.set_token(9)), Delivery::Rejected(RejectReason::WrongToken)),
            (altered(|p| p.set_rank(3)), Delivery::Rejected(RejectReason::WrongRank)),
            (altered(|p| p.set_slot(2)), Delivery::Rejected(RejectReason::WrongSlot)),
            (
                altered(|p| p.set_message_type(MessageType::Data)),
                Delivery::Rejected(RejectReason::NotAResult),
            ),
            (altered(|p| p.set_block(3)), Delivery::Rejected(RejectReason::WrongBlock)),
            (altered(|p| p.set_round(65)), Delivery::Rejected(RejectReason::RoundOutOfWindow)),
            (altered(|p| p.set_job(5)), Delivery::Stale),
            (result.clone(), Delivery::Accepted),
            (result.clone(), Delivery::Duplicate),
        ];
        for (datagram, delivery) in cases {
            assert_eq!(
                protocol.handle_datagram(start, &datagram, &mut Numbers),
                delivery,
                "{:?}",
                parsed(&datagram)
            );
        }
        let counters = protocol.counters();
        assert_eq!(
            (
                counters.corrupt,
                counters.rejected,
                counters.stale,
                counters.results_received,
                counters.duplicates
            ),
            (1, 7, 1, 1, 1)
        );
        // Slot 1's result released its next block, block 3.
        let next = sent(&mut protocol, start);
        assert_eq!((next.len(), parsed(&next[0]).block), (1, 3));
    }

    #[test]
    fn a_notice_of_room_resends_a_refused_contribution_and_no_accepted_one() {
        let start = Instant::now();
        let mut protocol = running(start, 2, 4, Duration::from_millis(10));
        let first = sent(&mut protocol, start);
        assert_eq!(first.len(), 2);
        // Slot 1's contribution is in: its notice says so, and nothing goes.
        let accepted = pending_of(&first[1], true);
        assert_eq!(protocol.handle_datagram(start, &accepted, &mut Numbers), Delivery::Pending);
        assert!(sent(&mut protocol, start).is_empty());
        // A notice is about one worker's contribution: a broadcast one is refused.
        let mut notice = parsed(&pending_of(&first[0], false));
        notice.rank = BROADCAST_RANK;
        let mut datagram = vec![0; notice.buffer_len()];
        notice.emit(&mut datagram[..]).unwrap().seal();
        let refused = protocol.handle_datagram(start, &datagram, &mut Numbers);
        assert_eq!(refused, Delivery::Rejected(RejectReason::WrongRank));
        assert!(sent(&mut protocol, start).is_empty());
        // The switch refused slot 0's contribution for want of a set, and tells it a set
        // is free: the same contribution goes again at once, marked as sent again.
        let room = pending_of(&first[0], false);
        assert_eq!(protocol.handle_datagram(start, &room, &mut Numbers), Delivery::Pending);
        let mut again = parsed(&first[0]);
        again.flags = again.flags | Flags::RETRANSMISSION;
        let mut expected = first[0].clone();
        again.emit(&mut expected[..]).unwrap().seal();
        assert_eq!(sent(&mut protocol, start), [expected]);
    }
}
