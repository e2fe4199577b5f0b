//! A set of worker ranks, as a bitmap of any width.

/// A bitmap over the ranks `0..capacity` of one session.
///
/// The first 64 ranks are held in the struct itself: most sessions have no more, and
/// their sets then cost no pointer chased per packet (the engine reads and writes two
/// bitmaps a packet, of sets scattered over its memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSet {
    /// Ranks 0 to 63.
    first: u64,
    /// Ranks from 64 on, 64 a word; empty, and not allocated, up to 64 workers.
    rest: Box<[u64]>,
}

impl WorkerSet {
    /// An empty set able to hold ranks `0..capacity` (and, a word at a time, up to the
    /// next multiple of 64).
    pub fn new(capacity: u16) -> WorkerSet {
        WorkerSet { first: 0, rest: vec![0; Self::rest_words(capacity)].into_boxed_slice() }
    }

    /// The set of all ranks `0..capacity`.
    pub fn full(capacity: u16) -> WorkerSet {
        let mut set = WorkerSet::new(capacity);
        set.fill(capacity);
        set
    }

    /// Words beyond the first that ranks `0..capacity` need.
    fn rest_words(capacity: u16) -> usize {
        (capacity as usize).div_ceil(64).saturating_sub(1)
    }

    /// The word of `rank`, if the set has one.
    fn word(&self, rank: usize) -> Option<&u64> {
        if rank < 64 {
            Some(&self.first)
        } else {
            self.rest.get(rank / 64 - 1)
        }
    }

    fn word_mut(&mut self, rank: usize) -> Option<&mut u64> {
        if rank < 64 {
            Some(&mut self.first)
        } else {
            self.rest.get_mut(rank / 64 - 1)
        }
    }

    /// Every word, ranks `64·i..64·(i + 1)` in the `i`-th.
    fn words(&self) -> impl Iterator<Item = &u64> {
        core::iter::once(&self.first).chain(self.rest.iter())
    }

    /// Makes the set hold exactly the ranks `0..capacity`. The first word on its own, with
    /// no iterator chained over the others: this runs every round, and through
    /// `once(..).chain(..)` took 45 instructions a packet of the dummy client path.
    #[inline]
    pub fn fill(&mut self, capacity: u16) {
        let capacity = capacity as usize;
        let word = |low: usize| match capacity.saturating_sub(low) {
            0 => 0,
            n if n >= 64 => u64::MAX,
            n => (1u64 << n) - 1,
        };
        self.first = word(0);
        for (i, rest) in self.rest.iter_mut().enumerate() {
            *rest = word((i + 1) * 64);
        }
    }

    /// Ranks are checked against the session's size before they reach a set; an
    /// out-of-range rank is reported as absent rather than panicking.
    pub fn contains(&self, rank: u16) -> bool {
        let rank = rank as usize;
        self.word(rank).is_some_and(|w| w & (1 << (rank % 64)) != 0)
    }

    pub fn insert(&mut self, rank: u16) {
        let rank = rank as usize;
        if let Some(word) = self.word_mut(rank) {
            *word |= 1 << (rank % 64);
        }
    }

    pub fn remove(&mut self, rank: u16) {
        let rank = rank as usize;
        if let Some(word) = self.word_mut(rank) {
            *word &= !(1 << (rank % 64));
        }
    }

    pub fn clear(&mut self) {
        self.first = 0;
        // Never `fill` an empty `rest`: on this project's machines (AMD EPYC, glibc's
        // AVX-512 memset) a zero-length memset at an empty slice's dangling address takes
        // about 110 ns, against 1.5 ns at a real one (short lengths are stored through a
        // vector mask, apparently slow to suppress at an unmapped address), and twice a
        // packet it made the dummy-backend client path twice as slow.
        if !self.rest.is_empty() {
            self.rest.fill(0);
        }
    }

    pub fn is_empty(&self) -> bool {
        // As `fill`: the first word on its own, as every packet asks.
        self.first == 0 && self.rest.iter().all(|&w| w == 0)
    }

    pub fn len(&self) -> usize {
        self.words().map(|w| w.count_ones() as usize).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.words().enumerate().flat_map(|(i, &word)| {
            let mut rest = word;
            core::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let bit = rest.trailing_zeros();
                rest &= rest - 1;
                Some((i * 64) as u16 + bit as u16)
            })
        })
    }

    /// Bytes a set for `capacity` ranks occupies on the heap: none up to 64.
    pub fn heap_bytes(capacity: u16) -> usize {
        Self::rest_words(capacity) * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_more_than_64_ranks() {
        let mut set = WorkerSet::new(130);
        for rank in [0, 63, 64, 129] {
            set.insert(rank);
        }
        assert_eq!(set.iter().collect::<Vec<_>>(), [0, 63, 64, 129]);
        assert_eq!(set.len(), 4);
        set.remove(64);
        assert!(!set.contains(64));
        assert!(set.contains(129));
        assert!(!set.contains(500));
        set.insert(500);
        assert_eq!(set.len(), 3);
    }

    #[test]
    fn full_holds_exactly_the_capacity() {
        for capacity in [1u16, 63, 64, 65, 128, 200] {
            let set = WorkerSet::full(capacity);
            assert_eq!(set.len(), capacity as usize);
            assert!(set.contains(capacity - 1));
            assert!(!set.contains(capacity));
        }
        assert!(WorkerSet::new(64).is_empty());
        let mut beyond = WorkerSet::new(130);
        beyond.insert(129);
        assert!(!beyond.is_empty(), "a rank past the first word");
        beyond.fill(65);
        assert_eq!(beyond.iter().collect::<Vec<_>>(), (0..65).collect::<Vec<_>>());
        beyond.fill(0);
        assert!(beyond.is_empty());
    }

    #[test]
    fn up_to_64_ranks_need_no_heap() {
        assert_eq!((WorkerSet::heap_bytes(1), WorkerSet::heap_bytes(64)), (0, 0));
        assert_eq!((WorkerSet::heap_bytes(65), WorkerSet::heap_bytes(1024)), (8, 120));
        let mut set = WorkerSet::new(64);
        set.insert(63);
        set.insert(64);
        assert_eq!(set.iter().collect::<Vec<_>>(), [63]);
        set.clear();
        assert!(set.is_empty());

        let mut set = WorkerSet::new(130);
        for rank in [3, 70, 129] {
            set.insert(rank);
        }
        set.clear();
        assert!(set.is_empty() && !set.contains(70) && !set.contains(129));
        set.fill(130);
        assert_eq!(set.len(), 130);
    }
}
