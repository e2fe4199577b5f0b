//! Pre- and post-processing against memcpy: what turning a tensor into payloads costs.
//!
//! Block floating point (`prepostprocessor = cpu_exponent_quantizer`) finds a packet's
//! exponent, quantises float32 to int32 and back; the native codec copies. Each size is a
//! group (`codec/16366`, ...) holding `bfp_exponent`, `bfp_encode`, `bfp_decode`,
//! `native_encode` and `memcpy` over the same bytes. Sizes are a 256-element packet, the
//! largest packet, and a 16 MiB run that does not fit in cache.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netagg::{BlockFloatingPoint, Codec, DataType, Native};
use netagg_wire::packet::MAX_ELEMENTS;

const SIZES: [usize; 3] = [256, MAX_ELEMENTS, 1 << 22];

fn codecs(c: &mut Criterion) {
    let bfp = BlockFloatingPoint::new(4);
    for elements in SIZES {
        let mut group = c.benchmark_group(format!("codec/{elements}"));
        group.throughput(Throughput::Elements(elements as u64));
        let floats: Vec<u8> =
            (0..elements).flat_map(|i| ((i % 1000) as f32 * 0.37 - 185.0).to_le_bytes()).collect();
        let mut payload = vec![0u8; floats.len()];
        let mut decoded = vec![0u8; floats.len()];
        let exponent = Some(bfp.exponent(DataType::Float32, &floats));

        group.bench_function("bfp_exponent", |b| {
            b.iter(|| bfp.exponent(DataType::Float32, black_box(&floats)))
        });
        group.bench_function("bfp_encode", |b| {
            b.iter(|| bfp.encode(DataType::Float32, black_box(&floats), &mut payload, exponent))
        });
        group.bench_function("bfp_decode", |b| {
            b.iter(|| bfp.decode(DataType::Float32, black_box(&payload), &mut decoded, exponent))
        });
        group.bench_function("native_encode", |b| {
            b.iter(|| Native.encode(DataType::Float32, black_box(&floats), &mut payload, None))
        });
        group.bench_function("memcpy", |b| b.iter(|| payload.copy_from_slice(black_box(&floats))));
        group.finish();
    }
}

criterion_group!(benches, codecs);
criterion_main!(benches);
