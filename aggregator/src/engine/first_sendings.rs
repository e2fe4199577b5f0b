//! Lost contributions found by the workers' numbering of their first sendings.
//!
//! The mirror of `sequence`: every worker thread numbers its contributions' first
//! sendings to this switch (`PacketRepr::sequence` on data without `RETRANSMISSION`), so
//! the switch sees a lost contribution as a gap a few of that thread's packets after the
//! loss. Without it the round waits, for every worker, until the member that lost it
//! finds out from its own evidence: a later result overtaking it, after a reorder
//! allowance of tens of milliseconds on a worker whose round trips include waiting for
//! peers. The switch tells the member (a pending notice with `LOST` naming the number),
//! and the member sends that contribution again through its pacer.
//!
//! Only isolated losses are told. Behind a short queue losses come in runs: a notice per
//! lost packet would have the member resend a run into the queue that dropped it, where
//! its timers' backoff spaces the resends and its pacer, told of the losses, slows down.
//! So a number lost within three of another, or while a later one is still missing, is
//! left to the member, and a member thread is told at most once per [`NOTICE_SPACING`]
//! of its first sendings. The notice answers the packet that showed the loss, if the switch
//! would not otherwise answer it; if that packet completed a round, whose result goes
//! to every worker, it waits in a short queue that the shells drain
//! (`Engine::poll_notice`), so that the member that completes most rounds, the last to
//! contribute, is told as soon as the others.

use crate::sequence_gaps::{Lost, SequenceGaps, REORDER_PACKETS};

/// A member thread is told of at most one lost contribution per this many of its first
/// sendings, so that a burst the isolation test misses cannot become a burst of resends.
const NOTICE_SPACING: u32 = 32;

/// What the switch has seen of one member thread's numbers.
#[derive(Debug, Clone, Copy)]
struct MemberThread {
    gaps: SequenceGaps,
    /// The latest number taken as lost.
    last_lost: Option<u8>,
    /// First sendings since the last notice.
    since_notice: u32,
}

impl MemberThread {
    const NEW: MemberThread =
        MemberThread { gaps: SequenceGaps::NEW, last_lost: None, since_notice: NOTICE_SPACING };
}

/// The numbers of every member thread's first sendings, one sequence per rank and
/// thread (the threads `sequence::BroadcastNumbers` splits the slots into).
#[derive(Debug)]
pub(super) struct SendingGaps {
    members: Vec<MemberThread>,
    threads: usize,
}

impl SendingGaps {
    /// Bytes each member thread's numbering holds.
    pub(super) const MEMBER_THREAD_BYTES: usize = core::mem::size_of::<MemberThread>();

    /// One sequence per thread of each of `workers` ranks, each running `threads`.
    pub(super) fn new(workers: u16, threads: usize) -> SendingGaps {
        let threads = threads.max(1);
        SendingGaps { members: vec![MemberThread::NEW; usize::from(workers) * threads], threads }
    }

    /// Takes first sending number `sequence` of rank `rank`'s thread `thread`; returns the
    /// number to tell that member of, if it shows an isolated contribution lost.
    // Inlined by force into the engine's per-packet path; a loss is handled apart.
    #[inline(always)]
    pub(super) fn take(&mut self, rank: u16, thread: usize, sequence: u8) -> Option<u8> {
        let member = self.members.get_mut(usize::from(rank) * self.threads + thread)?;
        member.since_notice = member.since_notice.saturating_add(1);
        let lost = member.gaps.take(sequence);
        if lost.count == 0 {
            return None;
        }
        Self::lost(member, lost)
    }

    /// Whether `member`'s numbers now taken as `lost` warrant a notice: the number to tell.
    #[inline(never)]
    fn lost(member: &mut MemberThread, lost: Lost) -> Option<u8> {
        let near_loss =
            member.last_lost.is_some_and(|last| u32::from(lost.newest.wrapping_sub(last)) <= REORDER_PACKETS);
        member.last_lost = Some(lost.newest);
        // A run is congestion, for the member's pacer and timers, not a notice apiece.
        let isolated = lost.count == 1 && !near_loss && member.gaps.none_missing();
        if !isolated || member.since_notice < NOTICE_SPACING {
            return None;
        }
        member.since_notice = 0;
        Some(lost.newest)
    }

