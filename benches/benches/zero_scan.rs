//! The zero-block scan of sparse jobs against the bytewise compare it replaced.
//!
//! A sparse job's mask is found by reading the whole input before the job starts
//! (`netagg_aggregator::zero_scan`). Each group builds the mask of one rank's int32
//! input at density 0.1 (the benchmark's `--random --density 0.1`, blocks of 256
//! elements), `scan` with [`nonzero_blocks`] and `bytewise` with the reference compare,
//! beside a memcpy of the same bytes, the memory system's bound. 1 MiB stays in the L2
//! cache, where the compare's speed shows; 64 MiB is a benchmark rank's tensor, from
//! memory.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netagg_aggregator::zero_scan::{is_zero_bytewise, nonzero_blocks};
use netagg_aggregator::BlockMask;
use netagg_benches::data::Contents;

const BLOCK_NUMEL: usize = 256;
const BLOCK_BYTES: usize = BLOCK_NUMEL * 4;

/// The mask as the client built it before: one compare per byte.
fn bytewise_mask(input: &[u8]) -> BlockMask {
    BlockMask::from_fn((input.len() / BLOCK_BYTES) as u32, |block| {
        let start = block as usize * BLOCK_BYTES;
        !is_zero_bytewise(&input[start..start + BLOCK_BYTES])
    })
}

fn masks(c: &mut Criterion) {
    let contents = Contents { seed: 5, random: true, density: 0.1, block_numel: BLOCK_NUMEL };
    for mib in [1, 64] {
        let input: Vec<u8> =
            (0..(mib << 20) / 4).flat_map(|index| contents.int32(0, index).to_le_bytes()).collect();
        let scanned = nonzero_blocks(&input, BLOCK_BYTES);
        assert_eq!(scanned, Some(bytewise_mask(&input)), "the two scans disagree");

        let mut group = c.benchmark_group(format!("zero_scan/{mib}MiB"));
        group.throughput(Throughput::Bytes(input.len() as u64));
        group.bench_function("scan", |b| b.iter(|| nonzero_blocks(black_box(&input), BLOCK_BYTES)));
        group.bench_function("bytewise", |b| b.iter(|| bytewise_mask(black_box(&input))));
        let mut copy = input.clone();
        group.bench_function("memcpy", |b| b.iter(|| copy.copy_from_slice(black_box(&input))));
        group.finish();
    }
}

criterion_group!(benches, masks);
criterion_main!(benches);
