//! End to end: a real `netagg-switch` process and worker processes on 127.0.0.1, and the
//! library in process against a real switch.
//!
//! The worker program is `netagg-allreduce`, which checks every element of every result
//! itself (exact for int32, within rounding for float32). The switch binary is found
//! beside it, in the same target directory: `cargo test --workspace` builds both.

mod common;

use std::time::{Duration, Instant};

use common::{
    allreduce_all, contexts, dummy_config, run_verified, scratch_dir, start_contexts, unique_session, Switch,
};
use netagg::{Config, Context, Error, RejectCode};

/// How long the worker processes of one run may take.
const WITHIN: Duration = Duration::from_secs(120);

#[test]
fn two_three_and_eight_workers_sum_int32_exactly() {
    let switch = Switch::start(&[]);
    for workers in [2, 3, 8] {
        run_verified(&switch, workers, &[], &["--numel", "0,1,255,256,257,100000", "--jobs", "6"], WITHIN);
    }
}

#[test]
fn concurrent_sessions_share_a_switch() {
    let switch = Switch::start(&[]);
    std::thread::scope(|scope| {
        scope.spawn(|| run_verified(&switch, 3, &[], &["--numel", "300000", "--jobs", "2"], WITHIN));
        scope.spawn(|| {
            run_verified(&switch, 2, &[], &["--type", "float32", "--numel", "200000", "--jobs", "2"], WITHIN)
        });
    });
}

#[test]
fn a_session_over_the_switch_limits_is_refused_to_every_rank() {
    let switch = Switch::start(&["--max-workers", "2"]);
    for outcome in start_contexts(&switch, 3, |_| {}) {
        let error = outcome.map(|_| ()).unwrap_err();
        assert_eq!(
            error,
            Error::Rejected {
                code: RejectCode::Limit,
                message: "a world of 3 workers is above this switch's limit of 2".into()
            }
        );
    }
}

#[test]
fn every_thread_count_and_packet_size_sums_exactly() {
    let switch = Switch::start(&[]);
    for threads in [1u16, 2, 4] {
        for packet in [64usize, 256, 1024] {
            let sizes = format!("0,1,{},{},{},20000", packet - 1, packet, packet + 1);
            let (threads, packet_numel) = (threads.to_string(), packet.to_string());
            let env = [
                ("NETAGG_GENERAL__NUM_WORKER_THREADS", threads.as_str()),
                ("NETAGG_GENERAL__PACKET_NUMEL", packet_numel.as_str()),
            ];
            run_verified(&switch, 2, &env, &["--numel", &sizes, "--jobs", "6"], WITHIN);
        }
    }
}

#[test]
fn float32_sums_and_ten_million_elements() {
    let switch = Switch::start(&[]);
    run_verified(&switch, 3, &[], &["--type", "float32", "--numel", "1,1000,100000", "--jobs", "3"], WITHIN);
    let quantised = [("NETAGG_GENERAL__PREPOSTPROCESSOR", "cpu_exponent_quantizer")];
    run_verified(
        &switch,
        3,
        &quantised,
        &["--type", "float32", "--numel", "0,1,257,100000", "--jobs", "4"],
        WITHIN,
    );
    let env = [("NETAGG_GENERAL__PACKET_NUMEL", "1024")];
    run_verified(&switch, 2, &env, &["--numel", "10000000", "--jobs", "1"], WITHIN);
}

#[test]
fn async_jobs_interleave_and_out_of_place_jobs_keep_their_input() {
    let switch = Switch::start(&[]);
    run_verified(&switch, 3, &[], &["--async", "--numel", "5000,1,70000,0,300", "--jobs", "10"], WITHIN);
    run_verified(&switch, 3, &[], &["--out-of-place", "--numel", "4097,1", "--jobs", "4"], WITHIN);
}

#[test]
fn jobs_from_several_threads_of_one_process() {
    let switch = Switch::start(&[]);
    let contexts = contexts(&switch, 2, |_| {});
    // Each rank submits 6 jobs in the same order, from one thread; the ranks run in
    // parallel and their jobs run concurrently.
    std::thread::scope(|scope| {
        for (rank, context) in contexts.iter().enumerate() {
            scope.spawn(move || {
                let jobs: Vec<_> = (0..6)
                    .map(|job| {
                        context.allreduce_async(vec![(rank * 10 + job) as i32; 3000 + job * 1000]).unwrap()
                    })
                    .collect();
                for (job, handle) in jobs.into_iter().enumerate() {
                    let sums = handle.wait().unwrap();
                    assert!(sums.iter().all(|&v| v == (10 + 2 * job) as i32), "job {job}");
                }
            });
        }
    });
    for context in contexts {
        let stats = context.stop();
        assert_eq!((stats.jobs_submitted, stats.jobs_finished, stats.jobs_failed), (6, 6, 0));
    }
}

