//! The 16-bit kernels of `netagg_aggregator::sum16` against the float32 sum they replace.
//!
//! A switch adds a float16 or bfloat16 contribution to a float32 sum (widen, add) where
//! it adds a float32 one (add), and rounds each result once (narrow); a worker narrows
//! float32 tensors to 16 bits as it loads packets and widens the sums as it stores them
//! (`general.wire_precision`). Each size is a group (`sum16/256`, ...) holding the
//! float32 add, the 16-bit adds, and the conversions, in elements per second.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netagg_aggregator::sum::{add_assign, add_assign_f32};
use netagg_aggregator::sum16::{narrow, widen};
use netagg_wire::ElementType;

/// A packet of the default 256 elements, in cache, and a tensor of 2^20 beyond the L2.
const SIZES: [usize; 2] = [256, 1 << 20];

fn sum16(c: &mut Criterion) {
    for elements in SIZES {
        let mut group = c.benchmark_group(format!("sum16/{elements}"));
        group.throughput(Throughput::Elements(elements as u64));
        // Small non-negative values keep the sums finite and clear of subnormals.
        let floats: Vec<u8> = (0..elements).flat_map(|i| ((i % 16) as f32 * 0.125).to_le_bytes()).collect();
        let mut acc = floats.clone();
        group.bench_function("float32_add", |b| {
            b.iter(|| add_assign_f32(black_box(&mut acc), black_box(&floats)))
        });
        for (name, element_type) in [("float16", ElementType::Float16), ("bfloat16", ElementType::BFloat16)] {
            let mut halves = vec![0u8; elements * 2];
            narrow(element_type, &mut halves, &floats);
            let mut acc = floats.clone();
            group.bench_function(format!("{name}_add"), |b| {
                b.iter(|| add_assign(element_type, black_box(&mut acc), black_box(&halves)))
            });
            let mut out = vec![0u8; elements * 2];
            group.bench_function(format!("{name}_narrow"), |b| {
                b.iter(|| narrow(element_type, black_box(&mut out), black_box(&floats)))
            });
            let mut wide = vec![0u8; elements * 4];
            group.bench_function(format!("{name}_widen"), |b| {
                b.iter(|| widen(element_type, black_box(&mut wide), black_box(&halves)))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, sum16);
criterion_main!(benches);
