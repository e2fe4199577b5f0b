//! Sending: the packets the slots queued, built into the caller's buffer.
//!
//! Data packets, first sendings and retransmissions, go out through the worker's
//! [`LinkPacer`], which every thread of the worker shares: unpaced until the worker's
//! path shows an overflowing queue, then spaced at the rate the path delivers (see
//! [`crate::pacer`]). A contribution the pacer holds has never been sent: no timer runs
//! for it, and no recovery may send it. Behind a measured rate a sparse job's rounds that
//! name only other workers' blocks take turns in the same queue, which send nothing
//! ([`PacedTurn::Silent`]).
//!
//! [`LinkPacer`]: crate::pacer::LinkPacer

use std::time::Instant;

use netagg_wire::packet::datagram_len;
use netagg_wire::{Flags, MessageType, PacketRepr};

use super::job::block_len;
use super::streams::Layout;
use super::{BlockIo, PacedTurn, Send, TimedPacket, WorkerProtocol, FIRST_SENDING};

impl WorkerProtocol {
    /// Writes the next packet to send into `buf` and returns its length.
    ///
    /// `buf` must hold a header and a full packet (a [`MAX_DATAGRAM_LEN`]-byte buffer
    /// always does); a smaller one yields nothing.
    ///
    /// [`MAX_DATAGRAM_LEN`]: netagg_wire::MAX_DATAGRAM_LEN
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8], io: &mut impl BlockIo) -> Option<usize> {
        if buf.len() < datagram_len(self.config.packet_elements as usize) {
            return None;
        }
        let pacing = self.pacer.rate().is_some();
        while let Some((index, send)) = self.pending.pop_front() {
            // Data waits behind data already waiting, in order, retransmissions first.
            let waiting = !self.resends.is_empty() || !self.paced.is_empty();
            match send {
                FIRST_SENDING if pacing && (waiting || !self.pacer.allows(now)) => {
                    self.queue_paced(index);
                    continue;
                }
                Send::Data { retransmission: Some(_) } if pacing && (waiting || !self.pacer.allows(now)) => {
                    // One copy waits: a later timeout or notice asking for the same adds
                    // nothing.
                    if !self.resends.contains(&(index, send)) {
                        self.resends.push_back((index, send));
                    }
                    continue;
                }
                _ => {}
            }
            if let Some(len) = self.transmit(now, index, send, buf, io) {
                return Some(len);
            }
        }
        // Retransmissions first: they repair rounds every worker waits on.
        while !self.resends.is_empty() || !self.paced.is_empty() {
            if !self.pacer.allows(now) {
                return None;
            }
            let (index, send) = match self.resends.pop_front() {
                Some(resend) => resend,
                None => match self.paced.pop_front()? {
                    PacedTurn::Contribution(index) => {
                        self.slots[index as usize].paced = false;
                        (index, FIRST_SENDING)
                    }
                    PacedTurn::Silent(index, round) => {
                        self.take_silent_turn(now, index, round);
                        continue;
                    }
                },
            };
            if let Some(len) = self.transmit(now, index, send, buf, io) {
                return Some(len);
            }
        }
        None
    }

    /// A full packet's bytes: what the pacer books for a data packet sent until results
    /// have come (then it books the mean result's size, `LinkPacer::result_len`), since a
    /// sparse stream's contribution may be a bare header while its result, the union of
    /// every worker's blocks, is full: booked at its own size, a paced rate would let
    /// results through faster than it, and overflow the path down.
    pub(super) fn paced_len(&self) -> usize {
        datagram_len(self.config.packet_elements as usize)
    }

    /// Puts a slot's first sending of its contribution in the pacer's queue.
    fn queue_paced(&mut self, index: u16) {
        let slot = &mut self.slots[index as usize];
        if slot.active && slot.outstanding.is_some() && !slot.paced {
            slot.paced = true;
            self.paced.push_back(PacedTurn::Contribution(index));
            self.counters.paced += 1;
        }
    }

    /// Puts slot `index`'s turn for a round it has nothing to send to in the pacer's
    /// queue, if a measured rate paces the path ([`LinkPacer::paces_rounds`]): see
    /// [`PacedTurn::Silent`]. Until the turn is taken the slot's wait has not begun, and
    /// no timer runs for it.
    ///
    /// [`LinkPacer::paces_rounds`]: crate::pacer::LinkPacer::paces_rounds
    pub(super) fn queue_silent_turn(&mut self, index: u16, round: u32) {
        if self.pacer.paces_rounds() {
            self.slots[index as usize].silent_turn = Some(round);
            self.paced.push_back(PacedTurn::Silent(index, round));
        }
    }

    /// Takes slot `index`'s silent turn for `round` at `now`: books the result the round
    /// draws, and starts the slot's wait for it, unless the result came first (the slot
    /// then waits for a later round, or none).
    fn take_silent_turn(&mut self, now: Instant, index: u16, round: u32) {
        self.pacer.sent(now, self.paced_len());
        let slot = &mut self.slots[index as usize];
        if slot.silent_turn != Some(round) {
            return;
        }
        slot.silent_turn = None;
        if slot.active {
            slot.waiting_since = self.transmissions;
            self.arm_timer(index, now);
        }
    }

    /// Whether slot `index`'s request, in a sparse job behind a measured rate, draws a
    /// result down the path that no turn booked, and so is booked at the pacer as a turn
    /// is (it still leaves at once): a silent slot's, whose round's result was lost, or
    /// one that a gap in the broadcasts' numbers showed lost. Their results, sent again
    /// outside the rounds' turns, fell between the turns' results into a queue of a
    /// frame or two: booked, the collapse matrix's later sparse jobs took 1.67 and 1.52
    /// of the model against 2.02 and 2.29 (12 seeds, `benches/RESULTS.md`, "Rounds
    /// paced, not packets"). A contributing slot's first request asks whether the switch
    /// holds its contribution, and is mostly answered by a header: booking every request
    /// took later dense jobs with 1 % loss from 1.2-1.7 to 2.1-2.2 of the model. Nor in a
    /// dense job, whose sendings pace its rounds one for one: booking its gap requests
    /// took `tests/paths.rs`' 5 ms queues at 50 Mbit/s to 1.42 of the model in a later
    /// job (its bound 1.10), not traced further.
    fn request_draws_result(&self, index: u16) -> bool {
        let slot = &self.slots[index as usize];
        let draws = slot.outstanding.is_none() || slot.gap_asked == Some(slot.waiting_since);
        draws && self.sparse_job() && self.pacer.paces_rounds()
    }

    /// Empties the pacer's queues: their packets are no longer to be sent.
    pub(super) fn clear_paced(&mut self) {
        self.resends.clear();
        for turn in self.paced.drain(..) {
            match turn {
                PacedTurn::Contribution(index) => self.slots[index as usize].paced = false,
                PacedTurn::Silent(index, _) => self.slots[index as usize].silent_turn = None,
            }
        }
    }

    /// Builds `send` for slot `index` into `buf`, and books it as sent at `now`.
    fn transmit(
        &mut self,
        now: Instant,
        index: u16,
        send: Send,
        buf: &mut [u8],
        io: &mut impl BlockIo,
    ) -> Option<usize> {
        let len = self.build(index, send, buf, io)?;
        self.counters.packets_sent += 1;
        self.counters.bytes_sent += len as u64;
        match send {
            FIRST_SENDING if self.timed.is_none() => {
                // `build` sent the slot's outstanding contribution.
                if let Some(contribution) = self.slots[index as usize].outstanding {
                    let round = contribution.round;
                    self.timed = Some(TimedPacket { slot: index, round, sent: now, expired: false });
                }
            }
            // Karn's rule: the result may answer either copy.
            Send::Data { retransmission: Some(_) } if self.timed.is_some_and(|t| t.slot == index) => {
                self.timed = None;
            }
            _ => {}
        }
        self.transmissions += 1;
        // The wait starts with a contribution's first sending. An answer to a resent one
        // or to a request may answer the first sending, so it must not count as the
        // answer to a packet sent later than the others waiting.
        if let Send::Data { .. } = send {
            self.pacer.sent(now, self.paced_len());
        } else if matches!(send, Send::Request { .. }) && self.request_draws_result(index) {
            self.pacer.sent(now, self.paced_len());
        }
        self.book_loss(now, index, send);
        if send == FIRST_SENDING {
            let slot = &mut self.slots[index as usize];
            slot.waiting_since = self.transmissions;
            slot.first_sending = self.loss_runs.first_sending();
            if let Some(contribution) = slot.outstanding {
                let endpoint = slot.endpoint;
                self.sent_first(self.transmissions, index, endpoint, contribution.round);
            }
        }
        self.arm_timer(index, now);
        if matches!(send, Send::Request { .. } | Send::Data { retransmission: Some(_) }) {
            self.recovery_sent(now, index);
        }
        Some(len)
    }

    /// Tells the pacer of a loss that `send` of slot `index` repairs: its contribution
    /// sent again. A request is no loss yet: every slot of a thread whose peer is late
    /// asks after its contribution, in the order they were sent.
    // Inlined: every packet sent asks, and a build of 16 codegen units left it a call.
    #[inline]
    fn book_loss(&mut self, now: Instant, index: u16, send: Send) {
        if let Send::Data { retransmission: Some(_) } = send {
            let first_sending = self.slots[index as usize].first_sending;
            let packet_bytes = self.paced_len();
            self.pacer.lost(now, &mut self.loss_runs, first_sending, packet_bytes);
        }
    }

    fn build(&mut self, index: u16, send: Send, buf: &mut [u8], io: &mut impl BlockIo) -> Option<usize> {
        let job = self.job.as_ref()?;
        let slot = &self.slots[index as usize];
        if !slot.active {
            return None;
        }
        let sparse = matches!(job.spec.layout, Layout::Sparse(_));
        let mut repr = PacketRepr {
            message_type: MessageType::Ack,
            element_type: job.spec.element_type,
            flags: if sparse { Flags::SPARSE } else { Flags::NONE },
            session: slot.key.session,
            job: job.spec.job,
            packet_id: 0,
            rank: self.config.rank,
            element_count: 0,
            slot: self.config.slot_base + index,
            exponent: 0,
            sequence: 0,
            round: slot.have.wrapping_add(1),
            block: 0,
            next_block: 0,
            ack_round: slot.have,
            token: slot.key.token,
        };
        match send {
            Send::Ack => self.counters.acks_sent += 1,
            Send::Request { round } => {
                // Answered while the request waited in the queue.
                if !slot.lacks(round) {
                    return None;
                }
                repr.round = round;
                repr.flags = repr.flags | Flags::WANT_RESULT;
                self.counters.acks_sent += 1;
            }
            Send::Probe => {
                // The wait ended while the probe was queued: nothing to ask.
                self.probe?;
                repr.message_type = MessageType::Probe;
                self.counters.probes += 1;
                // Echoed in the report: slots whose wait began after it are not in it.
                repr.packet_id = self.transmissions as u32;
            }
            Send::Data { retransmission } => {
                let contribution = slot.outstanding?;
                // Answered, or known to be at the switch, while it waited in the queue; or
                // never sent yet, still in the pacer's queue.
                if retransmission.is_some_and(|round| {
                    round != contribution.round || slot.held == Some(round) || slot.paced
                }) {
                    return None;
                }
                let carries_data = !contribution.exponent_round
                    && match &job.spec.layout {
                        Layout::Dense => true,
                        Layout::Sparse(mask) => mask.contains(contribution.block),
                    };
                repr.message_type = MessageType::Data;
                repr.packet_id = contribution.block;
                repr.round = contribution.round;
                repr.block = contribution.block;
                repr.next_block = contribution.next;
                if carries_data {
                    repr.element_count =
                        block_len(&job.spec, contribution.block, self.config.packet_elements);
                }
                if retransmission.is_some() {
                    repr.flags = repr.flags | Flags::RETRANSMISSION;
                    self.counters.retransmissions += 1;
                } else {
                    repr.sequence =
                        self.endpoints[slot.endpoint].first_numbers.number(index, contribution.round);
                }
                self.counters.data_sent += 1;
            }
        }
        let contribution = slot.outstanding.filter(|_| repr.message_type == MessageType::Data);
        if job.spec.exponents {
            if let Some(contribution) = contribution {
                repr.exponent = if contribution.exponent_round {
                    // The first window's blocks share the exponent this round agrees.
                    let first_window = job.blocks.min(self.config.slots as u32);
                    (0..first_window).map(|block| io.exponent(block)).max().unwrap_or(i8::MIN)
                } else {
                    let next = contribution.block as u64 + self.config.slots as u64;
                    if next < job.blocks as u64 {
                        io.exponent(next as u32)
                    } else {
                        i8::MIN
                    }
                };
            }
        }
        // `poll_transmit` checked that `buf` holds a full packet.
        let mut packet = repr.emit(buf).ok()?;
        if repr.element_count > 0 {
            io.load(repr.block, packet.payload_mut(), contribution.and_then(|c| c.exponent));
        }
        self.slots[index as usize].acked = repr.ack_round;
        // Sealed right after the payload was encoded into it, while it is in cache.
        Some(self.config.integrity.seal(&mut packet))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use netagg_wire::Packet;

    use netagg_wire::{ElementType, MessageType, PacketRepr};

    use super::super::testing::{
        config, measured_path, parsed, result_of, running, sent, sparse_result, Numbers,
    };
    use super::super::{BlockMask, JobSpec, Layout};
    use super::*;
    use crate::pacer::{LinkPacer, QUANTUM};

    /// A protocol of two slots behind a measured rate (results at about 250 kB/s, a
    /// result's time about 2 ms), running a sparse int32 job of 12 one-element blocks
    /// of which this worker holds `blocks`, its two openings sent: the pacer, the
    /// protocol, and when the second opening left.
    fn sparse_behind_a_measured_rate(
        start: Instant,
        timeout: Duration,
        blocks: &'static [u32],
    ) -> (Arc<LinkPacer>, WorkerProtocol, Instant) {
        let pacer = measured_path(start, 1);
        let mut protocol = WorkerProtocol::with_pacer(config(2, timeout), start, pacer.clone());
        let mask = BlockMask::from_fn(12, |block| blocks.contains(&block));
        let job = JobSpec {
            job: 1,
            element_type: ElementType::Int32,
            elements: 12,
            layout: Layout::Sparse(mask),
            exponents: false,
        };
        protocol.start_job(start, job).unwrap();
        // The two openings, a result's time apart.
        assert_eq!(sent(&mut protocol, start).len(), 1);
        let second = pacer.ready_at().unwrap();
        assert_eq!(sent(&mut protocol, second).len(), 1);
        (pacer, protocol, second)
    }

    /// Behind a measured rate, a sparse round that names only another worker's block
    /// takes a turn at the pacer, as a sending would: the slot's timer runs from then,
    /// and a contribution released after it waits its turn behind it. Paced by its own
    /// sendings alone, the worker sent that contribution at the turn's time.
    #[test]
    fn a_silent_round_takes_its_turn_at_the_pacer_and_starts_its_timer_then() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        // Slot 0's stream is blocks 0, 2, 4 ... of which 4 is this worker's first; slot
        // 1's is 1, 3, 5 ... from 3.
        let (pacer, mut protocol, second) = sparse_behind_a_measured_rate(start, timeout, &[3, 4, 5, 7, 9]);
        // Slot 0's next round is another worker's block 2; slot 1's is this worker's 3.
        let now = second + Duration::from_micros(100);
        protocol.handle_datagram(now, &sparse_result(0, 0, 0, 2, 0), &mut Numbers);
        protocol.handle_datagram(now, &sparse_result(1, 0, 1, 3, 0), &mut Numbers);
        // Slot 0 acknowledges its result at once (a silent slot does, every depth / 2
        // results); slot 1's block waits behind slot 0's turn.
        let at_once: Vec<MessageType> =
            sent(&mut protocol, now).iter().map(|p| parsed(p).message_type).collect();
        assert_eq!(at_once, [MessageType::Ack]);
        let turn = pacer.ready_at().unwrap();
        assert!(turn > now + QUANTUM, "the turn waits for the pacer");
        assert_eq!(protocol.poll_timeout(), Some(turn));
        // The turn sends nothing, arms slot 0's timer, and holds slot 1's block back.
        assert!(sent(&mut protocol, turn).is_empty());
        assert!(protocol.slots[0].deadline.is_some_and(|deadline| deadline >= turn + timeout));
        let after = pacer.ready_at().unwrap();
        assert!(after > turn + QUANTUM);
        let contribution = sent(&mut protocol, after);
        let blocks: Vec<(u16, u32)> =
            contribution.iter().map(|p| parsed(p)).map(|p: PacketRepr| (p.slot, p.block)).collect();
        assert_eq!(blocks, [(1, 3)]);
    }

    /// A silent turn begins the wait of its own round only: when a round's result comes
    /// before its turn is taken and the next round is silent too, the slot has two turns
    /// queued, and the first, taken, books a result's time but begins no wait.
    #[test]
    fn a_silent_turn_outrun_by_its_result_leaves_the_next_rounds_wait_to_its_own_turn() {
        let start = Instant::now();
        // Slot 0's stream is blocks 0, 2, 4 ... of which 8 is this worker's first; slot
        // 1's is 1, 3, 5 ... from 3.
        let (pacer, mut protocol, second) =
            sparse_behind_a_measured_rate(start, Duration::from_millis(10), &[3, 5, 7, 8, 9]);
        // Slot 1 contributes block 3 next, so the turns wait behind its sending; slot 0's
        // round 1 (block 2) and, its result come at once, round 2 (block 4) are silent.
        let now = second + Duration::from_micros(100);
        protocol.handle_datagram(now, &sparse_result(1, 0, 1, 3, 0), &mut Numbers);
        protocol.handle_datagram(now, &sparse_result(0, 0, 0, 2, 0), &mut Numbers);
        protocol.handle_datagram(now, &sparse_result(0, 1, 2, 4, 0), &mut Numbers);
        assert_eq!(protocol.slots[0].silent_turn, Some(2));
        let queued =
            |protocol: &WorkerProtocol, round: u32| protocol.paced.contains(&PacedTurn::Silent(0, round));
        assert!(queued(&protocol, 1) && queued(&protocol, 2), "slot 0 has two turns queued");
        // The stale turn, for round 1, comes first: booked, and round 2's wait not begun
        // (its timer, if an acknowledgement armed it, fires to no effect until then).
        let mut turns = 0;
        while queued(&protocol, 1) {
            sent(&mut protocol, pacer.ready_at().unwrap_or(now));
            turns += 1;
            assert!(turns <= 3, "the turns are taken");
        }
        assert!(queued(&protocol, 2));
        assert_eq!(protocol.slots[0].silent_turn, Some(2), "the stale turn starts no wait");
        while queued(&protocol, 2) {
            sent(&mut protocol, pacer.ready_at().unwrap());
            turns += 1;
            assert!(turns <= 4, "the turns are taken");
        }
        assert_eq!(protocol.slots[0].silent_turn, None);
        assert!(protocol.slots[0].deadline.is_some(), "round 2's own turn starts its wait");
    }

    /// Behind a measured rate, a silent slot's request, which draws its round's result
    /// down the path again, is booked at the pacer (and still leaves at once); a
    /// contributing slot's, which asks whether the switch holds its contribution, is not.
    #[test]
    fn a_silent_slots_request_is_booked_at_the_pacer_and_a_contributing_slots_is_not() {
        let start = Instant::now();
        let (pacer, mut protocol, second) =
            sparse_behind_a_measured_rate(start, Duration::from_millis(10), &[3, 4, 5, 7, 9]);
        // Slot 0 goes silent (another worker's block 2 next); slot 1 sends its block 3.
        protocol.handle_datagram(second, &sparse_result(0, 0, 0, 2, 0), &mut Numbers);
        protocol.handle_datagram(second, &sparse_result(1, 0, 1, 3, 0), &mut Numbers);
        sent(&mut protocol, second);
        let mut request = |index: u16, round: u32| {
            let before = pacer.ready_at().unwrap();
            protocol.pending.push_back((index, Send::Request { round }));
            assert_eq!(sent(&mut protocol, second).len(), 1, "slot {index}'s request leaves at once");
            pacer.ready_at().unwrap() - before
        };
        assert!(request(0, 1) > Duration::ZERO, "the silent slot's request takes a result's time");
        assert_eq!(request(1, 1), Duration::ZERO, "the contributing slot's takes none");
    }

    #[test]
    fn a_retransmission_of_a_round_answered_meanwhile_is_not_sent() {
        let start = Instant::now();
        let timeout = Duration::from_millis(10);
        let mut protocol = running(start, 1, 2, timeout);
        let first = sent(&mut protocol, start);
        // The timer fires, and the result arrives before the retransmission goes out.
        protocol.handle_timeout(start + timeout);
        protocol.handle_datagram(start + timeout, &result_of(&first[0]), &mut Numbers);
        let next = sent(&mut protocol, start + timeout);
        assert_eq!(next.len(), 1, "the next block, once");
        let repr = PacketRepr::parse(&Packet::new_checked(&next[0][..]).unwrap());
        assert_eq!((repr.block, repr.flags), (1, Flags::NONE));
        assert_eq!(protocol.counters().retransmissions, 0);
    }
}
