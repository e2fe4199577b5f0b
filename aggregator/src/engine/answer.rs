//! What the engine answers: a round's result, to every worker or again to one, the
//! pending notice telling a worker that a round it asks about is still aggregating, and
//! the progress report answering a worker's probe.

use std::ops::Range;

use netagg_wire::packet::{BROADCAST_RANK, ELEMENT_LEN};
use netagg_wire::{ElementType, Flags, MessageType, PacketRepr};

use super::session::Session;
use super::{DropReason, Recipient, Transmit, Verdict};
use crate::round::is_after;
use crate::sum16;

impl Session {
    /// Answers a worker asking for the result of `repr`'s round, or contributing to it
    /// again: with the result if the slot retains it (to contributors only, if
    /// `only_contributors`), or with a pending notice if the round is still aggregating.
    pub(super) fn resend_result(
        &mut self,
        repr: &PacketRepr,
        only_contributors: bool,
        out: &mut [u8],
    ) -> Verdict {
        let (slot, round, rank) = (repr.slot, repr.round, repr.rank);
        let Some(index) = self.retained_set(slot, round) else {
            if round == self.slots[slot as usize].open_round {
                self.counters.not_ready += 1;
                return self.emit_pending(repr, out);
            }
            if is_after(round, self.slots[slot as usize].open_round) {
                return self.reject(DropReason::TooEarly);
            }
            self.counters.stale += 1;
            return Verdict::Dropped(DropReason::Stale);
        };
        if only_contributors && !self.sets[index].contributed.contains(rank) {
            return self.reject(DropReason::NotExpected);
        }
        self.counters.results_resent += 1;
        self.emit_result(index, slot, Recipient::Worker(rank), out)
    }

    /// Tells the sender of `repr` that its round is still aggregating, and whether its
    /// own contribution is in: so that a worker waiting for a late peer stops resending.
    pub(super) fn emit_pending(&self, repr: &PacketRepr, out: &mut [u8]) -> Verdict {
        let notice = PacketRepr {
            flags: if self.contributed(repr.slot, repr.rank) { Flags::CONTRIBUTED } else { Flags::NONE },
            job: repr.job,
            rank: repr.rank.wrapping_add(self.rank_base),
            slot: repr.slot,
            round: repr.round,
            ..PacketRepr::new(MessageType::Pending, repr.element_type, self.id.0, self.token, 0)
        };
        // `handle` checked that `out` holds a full packet, so a header too.
        match notice.emit(out) {
            Ok(mut packet) => Verdict::Send(Transmit {
                session: self.id,
                recipient: Recipient::Worker(repr.rank),
                len: self.integrity.seal(&mut packet),
            }),
            Err(_) => Verdict::Dropped(DropReason::OutputTooSmall),
        }
    }

    /// Tells the workers refused a set for the open round of `repr`'s slot that the round
    /// has one now, or a free one waits for it, if so: a pending notice without
    /// `CONTRIBUTED` (to the one worker, or to all when several were refused), on which
    /// each sends its contribution again at once. Without it a stalled contribution waits
    /// for its timer: a silent worker whose acknowledgements lag (a sparse stream's, behind
    /// a slow link or a descheduled thread) would cost every contributor a timeout.
    pub(super) fn announce_room(&mut self, repr: &PacketRepr, out: &mut [u8]) -> Option<Verdict> {
        let slot = &mut self.slots[repr.slot as usize];
        let depth_mask = u64::MAX >> (64 - self.spec.depth as u32);
        let room = slot.open_set.is_some() || slot.retained & depth_mask != depth_mask;
        if slot.refused.is_empty() || !room {
            return None;
        }
        let recipient = {
            let mut refused = slot.refused.iter();
            match (refused.next(), refused.next()) {
                (Some(rank), None) => Recipient::Worker(rank),
                _ => Recipient::All,
            }
        };
        slot.refused.clear();
        let notice = PacketRepr {
            job: repr.job,
            rank: match recipient {
                Recipient::Worker(rank) => rank.wrapping_add(self.rank_base),
                Recipient::All | Recipient::Upstream => BROADCAST_RANK,
            },
            slot: repr.slot,
            round: slot.open_round,
            ..PacketRepr::new(MessageType::Pending, repr.element_type, self.id.0, self.token, 0)
        };
        // `handle` checked that `out` holds a full packet, so a header too.
        let len = notice.emit(out).ok()?.seal();
        Some(Verdict::Send(Transmit { session: self.id, recipient, len }))
    }