#[test]
fn dummy_backend_sums_as_if_every_worker_sent_the_same_data() {
    let mut config = dummy_config(4);
    config.general.num_worker_threads = 2;
    let context = Context::start(config.clone()).unwrap();
    let mut ints: Vec<i32> = (0..10_000).map(|i| i - 5000).collect();
    context.allreduce(&mut ints).unwrap();
    assert!(ints.iter().enumerate().all(|(i, &v)| v == (i as i32 - 5000) * 4));
    let floats: Vec<f32> = (0..1000).map(|i| i as f32 * 0.25).collect();
    let mut sums = vec![0.0f32; 1000];
    context.allreduce_into(&floats, &mut sums).unwrap();
    assert!(sums.iter().zip(&floats).all(|(s, f)| *s == f * 4.0));
    let job = context.allreduce_async(vec![3i32; 777]).unwrap();
    assert_eq!(job.wait().unwrap(), vec![12; 777]);
    assert_eq!(
        context.allreduce_into(&[1i32; 3], &mut [0i32; 4]),
        Err(Error::LengthMismatch { input: 3, output: 4 })
    );
    let stats = context.stop();
    assert_eq!(stats.jobs_finished, 3);
    assert!(stats.total().data_sent > 0);

    // Native float32 is summed in the switch's order, one addition per worker, which
    // for 6 workers differs from 6·x in the last bit for some x: the dummy matches the
    // switch.
    let mut native = config.clone();
    native.general.prepostprocessor = "native".into();
    native.general.num_workers = 6;
    let context = Context::start(native).unwrap();
    let floats: Vec<f32> = (0..1000).map(|i| 1.0 + i as f32 * f32::EPSILON).collect();
    let mut sums = vec![0.0f32; 1000];
    context.allreduce_into(&floats, &mut sums).unwrap();
    let in_order = |x: f32| (0..5).fold(x, |sum, _| sum + x);
    assert!(floats.iter().any(|&x| in_order(x) != x * 6.0), "the values tell the two apart");
    assert!(sums.iter().zip(&floats).all(|(&s, &x)| s.to_bits() == in_order(x).to_bits()));
    context.stop();

    // An emulated 1 Gbit/s link, shared by the worker's threads: 8 Mbit of payload take
    // at least 8 ms however many threads send them.
    config.dummy.bandwidth = 1000.0;
    config.general.num_worker_threads = 4;
    let context = Context::start(config).unwrap();
    let started = Instant::now();
    context.allreduce(&mut vec![1i32; 250_000]).unwrap();
    assert!(started.elapsed() >= Duration::from_millis(8), "{:?}", started.elapsed());
}

#[test]
fn several_threads_submit_to_one_context() {
    let context = Context::start(dummy_config(3)).unwrap();
    std::thread::scope(|scope| {
        for thread in 0..4i32 {
            let context = &context;
            scope.spawn(move || {
                for job in 0..20i32 {
                    let value = thread * 100 + job;
                    let sums = context
                        .allreduce_async(vec![value; 500 + job as usize * 37])
                        .unwrap()
                        .wait()
                        .unwrap();
                    assert!(sums.iter().all(|&v| v == value * 3), "thread {thread} job {job}");
                }
            });
        }
    });
    context.wait_all();
    let stats = context.stop();
    assert_eq!((stats.jobs_submitted, stats.jobs_finished), (80, 80));
}

/// Whoever sees a job ended also sees it counted: the C++ test once read
/// `jobs_finished` one short right after a wait returned.
#[test]
fn a_job_seen_ended_is_already_in_the_stats() {
    let mut config = dummy_config(2);
    config.general.num_worker_threads = 3;
    config.general.packet_numel = 64;
    let context = Context::start(config).unwrap();
    for job in 1..=2000u64 {
        context.allreduce_async(vec![1i32; 3 * 64]).unwrap().wait().unwrap();
        assert_eq!(context.stats().jobs_finished, job);
    }
}

