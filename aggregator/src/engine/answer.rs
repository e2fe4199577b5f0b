//! What the engine answers: a round's result, to every worker or again to one, the
//! pending notice telling a worker that a round it asks about is still aggregating (or,
//! unasked, that a worker refused a set for the open round may send its contribution
//! again), and the progress report answering a worker's probe.

use std::ops::Range;

use netagg_wire::packet::{BROADCAST_RANK, ELEMENT_LEN};
use netagg_wire::{ElementType, Flags, MessageType, PacketRepr};

use super::session::Session;
use super::{DropReason, Recipient, Transmit, Verdict};
use crate::round::is_after;
use crate::sum16;

/// A pending notice's fields: to the session's worker `rank`, about `round` of `slot`
/// (with `LOST`, about its first sending numbered `sequence`).
#[derive(Debug, Clone, Copy)]
pub(super) struct PendingNotice {
    rank: u16,
    job: u32,
    slot: u16,
    round: u32,
    flags: Flags,
    sequence: u8,
    element_type: ElementType,
}

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
        let flags = if self.contributed(repr.slot, repr.rank) { Flags::CONTRIBUTED } else { Flags::NONE };
        let notice = PendingNotice {
            rank: repr.rank,
            job: repr.job,
            slot: repr.slot,
            round: repr.round,
            flags,
            sequence: 0,
            element_type: repr.element_type,
        };
        self.emit_notice(notice, out)
    }

    /// Tells the sender of contribution `repr`, which the engine answered with `verdict`,
    /// that its thread's first sending numbered `sequence` never came: a pending notice
    /// with `LOST`, about `repr`'s own slot and round, on which the worker sends that
    /// contribution again (`first_sendings`). It answers `repr` if nothing else does;
    /// behind a result or a drop it waits for [`Engine::poll_notice`].
    ///
    /// [`Engine::poll_notice`]: super::Engine::poll_notice
    pub(super) fn tell_lost(
        &mut self,
        repr: &PacketRepr,
        sequence: u8,
        verdict: Verdict,
        out: &mut [u8],
    ) -> Verdict {
        let notice = PendingNotice {
            rank: repr.rank,
            job: repr.job,
            slot: repr.slot,
            round: repr.round,
            flags: Flags::LOST,
            sequence,
            element_type: repr.element_type,
        };
        if verdict == Verdict::Consumed {
            self.counters.lost_notices += 1;
            return self.emit_notice(notice, out);
        }
        // A dropped packet's reason must reach the caller (a departed rank's orphans the
        // session): the notice waits as it does behind a result. One per member thread at
        // most, which the spacing of notices keeps: a full queue is a shell that does not
        // poll, whose notices would only be late.
        if self.lost_notices.len() < self.sendings.members() {
            self.lost_notices.push_back(notice);
        } else {
            self.counters.lost_notices_dropped += 1;
        }
        verdict
    }

    /// The next notice of a lost contribution that waited behind a result, written into
    /// `out`.
    /// A notice `out` cannot hold stays queued.
    pub(super) fn poll_notice(&mut self, out: &mut [u8]) -> Option<Transmit> {
        let notice = *self.lost_notices.front()?;
        let Verdict::Send(transmit) = self.emit_notice(notice, out) else { return None };
        self.lost_notices.pop_front();
        self.counters.lost_notices += 1;
        Some(transmit)
    }

    /// Tells one worker refused a set for the open round of `slot` that the round has one
    /// now, or that a free one waits for it, if so: a pending notice without
    /// `CONTRIBUTED`, on which it sends its contribution again at once. Without it a
    /// stalled contribution waits for its timer: a silent worker whose acknowledgements lag
    /// (a sparse stream's, behind a slow link or a descheduled thread) would cost every
    /// contributor a timeout. One worker at a time, so that no worker whose contribution
    /// is in sends it again: the next refused one is told by the next contribution to the
    /// round (this one's, at the latest) or the next acknowledgement.
    pub(super) fn announce_room(
        &mut self,
        slot: u16,
        element_type: ElementType,
        out: &mut [u8],
    ) -> Option<Verdict> {
        let state = &self.slots[slot as usize];
        if state.open_set.is_none() && self.free_sets(slot) == 0 {
            return None;
        }
        let rank = state.refused.iter().next()?;
        let notice = PendingNotice {
            rank,
            job: state.refused_job,
            slot,
            round: state.open_round,
            flags: Flags::NONE,
            sequence: 0,
            element_type,
        };
        let verdict = self.emit_notice(notice, out);
        if matches!(verdict, Verdict::Send(_)) {
            self.slots[slot as usize].refused.remove(rank);
        }
        Some(verdict)
    }

    /// Emits `notice` to its worker, sealed.
    fn emit_notice(&self, notice: PendingNotice, out: &mut [u8]) -> Verdict {
        let repr = PacketRepr {
            flags: notice.flags,
            job: notice.job,
            rank: notice.rank.wrapping_add(self.rank_base),
            slot: notice.slot,
            round: notice.round,
            sequence: notice.sequence,
            ..PacketRepr::new(MessageType::Pending, notice.element_type, self.id.0, self.token, 0)
        };
        // `handle` checked that `out` holds a full packet, so a header too.
        match repr.emit(out) {
            Ok(mut packet) => Verdict::Send(Transmit {
                session: self.id,
                recipient: Recipient::Worker(notice.rank),
                len: self.integrity.seal(&mut packet),
            }),
            Err(_) => Verdict::Dropped(DropReason::OutputTooSmall),
        }
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
            sequence: 0,
            round: set.round,
            block: set.block,
            next_block: set.next_block,
            ack_round: 0,
            token: self.token,
        };
        repr.set_completed_by(set.completed_by.map(|rank| rank.wrapping_add(self.rank_base)));
        if recipient == Recipient::All {
            repr.sequence = self.broadcasts.number(slot);
        }
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