    /// Answers probe `repr` about `slots`, at most 64 from the probed one: the open round
    /// of each, and which of them hold the prober's contribution.
    /// A round before a slot's open round has completed, so the worker learns at once every
    /// result it lost, which no later packet would reveal, and every contribution the
    /// switch lacks: a lost tail costs one round trip, not a timeout per slot.
    pub(super) fn emit_progress(&self, slots: Range<u16>, repr: &PacketRepr, out: &mut [u8]) -> Verdict {
        let mut report = PacketRepr {
            job: repr.job,
            packet_id: repr.packet_id,
            rank: repr.rank.wrapping_add(self.rank_base),
            slot: repr.slot,
            round: repr.round,
            // The report's elements are rounds, whatever the session's tensors hold.
            ..PacketRepr::new(
                MessageType::Progress,
                ElementType::Int32,
                self.id.0,
                self.token,
                slots.len() as u16,
            )
        };
        let contributions =
            slots.clone().rev().fold(0u64, |map, slot| map << 1 | self.contributed(slot, repr.rank) as u64);
        report.set_contributions(contributions);
        // `handle` checked that `out` holds a full packet of the session, which may be
        // shorter than a report: `emit` says so.
        match report.emit(out) {
            Ok(mut packet) => {
                let rounds = packet.payload_mut().chunks_exact_mut(ELEMENT_LEN);
                for (round, slot) in rounds.zip(slots) {
                    round.copy_from_slice(&self.slots[slot as usize].open_round.to_le_bytes());
                }
                let len = self.integrity.seal(&mut packet);
                Verdict::Send(Transmit { session: self.id, recipient: Recipient::Worker(repr.rank), len })
            }
            Err(_) => Verdict::Dropped(DropReason::OutputTooSmall),
        }
    }

    pub(super) fn emit_result(
        &mut self,
        index: usize,
        slot: u16,
        recipient: Recipient,
        out: &mut [u8],
    ) -> Verdict {
        let set = &self.sets[index];
        let mut repr = PacketRepr {
            message_type: MessageType::Result,
            element_type: set.element_type,
            flags: if set.sparse { Flags::SPARSE } else { Flags::NONE },
            session: self.id.0,
            job: set.job,
            packet_id: set.packet_id,
            rank: match recipient {
                Recipient::All | Recipient::Upstream => BROADCAST_RANK,
                Recipient::Worker(rank) => rank.wrapping_add(self.rank_base),
            },
            element_count: set.element_count,
            slot,
            exponent: set.exponent,
            round: set.round,
            block: set.block,
            next_block: set.next_block,
            ack_round: 0,
            token: self.token,
        };
        repr.set_completed_by(set.completed_by.map(|rank| rank.wrapping_add(self.rank_base)));
        // `handle` checked that `out` holds a full packet of the session.
        match repr.emit(out) {
            Ok(mut packet) => {
                // Every emission of the round rounds the same float32 sums the same way:
                // a result sent again is the same bytes.
                let sum =
                    &self.payloads[index * self.payload_len..][..set.element_count as usize * ELEMENT_LEN];
                sum16::narrow(set.element_type, packet.payload_mut(), sum);
                // Sealed where it was just written, in the batch it leaves in: a broadcast
                // is sealed once for all its recipients.
                let len = self.integrity.seal(&mut packet);
                Verdict::Send(Transmit { session: self.id, recipient, len })
            }
            Err(_) => Verdict::Dropped(DropReason::OutputTooSmall),
        }
    }
}