#[test]
fn block_floating_point_sums_floats_through_int32_and_carries_nan_as_a_nan_block() {
    let mut config = dummy_config(8);
    config.general.prepostprocessor = "cpu_exponent_quantizer".into();
    config.general.max_outstanding_packets = 8;
    let context = Context::start(config).unwrap();
    // Values spanning 60 binary orders of magnitude across packets.
    let input: Vec<f32> =
        (0..20_000).map(|i| ((i % 97) as f32 - 48.0) * 2f32.powi((i / 256) % 60 - 30)).collect();
    let mut sums = input.clone();
    context.allreduce(&mut sums).unwrap();
    // 79 packets over 2 threads of 4 slots: thread 0 has blocks 0..40, thread 1 40..79.
    // Each thread's first window of 4 blocks shares one exponent; every later block has
    // its own.
    let largest = |blocks: std::ops::Range<usize>| {
        input[blocks.start * 256..(blocks.end * 256).min(input.len())]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
    };
    for (block, (got, x)) in sums.chunks(256).zip(input.chunks(256)).enumerate() {
        let scale_of = match block {
            0..4 => largest(0..4),
            40..44 => largest(40..44),
            _ => largest(block..block + 1),
        };
        for (g, v) in got.iter().zip(x) {
            // 8 workers' quantisation steps, relative to the largest element sharing the exponent.
            let bound = scale_of * 8.0 * 8.0 * 2.0 / i32::MAX as f32 + scale_of * 1e-6;
            assert!((g - v * 8.0).abs() <= bound, "block {block}: {g} vs {}", v * 8.0);
        }
    }
    let stats = context.stats();
    let blocks = 20_000usize.div_ceil(256) as u64;
    // A thread kept off its core past the 10 ms timeout by a loaded machine retransmits.
    let total = stats.total();
    assert_eq!(
        total.data_sent - total.retransmissions,
        blocks + 2,
        "one exponent round per thread, not one per window"
    );
    // An infinity in block 1 spoils the first window's shared exponent (blocks 0..4), a
    // NaN in block 10 only its own block; every other block sums exactly.
    let mut sums = vec![1.0f32; 20_000];
    sums[256] = f32::INFINITY;
    sums[10 * 256 + 5] = f32::NAN;
    context.allreduce(&mut sums).unwrap();
    for (block, got) in sums.chunks(256).enumerate() {
        let nan = matches!(block, 0..4 | 10);
        assert!(got.iter().all(|g| if nan { g.is_nan() } else { *g == 8.0 }), "block {block}: {got:?}");
    }
    let mut ints = vec![5i32; 1000];
    context.allreduce(&mut ints).unwrap();
    assert!(ints.iter().all(|&v| v == 40), "int32 travels as is");
}

#[test]
fn mismatched_registrations_are_rejected_with_what_differs() {
    let switch = Switch::start(&[]);
    let session = unique_session("mismatch");
    let mut first = switch.config(0, 2, &session);
    first.general.connect_timeout = Duration::from_secs(3);
    let mut second = switch.config(1, 2, &session);
    second.general.packet_numel = 64;
    second.general.sparse = netagg::config::SparseMode::Auto;
    let waiting = std::thread::spawn(move || Context::start(first).map(|_| ()));
    std::thread::sleep(Duration::from_millis(300));
    let error = Context::start(second).map(|_| ()).unwrap_err();
    let Error::Rejected { code, message } = &error else { panic!("expected a rejection, got {error:?}") };
    assert_eq!(*code, RejectCode::Mismatch);
    assert_eq!(
        message,
        "rank 1 differs from rank 0: packet elements 64 instead of 256, blocks sparse = auto instead of sparse = off"
    );
    // Rank 0 never sees its session complete, and is told which switch it waited for.
    let timeout = waiting.join().unwrap().unwrap_err();
    assert!(matches!(timeout, Error::RegisterTimeout { workers: 2, .. }), "{timeout:?}");
    assert_eq!(
        timeout.to_string(),
        format!(
            "session '{session}': not all 2 workers registered with the switch at {} within 3s",
            switch.control
        )
    );

    let mut first = switch.config(0, 2, &unique_session("duplicate"));
    first.general.connect_timeout = Duration::from_secs(3);
    let mut duplicate = first.clone();
    duplicate.general.connect_timeout = Duration::from_secs(1);
    let waiting = std::thread::spawn(move || Context::start(first).map(|_| ()));
    std::thread::sleep(Duration::from_millis(300));
    let error = Context::start(duplicate).map(|_| ()).unwrap_err();
    assert!(matches!(&error, Error::Rejected { code: RejectCode::DuplicateRank, .. }), "{error:?}");
    assert!(waiting.join().unwrap().is_err());
}

