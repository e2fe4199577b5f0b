//! The whole client path with no network against a 2-thread memcpy of the same bytes.
//!
//! A context with the dummy backend at unlimited bandwidth (`bandwidth = 0`) runs every
//! part of an allreduce but the network: slicing, the worker protocol, codec, and an
//! in-process engine that sums each packet as if 2 workers had sent it. Its 2 worker
//! threads are compared with 2 threads copying the tensor, the memory system's bound for
//! a pass that reads a tensor and writes one. Groups: `client_dummy/float32_bfp`
//! (SwitchML's `cpu_exponent_quantizer`) and `client_dummy/int32` with the default
//! packets (256 elements, 256 in flight), and `client_dummy/float32_bfp_large_packets`
//! with `configs/large-packets.cfg` (4096 elements, 16 in flight); each with `allreduce`
//! and `memcpy_2_threads`; throughput in bytes of the tensor.

use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netagg::{BackendKind, Config, Context, Element};

/// 64 MiB of elements: well beyond the caches, as gradients are.
const ELEMENTS: usize = 16 << 20;

/// A dummy-backend context of 2 emulated workers and 2 threads; packets as the config
/// file says, if any, else the defaults.
fn dummy_context(prepostprocessor: &str, file: Option<&str>) -> Context {
    let mut config = match file {
        Some(file) => {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(file);
            Config::load_with_environment(Some(&path), &[]).expect("the config file loads")
        }
        None => Config::default(),
    };
    config.general.backend = BackendKind::Dummy;
    config.general.num_workers = 2;
    config.general.num_worker_threads = 2;
    config.general.prepostprocessor = prepostprocessor.into();
    config.dummy.bandwidth = 0.0;
    Context::start(config).expect("a dummy context starts")
}

/// Copies `src` into `dst` with two threads, half each.
fn memcpy_two_threads<T: Copy + Send + Sync>(src: &[T], dst: &mut [T]) {
    let half = src.len() / 2;
    let (dst_low, dst_high) = dst.split_at_mut(half);
    std::thread::scope(|scope| {
        scope.spawn(|| dst_low.copy_from_slice(&src[..half]));
        dst_high.copy_from_slice(&src[half..]);
    });
}

fn compare<T: Element + Default>(
    c: &mut Criterion,
    name: &str,
    prepostprocessor: &str,
    file: Option<&str>,
    input: &[T],
) {
    let context = dummy_context(prepostprocessor, file);
    let mut output = vec![T::default(); input.len()];
    let mut group = c.benchmark_group(format!("client_dummy/{name}"));
    group.throughput(Throughput::Bytes((input.len() * 4) as u64));
    group.sample_size(10).measurement_time(Duration::from_secs(8));
    // Out of place, so every iteration reduces the same values.
    group.bench_function("allreduce", |b| {
        b.iter(|| context.allreduce_into(black_box(input), &mut output).expect("the allreduce succeeds"))
    });
    group
        .bench_function("memcpy_2_threads", |b| b.iter(|| memcpy_two_threads(black_box(input), &mut output)));
    group.finish();
}

fn client_dummy(c: &mut Criterion) {
    let floats: Vec<f32> = (0..ELEMENTS).map(|i| (i % 1000) as f32 * 0.37 - 185.0).collect();
    compare(c, "float32_bfp", "cpu_exponent_quantizer", None, &floats);
    let large = Some("configs/large-packets.cfg");
    compare(c, "float32_bfp_large_packets", "cpu_exponent_quantizer", large, &floats);
    let ints: Vec<i32> = (0..ELEMENTS).map(|i| i as i32 % 1000 - 500).collect();
    compare(c, "int32", "native", None, &ints);
}

criterion_group!(benches, client_dummy);
criterion_main!(benches);
