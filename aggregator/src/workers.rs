//! A set of worker ranks, as a bitmap of any width.

/// A bitmap over the ranks `0..capacity` of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSet {
    words: Box<[u64]>,
}

impl WorkerSet {
    /// An empty set able to hold ranks `0..capacity`.
    pub fn new(capacity: u16) -> WorkerSet {
        WorkerSet { words: vec![0; (capacity as usize).div_ceil(64)].into_boxed_slice() }
    }

    /// The set of all ranks `0..capacity`.
    pub fn full(capacity: u16) -> WorkerSet {
        let mut set = WorkerSet::new(capacity);
        set.fill(capacity);
        set
    }

    /// Makes the set hold exactly the ranks `0..capacity`.
    pub fn fill(&mut self, capacity: u16) {
        let capacity = capacity as usize;
        for (i, word) in self.words.iter_mut().enumerate() {
            let low = i * 64;
            *word = match capacity.saturating_sub(low) {
                0 => 0,
                n if n >= 64 => u64::MAX,
                n => (1u64 << n) - 1,
            };
        }
    }

    /// Ranks are checked against the session's size before they reach a set; an
    /// out-of-range rank is reported as absent rather than panicking.
    pub fn contains(&self, rank: u16) -> bool {
        let rank = rank as usize;
        self.words.get(rank / 64).is_some_and(|w| w & (1 << (rank % 64)) != 0)
    }

    pub fn insert(&mut self, rank: u16) {
        let rank = rank as usize;
        if let Some(word) = self.words.get_mut(rank / 64) {
            *word |= 1 << (rank % 64);
        }
    }

    pub fn remove(&mut self, rank: u16) {
        let rank = rank as usize;
        if let Some(word) = self.words.get_mut(rank / 64) {
            *word &= !(1 << (rank % 64));
        }
    }

    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    pub fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| {
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

    /// Bytes this set occupies on the heap.
    pub fn heap_bytes(capacity: u16) -> usize {
        (capacity as usize).div_ceil(64) * 8
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
    }
}