#[test]
fn an_old_connection_closing_leaves_a_newer_session_of_its_name_alone() {
    let switch = Switch::start(&[]);
    let again = |config: &mut Config| config.general.session = "again".into();
    let mut old = contexts(&switch, 2, again);
    drop(old.pop()); // rank 1 leaves: the session closes, rank 0 is told
    std::thread::sleep(Duration::from_millis(200));
    // The usual recovery: a new context, started before the old one is dropped.
    let new = contexts(&switch, 2, again);
    drop(old);
    std::thread::sleep(Duration::from_millis(200));
    assert!(allreduce_all(&new, 5000).iter().all(Result::is_ok));
}

#[test]
fn an_own_codec_may_refuse_a_tensor_and_its_panic_fails_the_job_instead_of_hanging() {
    /// Refuses negative first elements; panics when encoding anything else.
    struct Picky;
    impl netagg::Codec for Picky {
        fn wire_type(&self, data_type: netagg::DataType) -> netagg_wire::ElementType {
            netagg::Native.wire_type(data_type)
        }
        fn check(&self, _: netagg::DataType, elements: &[u8]) -> Result<(), String> {
            match elements.get(3) {
                Some(byte) if byte & 0x80 != 0 => Err("a negative first element".into()),
                _ => Ok(()),
            }
        }
        fn encode(&self, _: netagg::DataType, _: &[u8], _: &mut [u8], _: Option<i8>) {
            panic!("codec bug");
        }
        fn decode(&self, _: netagg::DataType, _: &[u8], _: &mut [u8], _: Option<i8>) {}
    }
    let context = Context::start_with_codec(dummy_config(1), std::sync::Arc::new(Picky)).unwrap();
    let mut refused = vec![-1i32; 10];
    let error = context.allreduce(&mut refused).unwrap_err();
    assert_eq!(error, Error::InvalidInput("a negative first element".into()));
    assert_eq!(refused, [-1; 10], "a refused tensor is left alone");
    let error = context.allreduce(&mut vec![1i32; 1000]).unwrap_err();
    assert!(matches!(&error, Error::Panicked { message, .. } if message == "codec bug"), "{error:?}");
    context.wait_all();
    let stats = context.stats();
    assert_eq!((stats.jobs_submitted, stats.jobs_failed), (1, 1), "the refused job was never submitted");
}

