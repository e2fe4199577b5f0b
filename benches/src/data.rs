//! Tensor contents that every rank can recompute for every other rank.
//!
//! Each element is a pure function of the seed, the rank and its index, so a rank
//! verifies a sum by recomputing all ranks' inputs element by element, with no copy of
//! anyone's tensor and no communication beyond agreeing on the seed.

/// A hash of 64 bits to 64 well-mixed bits (SplitMix64's finaliser): random access by
/// index, which a sequential generator would not give.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// What each rank's tensor holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Contents {
    pub seed: u64,
    /// Random elements; otherwise SwitchML's `x[i] = i · (-1)^i`, the same on every rank.
    pub random: bool,
    /// Fraction of blocks that hold data; the others are all zero (1: every block).
    pub density: f64,
    /// Elements of a block: the packet size, so zero blocks are what sparse jobs skip.
    pub block_numel: usize,
}

impl Contents {
    fn hash(&self, stream: u64, rank: u16, index: usize) -> u64 {
        mix(mix(self.seed ^ stream.rotate_left(56)) ^ ((rank as u64) << 48) ^ index as u64)
    }

    /// Whether block `block` of `rank` holds data: a fraction `density` of blocks, chosen
    /// independently on every rank.
    pub fn block_has_data(&self, rank: u16, block: usize) -> bool {
        let uniform = (self.hash(1, rank, block) >> 11) as f64 / (1u64 << 53) as f64;
        self.density >= 1.0 || uniform < self.density
    }

    fn has_data(&self, rank: u16, index: usize) -> bool {
        self.block_has_data(rank, index / self.block_numel.max(1))
    }

    /// Elements of a tensor of `numel` in the blocks that hold data on at least one of
    /// `ranks`: one rank's share of the payload it sends, or with every rank the union,
    /// whose sums every rank receives.
    pub fn elements_with_data(&self, numel: usize, ranks: impl Iterator<Item = u16> + Clone) -> usize {
        let block_numel = self.block_numel.max(1);
        (0..numel.div_ceil(block_numel))
            .filter(|&block| ranks.clone().any(|rank| self.block_has_data(rank, block)))
            .map(|block| block_numel.min(numel - block * block_numel))
            .sum()
    }

    /// Element `index` of `rank`'s int32 tensor: any int32 when random (sums wrap).
    pub fn int32(&self, rank: u16, index: usize) -> i32 {
        if !self.has_data(rank, index) {
            0
        } else if self.random {
            self.hash(2, rank, index) as i32
        } else {
            alternating(index) as i32
        }
    }

    /// Element `index` of `rank`'s float32 tensor: uniform in [-1, 1) when random.
    pub fn float32(&self, rank: u16, index: usize) -> f32 {
        if !self.has_data(rank, index) {
            0.0
        } else if self.random {
            ((self.hash(3, rank, index) >> 40) as f32 / (1u32 << 23) as f32) - 1.0
        } else {
            alternating(index) as f32
        }
    }
}

/// `i · (-1)^i`, as SwitchML's benchmark fills its tensors (wrapping for int32).
fn alternating(index: usize) -> i64 {
    let value = index as i64;
    if index % 2 == 0 {
        value
    } else {
        -value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contents_are_switchmls_pattern_or_random_and_sparse_by_block() {
        let plain = Contents { seed: 1, random: false, density: 1.0, block_numel: 4 };
        assert_eq!((0..5).map(|i| plain.int32(3, i)).collect::<Vec<_>>(), [0, -1, 2, -3, 4]);
        assert_eq!(plain.float32(0, 7), -7.0);

        let random = Contents { random: true, ..plain };
        let floats: Vec<f32> = (0..10_000).map(|i| random.float32(0, i)).collect();
        assert!(floats.iter().all(|x| (-1.0..1.0).contains(x)));
        assert_ne!(random.int32(0, 5), random.int32(1, 5), "ranks differ");
        assert_eq!(random.int32(1, 5), random.int32(1, 5), "recomputable");

        let sparse = Contents { density: 0.25, ..random };
        let blocks = (0..4000).filter(|&b| sparse.block_has_data(2, b)).count();
        assert!((800..1200).contains(&blocks), "{blocks} of 4000 blocks hold data");
        let empty = (0..4000).find(|&b| !sparse.block_has_data(2, b)).unwrap();
        assert!((empty * 4..empty * 4 + 4).all(|i| sparse.int32(2, i) == 0));
    }

    #[test]
    fn elements_with_data_count_whole_blocks_the_short_tail_and_the_union() {
        let sparse = Contents { seed: 3, random: true, density: 0.25, block_numel: 4 };
        // 10 elements: blocks of 4, 4 and a tail of 2.
        let mine = sparse.elements_with_data(10, [1].into_iter());
        let expected: usize = (0..10).filter(|&i| sparse.block_has_data(1, i / 4)).count();
        assert_eq!(mine, expected);
        let numel = 4 * 8000 + 3;
        let nonzero = |rank: u16| (0..numel).filter(|&i| sparse.int32(rank, i) != 0).count();
        assert_eq!(sparse.elements_with_data(numel, [0].into_iter()), nonzero(0));
        let union = sparse.elements_with_data(numel, 0..2);
        let both = (0..numel).filter(|&i| sparse.int32(0, i) != 0 || sparse.int32(1, i) != 0).count();
        assert_eq!(union, both);
        // 1 - (1 - 1/4)^2 = 7/16 of the blocks, give or take the sample's spread.
        let fraction = union as f64 / numel as f64;
        assert!((0.40..0.48).contains(&fraction), "{fraction}");
        let dense = Contents { density: 1.0, ..sparse };
        assert_eq!(dense.elements_with_data(10, [0].into_iter()), 10);
    }
}
