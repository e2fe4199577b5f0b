//! Which blocks of a slice travel: zero blocks stay off the wire (`general.sparse`).
//!
//! OmniReduce's insight is that gradients are often sparse at the granularity of blocks,
//! so a worker sends only its non-zero blocks and a block zero on every worker never
//! travels. The worker protocol already streams sparse jobs ([`Layout::Sparse`]); this
//! chooses a slice's layout, with its mask of non-zero blocks found by
//! [`nonzero_blocks`].

use netagg_aggregator::zero_scan::nonzero_blocks;
use netagg_aggregator::Layout;
use netagg_config::SparseMode;

use crate::codec::Codec;
use crate::DataType;

/// The layout of a slice of `input` bytes cut into blocks of `block_bytes`: sparse when
/// `mode` allows it and the codec keeps zeros zero, with the blocks that hold a non-zero
/// byte in its mask; dense otherwise.
///
/// Every rank must choose the same layout for a job, since the switch aggregates a slot
/// either densely or as a sparse stream, so the choice depends only on what all ranks
/// share (the configuration, the codec and the job's type), never on this rank's data:
/// a rank whose slice happens to have no zero block still streams it sparse.
///
/// A sparse job stores only the blocks some round visits: the others are zero on every
/// worker, and the caller's output must already hold zeros there. In place that is so
/// (a block zero here is zero in the buffer); out of place, `zero_output` is called with
/// the byte range of every block this worker will not send, to clear it beforehand.
pub fn layout(
    mode: SparseMode,
    codec: &dyn Codec,
    data_type: DataType,
    input: &[u8],
    block_bytes: usize,
    mut zero_output: impl FnMut(std::ops::Range<usize>),
) -> Layout {
    if mode == SparseMode::Off || !codec.keeps_zero_blocks_zero(data_type) {
        return Layout::Dense;
    }
    let Some(mask) = nonzero_blocks(input, block_bytes) else {
        // Blocks of no bytes, or more than the protocol numbers: the protocol refuses the
        // job either way.
        return Layout::Dense;
    };
    for block in (0..mask.blocks()).filter(|&b| !mask.contains(b)) {
        let start = block as usize * block_bytes;
        zero_output(start..(start + block_bytes).min(input.len()));
    }
    Layout::Sparse(mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use netagg_aggregator::BlockMask;

    use crate::codec::{BlockFloatingPoint, Native};

    fn int_bytes(values: &[i32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn cleared(
        mode: SparseMode,
        codec: &dyn Codec,
        data_type: DataType,
        input: &[u8],
    ) -> (Layout, Vec<usize>) {
        let mut ranges = Vec::new();
        let layout = layout(mode, codec, data_type, input, 8, |range| ranges.push(range.start));
        (layout, ranges)
    }

    #[test]
    fn zero_blocks_make_a_sparse_mask_and_their_outputs_are_cleared() {
        // Blocks of two elements: [1, 0] [0, 0] [0, -0.0 bits] [0] (a short tail).
        let input = int_bytes(&[1, 0, 0, 0, 0, i32::MIN, 0]);
        let (layout, cleared_at) = cleared(SparseMode::Auto, &Native, DataType::Int32, &input);
        let Layout::Sparse(mask) = layout else { panic!("expected a sparse layout, got {layout:?}") };
        assert_eq!((mask.blocks(), mask.count()), (4, 2));
        assert!(mask.contains(0) && !mask.contains(1) && mask.contains(2) && !mask.contains(3));
        assert_eq!(cleared_at, vec![8, 24]);
    }

    #[test]
    fn off_and_float_block_floating_point_stay_dense_and_dense_data_streams_sparse() {
        // Another rank may have zero blocks where this one has none: the layout must not
        // depend on this rank's data.
        let dense = int_bytes(&[1, 0, 0, 2, 3, 3]);
        let (layout, cleared_at) = cleared(SparseMode::Auto, &Native, DataType::Int32, &dense);
        assert_eq!((layout, cleared_at), (Layout::Sparse(BlockMask::from_fn(3, |_| true)), vec![]));
        let sparse = int_bytes(&[0, 0, 1, 1]);
        assert_eq!(cleared(SparseMode::Off, &Native, DataType::Float32, &sparse), (Layout::Dense, vec![]));
        let bfp = BlockFloatingPoint::new(2);
        assert_eq!(cleared(SparseMode::Auto, &bfp, DataType::Float32, &sparse), (Layout::Dense, vec![]));
        assert!(matches!(cleared(SparseMode::Auto, &bfp, DataType::Int32, &sparse).0, Layout::Sparse(_)));
    }
}
