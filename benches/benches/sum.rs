//! The engine's sum kernels against a plain element-wise add over typed slices, and
//! against memcpy.
//!
//! The kernels read little-endian bytes straight from packet payloads; the plain add is
//! what the same sum costs when the data is already `[i32]` or `[f32]`, so the ratio of
//! the two shows what working on bytes costs, and memcpy of the same bytes is the memory
//! system's bound. Each size is a group (`sum_i32/1024`, ...) holding `engine` (the
//! instruction set chosen at run time), `engine_portable`, `engine_avx2` and
//! `engine_avx512` (those this CPU has), `plain_add` and `memcpy`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netagg_aggregator::sum::{
    add_assign_f32, add_assign_f32_with, add_assign_i32, add_assign_i32_with, InstructionSet,
};
use netagg_wire::packet::MAX_ELEMENTS;

/// Payloads of small, mid-sized and the largest packets, then a whole tensor that
/// overflows the L2 cache, where both sides wait on memory rather than on the adds.
const SIZES: [usize; 5] = [64, 256, 1024, MAX_ELEMENTS, 1 << 20];

// Kept out of line so that the baseline pays one call per sum, as the engine's kernels,
// which live in another crate, do.
#[inline(never)]
fn plain_add_i32(acc: &mut [i32], src: &[i32]) {
    for (a, b) in acc.iter_mut().zip(src) {
        *a = a.wrapping_add(*b);
    }
}

#[inline(never)]
fn plain_add_f32(acc: &mut [f32], src: &[f32]) {
    for (a, b) in acc.iter_mut().zip(src) {
        *a += *b;
    }
}

/// Benchmarks `engine` on payload bytes, `engine_with` in each instruction set, and
/// `plain` on typed slices holding the same elements, for every size in [`SIZES`].
fn compare<T: Copy>(
    c: &mut Criterion,
    type_name: &str,
    element: impl Fn(usize) -> T,
    to_le_bytes: impl Fn(T) -> [u8; 4],
    engine: impl Fn(&mut [u8], &[u8]),
    engine_with: impl Fn(InstructionSet, &mut [u8], &[u8]),
    plain: impl Fn(&mut [T], &[T]),
) {
    for elements in SIZES {
        let mut group = c.benchmark_group(format!("sum_{type_name}/{elements}"));
        group.throughput(Throughput::Elements(elements as u64));

        let src: Vec<T> = (0..elements).map(&element).collect();
        let mut acc = src.clone();
        let src_bytes: Vec<u8> = src.iter().flat_map(|&v| to_le_bytes(v)).collect();
        let mut acc_bytes = src_bytes.clone();

        group.bench_function("engine", |b| {
            b.iter(|| engine(black_box(&mut acc_bytes), black_box(&src_bytes)))
        });
        for set in InstructionSet::supported() {
            group.bench_function(format!("engine_{set}"), |b| {
                b.iter(|| engine_with(set, black_box(&mut acc_bytes), black_box(&src_bytes)))
            });
        }
        group.bench_function("plain_add", |b| b.iter(|| plain(black_box(&mut acc), black_box(&src))));
        let mut copy = src_bytes.clone();
        group.bench_function("memcpy", |b| b.iter(|| copy.copy_from_slice(black_box(&src_bytes))));
        group.finish();
    }
}

fn sum_i32(c: &mut Criterion) {
    compare(c, "i32", |i| i as i32, i32::to_le_bytes, add_assign_i32, add_assign_i32_with, plain_add_i32);
}

fn sum_f32(c: &mut Criterion) {
    // Small non-negative increments keep the accumulators finite and clear of subnormals
    // over billions of iterations, whose slow paths would time the FPU, not the loop.
    let element = |i| (i % 16) as f32 * 0.125;
    compare(c, "f32", element, f32::to_le_bytes, add_assign_f32, add_assign_f32_with, plain_add_f32);
}

criterion_group!(benches, sum_i32, sum_f32);
criterion_main!(benches);
