//! Pre- and post-processing against memcpy: what turning a tensor into payloads costs.
//!
//! Block floating point (`prepostprocessor = cpu_exponent_quantizer`) finds a packet's
//! exponent, quantises float32 to int32 and back; the native codec copies. Each size is a
//! group (`codec/16366`, ...) holding `bfp_exponent`, `bfp_encode` and `bfp_decode` in
//! each instruction set this CPU has (`bfp_encode_avx512`, ...: `portable`, `avx2`,
//! `avx512`), `native_encode`, and `memcpy` and `plain_add` (a float32 `a[i] += b[i]`)
//! over the same bytes. Sizes are a 256-element packet, the largest packet, and a 16 MiB
//! run that does not fit in cache.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netagg::{BlockFloatingPoint, Codec, DataType, Native};
use netagg_aggregator::sum::InstructionSet;
use netagg_wire::packet::MAX_ELEMENTS;

const SIZES: [usize; 3] = [256, MAX_ELEMENTS, 1 << 22];

/// The baseline of a kernel's speed: a float32 sum over typed slices, out of line as the
/// codec's calls are.
#[inline(never)]
fn plain_add(acc: &mut [f32], src: &[f32]) {
    for (a, b) in acc.iter_mut().zip(src) {
        *a += *b;
    }
}

fn codecs(c: &mut Criterion) {
    for elements in SIZES {
        let mut group = c.benchmark_group(format!("codec/{elements}"));
        group.throughput(Throughput::Elements(elements as u64));
        let floats: Vec<u8> =
            (0..elements).flat_map(|i| ((i % 1000) as f32 * 0.37 - 185.0).to_le_bytes()).collect();
        let mut payload = vec![0u8; floats.len()];
        let mut decoded = vec![0u8; floats.len()];
        for set in InstructionSet::supported() {
            let bfp = BlockFloatingPoint::new(4).with_instruction_set(set);
            let exponent = Some(bfp.exponent(DataType::Float32, &floats));
            group.bench_function(format!("bfp_exponent_{set}"), |b| {
                b.iter(|| bfp.exponent(DataType::Float32, black_box(&floats)))
            });
            group.bench_function(format!("bfp_encode_{set}"), |b| {
                b.iter(|| bfp.encode(DataType::Float32, black_box(&floats), &mut payload, exponent))
            });
            group.bench_function(format!("bfp_decode_{set}"), |b| {
                b.iter(|| bfp.decode(DataType::Float32, black_box(&payload), &mut decoded, exponent))
            });
        }
        group.bench_function("native_encode", |b| {
            b.iter(|| Native.encode(DataType::Float32, black_box(&floats), &mut payload, None))
        });
        group.bench_function("memcpy", |b| b.iter(|| payload.copy_from_slice(black_box(&floats))));
        let src: Vec<f32> = (0..elements).map(|i| (i % 16) as f32 * 0.125).collect();
        let mut acc = src.clone();
        group.bench_function("plain_add", |b| b.iter(|| plain_add(black_box(&mut acc), black_box(&src))));
        group.finish();
    }
}

criterion_group!(benches, codecs);
criterion_main!(benches);
