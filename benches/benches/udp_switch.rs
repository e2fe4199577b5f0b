//! Allreduce through a switch against a UDP echo relay that moves the same datagrams: what
//! aggregation, sessions and loss recovery cost on top of the kernel's price per datagram.
//!
//! Groups `udp_switch/2_workers` and `udp_switch/4_workers`, with the default
//! configuration, and `udp_switch/2_workers_large_packets` and `..._4_workers_large_packets`
//! with `configs/large-packets.cfg`, each measuring in one run:
//! - `allreduce`: N contexts with the UDP backend, each driven from a thread of its own,
//!   allreduce the same int32 tensor through a switch started in this process on
//!   loopback;
//! - `udp_echo_relay`: N × `num_worker_threads` clients, a thread each, stream the same
//!   bytes through [`EchoRelay`], cut among threads as a context cuts them, with the same
//!   datagram size (header, `packet_numel` × 4 and checksum), the same window per thread
//!   (`max_outstanding_packets` / `num_worker_threads`) and the same batched sockets.
//!
//! Everything is in one process, unlike `bench_compare`'s rows under `netagg-run`, so
//! the two compete for the same cores alike. Throughput is in bytes of the tensor per
//! worker: both functions report each worker's goodput.

use std::hint::black_box;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use netagg::{BackendKind, Config, Context};
use netagg_benches::relay::{thread_shares, EchoRelay, StreamClient};
use netagg_switch::Switch;

/// 16 MiB of int32: beyond the caches, and a 4-worker allreduce still takes well under
/// a second on a 2-core machine.
const ELEMENTS: usize = 4 << 20;

fn udp_switch(c: &mut Criterion) {
    let input: Vec<i32> = (0..ELEMENTS).map(|i| (i % 1000) as i32 - 500).collect();
    let large_packets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/large-packets.cfg");
    let large_packets =
        Config::load_with_environment(Some(&large_packets), &[]).expect("the config file loads");
    for (suffix, config) in [("", Config::default()), ("_large_packets", large_packets)] {
        for workers in [2u16, 4] {
            let mut group = c.benchmark_group(format!("udp_switch/{workers}_workers{suffix}"));
            group.throughput(Throughput::Bytes((ELEMENTS * 4) as u64));
            group.sample_size(10).measurement_time(Duration::from_secs(5));
            allreduce(&mut group, &config, workers, &input);
            echo_relay(&mut group, &config, workers, &input);
            group.finish();
        }
    }
}

/// `config` for one rank of `session` on `switch`.
fn rank_config(config: &Config, switch: &Switch, session: &str, rank: u16, workers: u16) -> Config {
    let mut config = config.clone();
    config.general.backend = BackendKind::Udp;
    config.general.controller_ip = switch.control_addr().ip().to_string();
    config.general.controller_port = switch.control_addr().port();
    config.general.num_workers = workers;
    config.general.rank = rank;
    config.general.session = session.into();
    config
}

fn allreduce(group: &mut BenchmarkGroup<'_, WallTime>, config: &Config, workers: u16, input: &[i32]) {
    let mut settings = Config::default().switch;
    settings.control = "127.0.0.1:0".parse().expect("a socket address");
    settings.data = "127.0.0.1:0".parse().expect("a socket address");
    let switch = Switch::start(&settings).expect("a switch starts on free loopback ports");
    // Started once: the session then runs one job after another, as training does.
    let session = format!("udp-switch-bench-{}-{workers}", std::process::id());
    let contexts: Vec<Context> = std::thread::scope(|scope| {
        // Concurrently: each start returns only once every rank has registered.
        let starts: Vec<_> = (0..workers)
            .map(|rank| {
                let config = rank_config(config, &switch, &session, rank, workers);
                scope.spawn(move || Context::start(config).expect("a rank joins the in-process switch"))
            })
            .collect();
        starts.into_iter().map(|start| start.join().expect("a rank's start did not panic")).collect()
    });
    let mut outputs = vec![vec![0i32; input.len()]; contexts.len()];
    // A broken path must fail here rather than be timed.
    allreduce_on_every_rank(&contexts, input, &mut outputs);
    let sum_is_right = |(sum, one): (&i32, &i32)| *sum == one * i32::from(workers);
    assert!(outputs.iter().all(|output| output.iter().zip(input).all(sum_is_right)), "wrong sums");

    // Out of place, so every iteration reduces the same values.
    group.bench_function("allreduce", |b| {
        b.iter(|| allreduce_on_every_rank(&contexts, black_box(input), &mut outputs))
    });
    // The ranks leave before the switch stops, so their session ends cleanly.
    drop(contexts);
    switch.stop().expect("the switch stops cleanly");
}

fn allreduce_on_every_rank(contexts: &[Context], input: &[i32], outputs: &mut [Vec<i32>]) {
    std::thread::scope(|scope| {
        for (context, output) in contexts.iter().zip(outputs) {
            scope.spawn(move || context.allreduce_into(input, output).expect("the allreduce succeeds"));
        }
    });
}

/// One client of the relay: a worker thread's share of the tensor and where it lands.
struct RelayClient {
    connection: StreamClient,
    share: Range<usize>,
    output: Vec<u8>,
}

/// The relay with the datagram size, window and threads of `config`, which the contexts
/// above ran with.
fn echo_relay(group: &mut BenchmarkGroup<'_, WallTime>, config: &Config, workers: u16, input: &[i32]) {
    let packet_bytes = config.general.packet_numel as usize * 4;
    let window = config.slots_per_thread() as usize;
    let bytes: Vec<u8> = input.iter().flat_map(|value| value.to_le_bytes()).collect();
    let relay = EchoRelay::start("127.0.0.1:0".parse().expect("a socket address")).expect("the relay starts");
    let shares = thread_shares(bytes.len(), packet_bytes, config.general.num_worker_threads as usize);
    let mut clients: Vec<RelayClient> = Vec::new();
    for _ in 0..workers {
        let mut start = 0;
        for &share in &shares {
            clients.push(RelayClient {
                connection: StreamClient::connect(relay.address(), config.udp.socket_buffer)
                    .expect("a relay client binds"),
                share: start..start + share,
                output: vec![0; share],
            });
            start += share;
        }
    }

    group.bench_function("udp_echo_relay", |b| {
        b.iter(|| {
            std::thread::scope(|scope| {
                for client in &mut clients {
                    let input = black_box(&bytes[client.share.clone()]);
                    scope.spawn(move || {
                        client
                            .connection
                            .stream(input, &mut client.output, packet_bytes, window)
                            .expect("the relay echoes every datagram")
                    });
                }
            })
        })
    });
    relay.stop().expect("the relay stops cleanly");
}

criterion_group!(benches, udp_switch);
criterion_main!(benches);