#[test]
fn an_unreachable_switch_fails_within_the_timeout() {
    let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = unused.local_addr().unwrap().port();
    drop(unused);
    let mut config = Config::default();
    config.general.controller_port = port;
    config.general.connect_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let error = Context::start(config).map(|_| ()).unwrap_err();
    assert!(matches!(error, Error::Connect { .. }), "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

#[test]
fn a_rank_that_leaves_fails_the_others_jobs_at_once() {
    let switch = Switch::start(&[]);
    let mut contexts = contexts(&switch, 2, |config| config.general.job_timeout = Duration::from_secs(30));
    let leaver = contexts.pop().unwrap();
    drop(leaver);
    let started = Instant::now();
    // A job submitted before the switch's notice arrives waits for it, then fails too.
    let error = contexts[0].allreduce(&mut vec![1i32; 1000]).unwrap_err();
    assert!(matches!(&error, Error::SessionLost(m) if m.contains("rank 1 left session")), "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "failed after {:?}, not at once", started.elapsed());
}

/// Each rank's tensor: rank `r` fills block `b` only where `(b + r) % 4 == 0`, so each
/// block holds data from at most one of 2 ranks, and blocks 2, 6, 10, ... from neither.
fn sparse_tensor(rank: usize, blocks: usize, packet: usize) -> Vec<i32> {
    (0..blocks * packet - 5)
        .map(|i| if (i / packet + rank) % 4 == 0 { (i as i32 % 1000) - 500 + rank as i32 } else { 0 })
        .collect()
}

#[test]
fn sparse_tensors_sum_exactly_and_zero_blocks_stay_off_the_wire() {
    const PACKET: usize = 64;
    const BLOCKS: usize = 400;
    let switch = Switch::start(&[]);
    let mut results = Vec::new();
    for sparse in [netagg::SparseMode::Auto, netagg::SparseMode::Off] {
        let contexts = contexts(&switch, 2, |config| {
            config.general.packet_numel = PACKET as u16;
            config.general.sparse = sparse;
            // Few slots, so that the opening packets of each slot's stream do not hide
            // how few blocks travel.
            config.general.max_outstanding_packets = 16;
        });
        let outcomes: Vec<(Vec<i32>, Vec<i32>, u64)> = std::thread::scope(|scope| {
            let ranks: Vec<_> = contexts
                .into_iter()
                .enumerate()
                .map(|(rank, context)| {
                    scope.spawn(move || {
                        let input = sparse_tensor(rank, BLOCKS, PACKET);
                        let mut in_place = input.clone();
                        context.allreduce(&mut in_place).unwrap();
                        // Out of place into a buffer of garbage: blocks no one sends must
                        // still come out zero.
                        let mut out_of_place = vec![-7i32; input.len()];
                        context.allreduce_into(&input, &mut out_of_place).unwrap();
                        // First transmissions: what the layout put on the wire, whatever a
                        // loaded machine's late timers sent again.
                        let total = context.stop().total();
                        (in_place, out_of_place, total.data_sent - total.retransmissions)
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let expected: Vec<i32> = sparse_tensor(0, BLOCKS, PACKET)
            .iter()
            .zip(sparse_tensor(1, BLOCKS, PACKET))
            .map(|(a, b)| a + b)
            .collect();
        for (rank, (in_place, out_of_place, _)) in outcomes.iter().enumerate() {
            assert!(in_place == &expected, "rank {rank}, {sparse:?}: in-place sums differ");
            assert!(out_of_place == &expected, "rank {rank}, {sparse:?}: out-of-place sums differ");
        }
        results.push(outcomes.iter().map(|o| o.2).collect::<Vec<_>>());
    }
    // Dense: every rank sends every block of both jobs. Sparse: its quarter of the blocks,
    // plus at most one empty opening packet per slot and job (first transmissions only).
    let (sparse, dense) = (&results[0], &results[1]);
    let slots = 16;
    for rank in 0..2 {
        assert!(dense[rank] >= 2 * BLOCKS as u64, "rank {rank}: dense sent {}", dense[rank]);
        assert!(
            sparse[rank] <= 2 * (BLOCKS as u64 / 4 + slots),
            "rank {rank}: sparse sent {} data packets, dense {}",
            sparse[rank],
            dense[rank]
        );
    }
}

/// A rank's stop returns once the switch has taken its leave: by the time the last rank's
/// returns, the switch has ended the session as every rank leaving (a clean end, not a
/// rank lost), and the same ranks register under the same name at once.
#[test]
fn stop_returns_once_the_switch_has_taken_the_leave() {
    let scratch = scratch_dir("leave");
    let log = scratch.path().join("switch.log");
    let switch = Switch::start_logging("info", &log);
    let session = unique_session("leave");
    let session = session.as_str();
    let start = |switch: &Switch| -> Vec<Context> {
        std::thread::scope(|scope| {
            let starts: Vec<_> = (0..2)
                .map(|rank| scope.spawn(move || Context::start(switch.config(rank, 2, session)).unwrap()))
                .collect();
            starts.into_iter().map(|start| start.join().unwrap()).collect()
        })
    };
    let first = start(&switch);
    assert!(allreduce_all(&first, 1000).iter().all(Result::is_ok));
    for context in &first {
        context.stop();
    }
    // Read at once: what the switch logged by now it did before the stops returned.
    let logged = std::fs::read_to_string(&log).unwrap();
    let closed: Vec<&str> = logged.lines().filter(|line| line.contains("session closed")).collect();
    assert!(closed.len() == 1 && closed[0].contains("session closed: every rank left"), "{logged}");

    let again = Instant::now();
    let second = start(&switch);
    assert!(again.elapsed() < Duration::from_secs(2), "registering again took {:?}", again.elapsed());
    assert!(allreduce_all(&second, 1000).iter().all(Result::is_ok));
}