    /// How many notices may wait for the shell at once: one per member thread.
    pub(super) fn members(&self) -> usize {
        self.members.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use netagg_wire::packet::{datagram_len, MAX_ELEMENTS};
    use netagg_wire::{ElementType, Flags, MessageType, Packet, PacketRepr};

    use super::super::{Engine, EngineLimits, Recipient, SessionId, SessionSpec, Transmit, Verdict};
    use super::*;

    /// Rank `rank`'s first sending numbered `number`, to round 0 of `slot`.
    fn numbered(session: SessionId, rank: u16, slot: u16, number: u8) -> Vec<u8> {
        let repr = PacketRepr {
            rank,
            slot,
            sequence: number,
            ack_round: u32::MAX,
            ..PacketRepr::new(MessageType::Data, ElementType::Int32, session.0, 7, 1)
        };
        let mut buffer = vec![0; repr.buffer_len()];
        repr.emit(&mut buffer).unwrap().seal();
        buffer
    }

    /// The (slot, sequence) of a lost-contribution notice to rank 0 in `out`.
    fn lost_notice(transmit: Transmit, out: &[u8]) -> (u16, u8) {
        assert_eq!(transmit.recipient, Recipient::Worker(0));
        let notice = PacketRepr::parse(&Packet::new_checked(&out[..transmit.len]).unwrap());
        assert_eq!((notice.message_type, notice.flags), (MessageType::Pending, Flags::LOST));
        (notice.slot, notice.sequence)
    }

    #[test]
    fn the_engine_tells_a_member_of_an_isolated_lost_contribution_at_once_and_of_a_run_nothing() {
        let mut engine = Engine::new(EngineLimits::default());
        let now = Instant::now();
        let spec = SessionSpec { workers: 2, slots: 8, packet_elements: 4, depth: 2 };
        let session = engine.open_session(now, spec, 7).unwrap();
        let mut out = vec![0; datagram_len(MAX_ELEMENTS)];
        // Rank 0 numbers slots 0-6 as 0-6; number 2 (slot 2) is lost. Rank 1 has
        // contributed to slot 6 only, so rank 0's packet to it completes that round.
        engine.handle_datagram(now, &numbered(session, 1, 6, 0), &mut out);
        for (slot, number) in [(0, 0), (1, 1), (3, 3), (4, 4)] {
            let verdict = engine.handle_datagram(now, &numbered(session, 0, slot, number), &mut out);
            assert_eq!(verdict, Verdict::Consumed, "number {number}");
        }
        // Number 5 comes three past the missing 2: the notice answers it.
        let Verdict::Send(transmit) = engine.handle_datagram(now, &numbered(session, 0, 5, 5), &mut out)
        else {
            panic!("no notice")
        };
        assert_eq!(lost_notice(transmit, &out), (5, 2));
        assert_eq!(engine.poll_notice(&mut out), None);
        // Number 9 (slot 6) skips 6-8, a run: the slot's result goes to every worker, and
        // no notice waits behind it.
        let verdict = engine.handle_datagram(now, &numbered(session, 0, 6, 9), &mut out);
        assert!(matches!(verdict, Verdict::Send(Transmit { recipient: Recipient::All, .. })), "{verdict:?}");
        assert_eq!(engine.poll_notice(&mut out), None, "a run of losses is told nothing");
        assert_eq!(engine.session(session).unwrap().1.lost_notices, 1);
    }

    #[test]
    fn a_notice_whose_packet_completed_a_round_waits_behind_its_result() {
        let mut engine = Engine::new(EngineLimits::default());
        let now = Instant::now();
        let spec = SessionSpec { workers: 2, slots: 8, packet_elements: 4, depth: 2 };
        let session = engine.open_session(now, spec, 7).unwrap();
        let mut out = vec![0; datagram_len(MAX_ELEMENTS)];
        engine.handle_datagram(now, &numbered(session, 1, 4, 0), &mut out);
        for (slot, number) in [(0, 0), (2, 2), (3, 3)] {
            engine.handle_datagram(now, &numbered(session, 0, slot, number), &mut out);
        }
        // Number 4 shows 1 lost, and completes slot 4's round: the result goes first.
        let verdict = engine.handle_datagram(now, &numbered(session, 0, 4, 4), &mut out);
        assert!(matches!(verdict, Verdict::Send(Transmit { recipient: Recipient::All, .. })), "{verdict:?}");
        let transmit = engine.poll_notice(&mut out).expect("the notice, after the result");
        assert_eq!(lost_notice(transmit, &out), (4, 1));
        assert_eq!(engine.poll_notice(&mut out), None);
    }

    /// The notices owed as member thread 0 of rank 1 sends `numbers`: after each, the
    /// number to tell it of.
    fn owed(numbers: impl IntoIterator<Item = u8>) -> Vec<Option<u8>> {
        let mut gaps = SendingGaps::new(2, 2);
        // Another member's numbers are its own.
        for n in [0, 5, 6, 7, 8] {
            assert_eq!(gaps.take(1, 1, n), None);
        }
        numbers.into_iter().map(|n| gaps.take(1, 0, n)).collect()
    }

    #[test]
    fn a_lost_contribution_is_owed_once_the_number_three_past_it_comes() {
        assert_eq!(owed([10, 11, 13, 14, 15, 16]), [None, None, None, None, Some(12), None]);
    }

    #[test]
    fn a_contribution_reordered_within_three_numbers_is_owed_nothing() {
        assert_eq!(owed([10, 12, 13, 11, 14, 15, 16]), [None; 7]);
    }

    #[test]
    fn a_run_of_losses_is_owed_nothing_and_notices_are_spaced() {
        // Two in a row, or two at once: congestion.
        assert_eq!(owed([1, 2, 5, 6, 7, 8]), [None; 6]);
        assert_eq!(owed([1, 2, 9, 10, 11]), [None; 5]);
        // One lost while a later one is still missing, and that one within three of it.
        assert_eq!(owed([1, 2, 4, 6, 7, 8]), [None; 6]);
        // Isolated losses, but the second within the spacing of the first: told once.
        let mut numbers: Vec<u8> = (0..=60).filter(|&n| n != 5 && n != 20).collect();
        numbers.extend((61..=100).filter(|&n| n != 90));
        let told: Vec<u8> = owed(numbers).into_iter().flatten().collect();
        assert_eq!(told, [5, 90]);
    }
}
