//! Sessions spread over several `netagg-switch` processes (shards, `general.switches`),
//! end to end: each switch sums a contiguous share of every job's slots under a session id
//! and token of its own, and each worker thread sends each slot's packets to its owner. A
//! switch drops packets without its own session's token, so a sum that comes out right was
//! routed right.

mod common;

use std::time::{Duration, Instant};

use common::{contexts, run_verified, Switch};
use netagg::{Config, Context, Error, SparseMode};

/// How long the worker processes of one run may take.
const WITHIN: Duration = Duration::from_secs(120);

/// `count` switches on loopback, each dropping 1 % of the results it sends; two of them
/// with two data-path threads each, whose split over the session's slots the workers
/// follow within each switch's range.
fn shards(count: usize) -> Vec<Switch> {
    let threads = if count == 2 { "2" } else { "1" };
    (0..count)
        .map(|i| Switch::start(&["--threads", threads, "--faults", &format!("send_drop=0.01,seed={i}")]))
        .collect()
}

/// Their control addresses, as `general.switches` lists them.
fn addresses(switches: &[Switch]) -> String {
    switches.iter().map(|switch| switch.control.to_string()).collect::<Vec<_>>().join(",")
}

/// The switch's fault counters show that it carried traffic, and lost some of it.
fn assert_dropped(switch: Switch) {
    let stats = switch.stop();
    let faults = stats.lines().find(|l| l.contains("faults injected")).expect("fault counters");
    assert!(common::counter(faults, "send dropped") > 0, "{faults}");
}

#[test]
fn two_and_four_switches_sum_int32_exactly_and_float32_within_bound_with_loss_both_ways() {
    for count in [2, 4] {
        let switches = shards(count);
        let list = addresses(&switches);
        // 3 worker threads: the middle one's slots straddle two switches.
        let env = [
            ("NETAGG_GENERAL__SWITCHES", list.as_str()),
            ("NETAGG_GENERAL__NUM_WORKER_THREADS", "3"),
            ("NETAGG_GENERAL__MAX_OUTSTANDING_PACKETS", "48"),
            ("NETAGG_FAULTS__SEND_DROP", "0.01"),
            ("NETAGG_FAULTS__SEED", "11"),
            ("NETAGG_GENERAL__TIMEOUT", "2"),
        ];
        run_verified(&switches[0], 3, &env, &["--numel", "1,255,256,257,100000", "--jobs", "5"], WITHIN);
        let float = ["--type", "float32", "--numel", "100000", "--jobs", "2"];
        run_verified(&switches[0], 3, &env, &float, WITHIN);
        // Block floating point: each switch's rounds max-reduce the exponents of its slots.
        let quantised =
            [&env[..], &[("NETAGG_GENERAL__PREPOSTPROCESSOR", "cpu_exponent_quantizer")]].concat();
        run_verified(&switches[0], 3, &quantised, &float, WITHIN);
        switches.into_iter().for_each(assert_dropped);
    }
}

/// Rank `r` fills block `b` only where `(b + r) % 3 == 0`: a third of each rank's blocks,
/// none of block 2, 5, 8, ... from either of 2 ranks.
fn sparse_tensor(rank: usize, blocks: usize, packet: usize) -> Vec<i32> {
    (0..blocks * packet - 3)
        .map(|i| if (i / packet + rank) % 3 == 0 { (i as i32 % 997) - 400 + rank as i32 } else { 0 })
        .collect()
}

#[test]
fn two_switches_sum_sparse_and_dense_tensors_exactly_with_loss() {
    const PACKET: usize = 64;
    const BLOCKS: usize = 500;
    let switches = shards(2);
    let list: Vec<String> = switches.iter().map(|switch| switch.control.to_string()).collect();
    for sparse in [SparseMode::Auto, SparseMode::Off] {
        let contexts = contexts(&switches[0], 2, |config| {
            config.general.switches = list.clone();
            config.general.packet_numel = PACKET as u16;
            config.general.sparse = sparse;
            config.general.num_worker_threads = 2;
            config.general.max_outstanding_packets = 16;
            config.general.timeout = Duration::from_millis(2);
        });
        for _ in 0..3 {
            let sums: Vec<Vec<i32>> = std::thread::scope(|scope| {
                let ranks: Vec<_> = contexts
                    .iter()
                    .enumerate()
                    .map(|(rank, context)| {
                        scope.spawn(move || {
                            let mut data = sparse_tensor(rank, BLOCKS, PACKET);
                            context.allreduce(&mut data).unwrap();
                            data
                        })
                    })
                    .collect();
                ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
            });
            let expected: Vec<i32> = sparse_tensor(0, BLOCKS, PACKET)
                .iter()
                .zip(sparse_tensor(1, BLOCKS, PACKET))
                .map(|(a, b)| a + b)
                .collect();
            for (rank, sum) in sums.iter().enumerate() {
                assert!(sum == &expected, "rank {rank}, {sparse:?}: sums differ");
            }
        }
        // Each switch opened the session on its own.
        assert_ne!(contexts[0].session(), 0);
    }
    switches.into_iter().for_each(assert_dropped);
}

#[test]
fn a_switch_killed_mid_job_fails_every_ranks_job_at_once_naming_it() {
    let switches: Vec<Switch> = (0..2).map(|_| Switch::start(&[])).collect();
    let list: Vec<String> = switches.iter().map(|switch| switch.control.to_string()).collect();
    let job_timeout = Duration::from_secs(30);
    let contexts = contexts(&switches[0], 3, |config| {
        config.general.switches = list.clone();
        config.general.job_timeout = job_timeout;
    });
    let mut switches = switches;
    let victim = switches.pop().unwrap();
    let started = Instant::now();
    let errors: Vec<Error> = std::thread::scope(|scope| {
        // Rank 2 holds back: every round waits for it, so the job is mid-way when the
        // second switch dies.
        let jobs: Vec<_> = contexts[..2]
            .iter()
            .map(|context| scope.spawn(move || context.allreduce(&mut vec![1i32; 1 << 20]).unwrap_err()))
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        drop(victim); // SIGKILL
        let last = scope.spawn(|| contexts[2].allreduce(&mut vec![1i32; 1 << 20]).unwrap_err());
        jobs.into_iter().chain([last]).map(|job| job.join().unwrap()).collect()
    });
    let named = format!("the switch at {} closed the control connection", list[1]);
    for error in errors {
        assert!(matches!(&error, Error::SessionLost(m) if m.contains(&named)), "{error:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(5), "failed after {:?}, not at once", started.elapsed());
}

#[test]
fn registration_with_an_unreachable_switch_fails_naming_it() {
    let switch = Switch::start(&[]);
    // An address of TEST-NET-1, which no host answers (a port bound and closed again may
    // be taken by another test's switch meanwhile).
    let unreachable: std::net::SocketAddr = "192.0.2.1:9".parse().unwrap();
    let mut config: Config = switch.config(0, 1, &common::unique_session("unreachable"));
    config.general.switches = vec![switch.control.to_string(), unreachable.to_string()];
    config.general.connect_timeout = Duration::from_secs(1);
    let Err(error) = Context::start(config) else { panic!("a context started without its second switch") };
    assert!(
        matches!(&error, Error::Connect { address, .. } if *address == unreachable.to_string()),
        "{error:?}"
    );
    assert!(error.to_string().starts_with(&format!("cannot reach the switch at {unreachable}")), "{error}");
}
