//! Goodput under loss against lossless: allreduces of 1M int32 through the client
//! library's whole worker path (context, worker threads, protocol, codec), over the dummy
//! backend (an in-process switch, as if 4 workers sent the same tensor), each of the two
//! worker threads on its own emulated 10 Gbit/s link, wrapped in the fault injector that
//! drops the given share of packets in each direction.
//!
//! Criterion reports each loss rate's time and throughput in elements per second, and
//! writes the median to `target/criterion/allreduce_1M_int32_under_loss/loss/<rate>/new/
//! estimates.json`; goodput under loss over lossless is the ratio of the medians of one
//! run. (The tensor's values grow each iteration, wrapping as int32 sums do: only the
//! time is of interest here; the tests check the sums.) The
//! retransmission timeout floor is 1 ms, so each loss costs about a millisecond on its
//! slot while the other slots keep the link busy.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use netagg::{BackendKind, Config, Context};

const ELEMENTS: usize = 1 << 20;

fn context(loss: f64) -> Context {
    let mut config = Config::default();
    config.general.backend = BackendKind::Dummy;
    config.general.num_workers = 4;
    config.general.packet_numel = 1024;
    config.general.timeout = Duration::from_millis(1);
    config.dummy.bandwidth = 10_000.0;
    config.faults.send.drop = loss;
    config.faults.receive.drop = loss;
    config.faults.seed = 1;
    Context::start(config).expect("a dummy context starts")
}

fn goodput_under_loss(c: &mut Criterion) {
    let mut group = c.benchmark_group("allreduce_1M_int32_under_loss");
    group.throughput(Throughput::Elements(ELEMENTS as u64));
    group.sample_size(20);
    let mut data = vec![1i32; ELEMENTS];
    for loss in [0.0, 0.01, 0.05] {
        let context = context(loss);
        group.bench_with_input(BenchmarkId::new("loss", loss), &loss, |b, _| {
            b.iter(|| context.allreduce(&mut data).expect("the allreduce recovers every loss"))
        });
    }
    group.finish();
}

criterion_group!(benches, goodput_under_loss);
criterion_main!(benches);
