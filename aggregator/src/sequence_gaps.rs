//! Gaps in a stream of packets numbered modulo 256: which numbers the receiver takes as
//! lost.
//!
//! Both directions number their packets this way (`PacketRepr::sequence`): the switch its
//! broadcasts to each worker thread, a worker thread its contributions' first sendings to
//! each switch endpoint. A number stays missing only on a path that reorders or loses; it
//! counts as lost once a number [`REORDER_PACKETS`] past it has come, as TCP waits for
//! three duplicate acknowledgements.

/// How far past a missing number a packet must come for it to be taken as lost rather
/// than reordered.
pub(crate) const REORDER_PACKETS: u32 = 3;

/// What a receiver has seen of one sender's numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SequenceGaps {
    /// The number the next packet should carry, once one has come.
    next: Option<u8>,
    /// Bit `i`, below [`REORDER_PACKETS`]: number `next - 1 - i` has not come (bit 0,
    /// the latest, always has); those further back are lost already.
    missing: u64,
}

/// The numbers one packet showed lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lost {
    /// How many numbers are now taken as lost, each counted once.
    pub(crate) count: u32,
    /// The latest of them (meaningless when `count` is 0).
    pub(crate) newest: u8,
}

impl Lost {
    const NONE: Lost = Lost { count: 0, newest: 0 };
}

impl SequenceGaps {
    /// Nothing seen yet.
    pub(crate) const NEW: SequenceGaps = SequenceGaps { next: None, missing: 0 };

    /// Takes packet number `sequence`; returns the numbers now taken as lost, missing
    /// while one [`REORDER_PACKETS`] or more past them has come.
    // Inlined by force, the rest kept apart: both sides take a number per packet, and
    // nearly always the next one with none missing.
    #[inline(always)]
    pub(crate) fn take(&mut self, sequence: u8) -> Lost {
        if self.next == Some(sequence) && self.missing == 0 {
            self.next = Some(sequence.wrapping_add(1));
            return Lost::NONE;
        }
        self.take_out_of_order(sequence)
    }

    /// [`SequenceGaps::take`] of a number that is not the next, or with numbers missing.
    #[inline(never)]
    fn take_out_of_order(&mut self, sequence: u8) -> Lost {
        let Some(next) = self.next else {
            self.next = Some(sequence.wrapping_add(1));
            return Lost::NONE;
        };
        let skipped = sequence.wrapping_sub(next);
        if skipped >= 128 {
            // Behind `next`: a number reordered into its gap, or a duplicate.
            let behind = u32::from(next.wrapping_sub(1).wrapping_sub(sequence));
            if behind < REORDER_PACKETS {
                self.missing &= !(1 << behind);
            }
            return Lost::NONE;
        }
        // Numbers past `next` skipped, and the ones already missing, move `skipped + 1`
        // places back: each that reaches the allowance is lost, the others still missing.
        let skipped = u32::from(skipped);
        self.next = Some(sequence.wrapping_add(1));
        let moved = skipped + 1;
        let window = (1u64 << REORDER_PACKETS) - 1;
        // Bit `i`: number `next - 1 - i`, lost now.
        let (old_lost, old_kept) = if moved >= REORDER_PACKETS {
            (self.missing, 0)
        } else {
            let kept_bits = REORDER_PACKETS - moved;
            (self.missing >> kept_bits << kept_bits, self.missing << moved & window)
        };
        let new_lost = skipped.saturating_sub(REORDER_PACKETS - 1);
        let new_kept = ((1u64 << skipped.min(REORDER_PACKETS - 1)) - 1) << 1;
        self.missing = old_kept | new_kept;
        // The skipped numbers are all later than the ones missing before.
        let newest = if new_lost > 0 {
            sequence.wrapping_sub(REORDER_PACKETS as u8)
        } else {
            next.wrapping_sub(1).wrapping_sub(old_lost.trailing_zeros() as u8)
        };
        Lost { count: old_lost.count_ones() + new_lost, newest }
    }

    /// Whether every number within the allowance behind the latest has come.
    pub(crate) fn none_missing(&self) -> bool {
        self.missing == 0
    }

    /// Forgets the numbers still missing: they will not be counted lost.
    pub(crate) fn forget_missing(&mut self) {
        self.missing = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(numbers: &[u8]) -> Vec<u32> {
        let mut gaps = SequenceGaps::default();
        numbers.iter().map(|&n| gaps.take(n).count).collect()
    }

    #[test]
    fn a_missing_number_is_lost_once_the_number_three_past_it_comes() {
        assert_eq!(counts(&[7, 8, 10, 11, 12]), [0, 0, 0, 0, 1]);
        // Two missing at once, each lost when the number three past it comes; a jump
        // past the allowance loses all but the last two at once.
        assert_eq!(counts(&[1, 4, 5, 6, 7]), [0, 0, 1, 1, 0]);
        assert_eq!(counts(&[1, 9]), [0, 5]);
        // The largest jump a byte tells from a late number, 127 skipped.
        assert_eq!(counts(&[1, 129, 130]), [0, 125, 1]);
    }

    #[test]
    fn a_number_reordered_within_the_allowance_or_duplicated_is_not_lost() {
        assert_eq!(counts(&[1, 3, 4, 2, 5, 6, 7]), [0; 7]);
        assert_eq!(counts(&[1, 2, 2, 1, 3, 4, 5, 6]), [0; 8]);
        // Too late: lost already, and not counted again when it comes.
        assert_eq!(counts(&[1, 3, 4, 5, 2, 6]), [0, 0, 0, 1, 0, 0]);
    }

    #[test]
    fn numbers_wrap_and_forgotten_ones_are_never_lost() {
        assert_eq!(counts(&[254, 255, 0, 2, 3, 4]), [0, 0, 0, 0, 0, 1]);
        let mut gaps = SequenceGaps::default();
        for n in [1, 3, 4] {
            gaps.take(n);
        }
        assert!(!gaps.none_missing());
        gaps.forget_missing();
        assert!(gaps.none_missing());
        assert_eq!([5, 6, 7].map(|n| gaps.take(n).count), [0, 0, 0]);
    }

    #[test]
    fn the_newest_lost_number_is_named() {
        let mut gaps = SequenceGaps::default();
        let lost: Vec<Lost> = [7, 8, 10, 11, 12].iter().map(|&n| gaps.take(n)).collect();
        assert_eq!(lost[4], Lost { count: 1, newest: 9 });
        assert!(gaps.none_missing(), "10, 11 and 12 came");
        // A run: 14 and 15 lost, found one at a time, then a jump naming 20 the newest of 4.
        let mut gaps = SequenceGaps::default();
        let lost: Vec<Lost> = [13, 16, 17, 18, 23].iter().map(|&n| gaps.take(n)).collect();
        assert_eq!(lost[2], Lost { count: 1, newest: 14 });
        assert_eq!(lost[3], Lost { count: 1, newest: 15 });
        assert_eq!(lost[4], Lost { count: 2, newest: 20 });
        // Across the wrap.
        let mut gaps = SequenceGaps::default();
        let lost: Vec<Lost> = [254, 0, 1, 2].iter().map(|&n| gaps.take(n)).collect();
        assert_eq!(lost[3], Lost { count: 1, newest: 255 });
    }
}
