//! Which workers a slot's open round expects: every one in a start round, or those
//! whose sparse streams go on at its block.
//!
//! A *start* round expects every worker. Dense rounds are all start rounds. In a sparse
//! stream each contribution also names the sender's next non-zero block; when a round
//! completes, the stream moves to the smallest of those, and only the workers that named
//! it are expected in the next round. A stream whose next block is [`END_OF_STREAM`]
//! ends, and the slot's next round is a start round again.

use netagg_wire::packet::END_OF_STREAM;

use super::slot::Slot;

impl Slot {
    /// Contributions that complete the open round: every one of the session's `workers`
    /// in a start round, the expected ones in a continuation.
    pub(super) fn expected_contributions(&self, workers: u16) -> usize {
        match self.continuation {
            Some(_) => self.expected.len(),
            None => workers as usize,
        }
    }

    /// Sets up the round after one that completed: a sparse stream (`sparse`) goes on at
    /// the smallest next block its workers named, with the workers that named it;
    /// otherwise the next round is a start round. Returns the block the stream goes on
    /// at, [`END_OF_STREAM`] if none: the completed round's result names it.
    #[inline]
    pub(super) fn schedule_next_round(&mut self, sparse: bool) -> u32 {
        if !sparse {
            self.continuation = None;
            return END_OF_STREAM;
        }
        let next = self.lowest_next_block();
        self.continue_at(next);
        next
    }

    /// The smallest next block the workers' streams named: where a sparse stream goes on.
    pub(super) fn lowest_next_block(&self) -> u32 {
        self.next_blocks.iter().copied().min().unwrap_or(END_OF_STREAM)
    }

    /// Sets up a sparse stream's next round at block `next`, expecting the workers whose
    /// streams named it (none, in a group whose upper switch goes on at a block another
    /// group has); a start round if `next` is [`END_OF_STREAM`].
    pub(super) fn continue_at(&mut self, next: u32) {
        self.continuation = None;
        if next != END_OF_STREAM {
            self.continuation = Some(next);
            self.expected.clear();
            for (rank, &block) in self.next_blocks.iter().enumerate() {
                if block == next {
                    self.expected.insert(rank as u16);
                }
            }
        }
    }

    /// Whether the open round is a continuation no worker of this session contributes to.
    pub(super) fn expects_no_one(&self) -> bool {
        self.continuation.is_some() && self.expected.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{one_slot, sparse};
    use super::super::{Departure, Verdict};
    use super::*;

    #[test]
    fn a_sparse_continuation_needs_only_the_ranks_whose_streams_have_its_block() {
        // Rank 0's stream ends after block 0; rank 1's goes on at block 5, so the next
        // round of the slot is a continuation only rank 1 contributes to.
        let (mut engine, session, now, mut out) = one_slot(4);
        engine.handle_datagram(now, &sparse(session, 0, 0, 0, END_OF_STREAM), &mut out);
        engine.handle_datagram(now, &sparse(session, 1, 0, 0, 5), &mut out);
        // Rank 0 may leave; rank 1 may not, though nothing of block 5 has arrived yet.
        assert_eq!(engine.depart(session, 1), Ok(Departure::Needed));
        assert_eq!(engine.depart(session, 0), Ok(Departure::Lingers));
        let completed = engine.handle_datagram(now, &sparse(session, 1, 1, 5, END_OF_STREAM), &mut out);
        assert!(matches!(completed, Verdict::Send(_)), "{completed:?}");
        assert!(!engine.has_orphaned());
        // The next start round needs rank 0: the session cannot go on.
        engine.handle_datagram(now, &sparse(session, 1, 2, 0, END_OF_STREAM), &mut out);
        assert_eq!(engine.take_orphaned(), [(session, 0)]);
    }
}
