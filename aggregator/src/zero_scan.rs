//! Finding a sparse job's non-zero blocks: a scan of its bytes a cache line at a time.
//!
//! A worker must know every non-zero block before a sparse job starts (each slot's first
//! contribution names the sender's next one), so the whole input is read once up front;
//! at density 0.1, nine blocks in ten are zero and read to their last byte. Read one byte
//! per compare, that scan took more CPU than the wire it saved. Here a cache line's bytes
//! are OR-ed together, which the compiler turns into a few vector ORs (SSE2 on baseline
//! x86-64, AVX2 where the CPU has it, chosen at run time) and one test per line.
//!
//! The scan looks at bytes, not elements: a block is zero when every byte is, whatever
//! the element type (float32's `-0.0` is not zero here, and so travels).

use crate::BlockMask;

/// Bytes OR-ed together before one test: a cache line, so that a non-zero block is
/// found within the first line it reads, and zero ones cost one branch per line.
const LINE_BYTES: usize = 64;

/// Whether every byte of `bytes` is zero, read a cache line at a time.
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub fn is_zero(bytes: &[u8]) -> bool {
    is_zero_by_lines(bytes)
}

/// [`is_zero`]'s loop, for every instruction set it is compiled for. Always inlined: the
/// loop must be compiled inside each of them to use its vectors; tests call it alone to
/// cover the baseline build on a CPU that has AVX2.
#[inline(always)]
fn is_zero_by_lines(bytes: &[u8]) -> bool {
    let lines = bytes.chunks_exact(LINE_BYTES);
    let tail = lines.remainder();
    for line in lines {
        // A fixed length lets the compiler unroll the OR into whole vectors.
        let line: &[u8; LINE_BYTES] = line.try_into().expect("chunks_exact yields whole lines");
        if line.iter().fold(0, |any, &byte| any | byte) != 0 {
            return false;
        }
    }
    tail.iter().fold(0, |any, &byte| any | byte) == 0
}

/// Whether every byte of `bytes` is zero, one compare per byte: the reference
/// [`is_zero`] is tested and benchmarked against.
pub fn is_zero_bytewise(bytes: &[u8]) -> bool {
    bytes.iter().all(|&byte| byte == 0)
}

/// The mask of the blocks of `bytes`, cut into blocks of `block_bytes` (the last one
/// possibly shorter), that hold a non-zero byte; `None` for blocks of no bytes, or more
/// blocks than a job numbers (`u32`).
pub fn nonzero_blocks(bytes: &[u8], block_bytes: usize) -> Option<BlockMask> {
    if block_bytes == 0 {
        return None;
    }
    let blocks = u32::try_from(bytes.len().div_ceil(block_bytes)).ok()?;
    let mut mask = BlockMask::new(blocks);
    for (block, bytes) in (0..blocks).zip(bytes.chunks(block_bytes)) {
        if !is_zero(bytes) {
            mask.insert(block);
        }
    }
    Some(mask)
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    #[test]
    fn a_single_non_zero_byte_is_found_at_every_position_of_every_length() {
        // Lengths past four lines: whole lines, tails alone, and both.
        for len in 0..=4 * LINE_BYTES + 3 {
            let mut bytes = vec![0u8; len];
            assert!(is_zero(&bytes) && is_zero_by_lines(&bytes), "{len} zero bytes");
            for position in 0..len {
                for value in [1, 0x80, 0xff] {
                    bytes[position] = value;
                    assert!(!is_zero(&bytes), "{value:#x} at {position} of {len}");
                    assert!(!is_zero_by_lines(&bytes), "{value:#x} at {position} of {len}, baseline");
                    bytes[position] = 0;
                }
            }
        }
    }

    #[test]
    fn random_inputs_agree_with_the_bytewise_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(29);
        for _ in 0..2000 {
            let len = rng.gen_range(0..3000);
            let mut bytes = vec![0u8; len];
            // Mostly zero buffers with a few bytes set anywhere, some wholly random.
            match rng.gen_range(0..4) {
                0 => {}
                1 => rng.fill(&mut bytes[..]),
                _ => {
                    for _ in 0..rng.gen_range(1..4) {
                        if len > 0 {
                            bytes[rng.gen_range(0..len)] = rng.gen();
                        }
                    }
                }
            }
            // Unaligned starts too: a job's slice starts wherever its block does.
            let start = rng.gen_range(0..=len.min(7));
            let bytes = &bytes[start..];
            let expected = is_zero_bytewise(bytes);
            assert_eq!((is_zero(bytes), is_zero_by_lines(bytes)), (expected, expected), "{bytes:?}");
        }
    }

    #[test]
    fn the_mask_holds_the_blocks_with_a_non_zero_byte_tail_included() {
        // Blocks of 6 bytes (three 2-byte elements): data in 0 and in the 2-byte tail 3.
        let bytes = [0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        let mask = nonzero_blocks(&bytes, 6).expect("4 blocks fit a job");
        assert_eq!(mask, BlockMask::from_fn(4, |block| block == 0 || block == 3));
        assert_eq!(nonzero_blocks(&[], 6), Some(BlockMask::new(0)));
        assert_eq!(nonzero_blocks(&bytes, 0), None);
    }

    #[test]
    fn random_masks_agree_with_the_bytewise_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for block_bytes in [1, 2, 6, 64, 100, 256, 1024] {
            let blocks = rng.gen_range(1..200);
            let mut bytes = vec![0u8; blocks * block_bytes - rng.gen_range(0..block_bytes)];
            for block in bytes.chunks_mut(block_bytes) {
                if rng.gen_bool(0.1) {
                    let at = rng.gen_range(0..block.len());
                    block[at] = rng.gen_range(1..=255);
                }
            }
            let expected = BlockMask::from_fn(blocks as u32, |block| {
                let start = block as usize * block_bytes;
                !is_zero_bytewise(&bytes[start..(start + block_bytes).min(bytes.len())])
            });
            assert_eq!(nonzero_blocks(&bytes, block_bytes), Some(expected), "blocks of {block_bytes}");
        }
    }
}
