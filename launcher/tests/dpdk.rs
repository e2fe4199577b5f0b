//! DPDK on both sides of the wire, in network namespaces: workers whose datagrams leave
//! from DPDK ports with a kernel-socket switch, kernel-socket workers with a switch whose
//! data path is a DPDK port, and DPDK on both sides, on clean, lossy and corrupting links, with exact
//! results (int32 and float32 in every pairing, float16 and bfloat16 with DPDK at both
//! ends). DPDK's af_packet driver runs on each namespace's interface, without
//! hugepages (`netagg-run --dpdk`). Root is needed, as CI has; like the other emulated
//! networks these are ignored in a plain `cargo test`, and `scripts/test` runs them in
//! release, one at a time.

mod common;

use std::process::Command;

use common::{benchmark, launcher, namespaces_of, pair, prefix, program, report_row, text};

/// Runs `allreduce_benchmark --verify` on 3 workers with `--dpdk sides` on `link`;
/// returns what the run printed, after checking that it verified on every rank, that
/// each side ran on the transport asked for, and that nothing was left behind.
fn verified_run(sides: &str, link: &str, tensor_type: &str, density: &str) -> String {
    verified_run_with(sides, link, tensor_type, density, &[])
}

/// [`verified_run`] with environment variables `environment` for every process.
fn verified_run_with(
    sides: &str,
    link: &str,
    tensor_type: &str,
    density: &str,
    environment: &[(&str, &str)],
) -> String {
    let output = launcher()
        .args(["-n", "3", "--link", link, "--dpdk", sides, "--"])
        .arg(benchmark())
        .args(["--tensor-numel", "96Ki", "--tensor-type", tensor_type, "--density", density])
        .args(["--num-jobs", "3", "--num-warmup-jobs", "1", "--verify"])
        .envs(environment.iter().copied())
        .env_remove("NETAGG_CONFIG")
        .output()
        .unwrap();
    let all = text(&output);
    let run = format!("--dpdk {sides}, {link}, {tensor_type}, density {density}, {environment:?}");
    assert!(output.status.success(), "{run}:\n{all}");
    assert_eq!(all.matches("Data verified successfully").count(), 3, "{run}:\n{all}");

    // Each worker says what carried its packets: a DPDK port on its interface, or a
    // kernel socket. Nothing falls back from one to the other.
    let on_dpdk = all.matches("Transport: dpdk: device net_af_packet0,iface=eth0").count();
    let on_kernel = all.matches("Transport: udp: a kernel socket").count();
    let dpdk_workers = sides != "switch";
    assert_eq!((on_dpdk, on_kernel), if dpdk_workers { (3, 0) } else { (0, 3) }, "{run}:\n{all}");
    let dpdk_switch = sides != "workers";
    assert_eq!(all.contains("data path on a DPDK port"), dpdk_switch, "{run}:\n{all}");
    // The switch's data path received every rank's packets (whichever it runs on).
    let datagrams: u64 = all
        .lines()
        .find_map(|line| line.strip_prefix("[switch] stats: datagrams "))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no switch stats:\n{all}"));
    assert!(datagrams >= 3 * 4, "{run}: {datagrams} datagrams:\n{all}");
    assert_eq!(namespaces_of(&prefix(&all)), Vec::<String>::new(), "left behind after {run}:\n{all}");
    all
}

#[test]
#[ignore = "needs root and runs a network of processes: scripts/test runs this file alone, in release, with --ignored"]
fn dpdk_workers_and_kernel_udp_switch_in_every_pairing_sum_exactly() {
    for sides in ["workers", "switch", "both"] {
        for tensor_type in ["int32", "float32"] {
            for density in ["1", "0.1"] {
                verified_run(sides, "rate=1gbit", tensor_type, density);
            }
        }
    }
    // The 16-bit types, with DPDK at both ends: a packet's layout is the wire format's,
    // which no transport looks into, so one run each, one dense and one sparse.
    verified_run("both", "rate=1gbit", "float16", "1");
    verified_run("both", "rate=1gbit", "bfloat16", "0.1");
}

#[test]
#[ignore = "needs root and runs a network of processes: scripts/test runs this file alone, in release, with --ignored"]
fn worker_threads_spread_over_several_queues_and_share_them_when_fewer() {
    // af_packet's qpairs=2 gives the port two queue pairs, over which the kernel spreads
    // received frames by flow (PACKET_FANOUT): a thread's results may arrive on the queue
    // another thread polls.
    let device = "net_af_packet0,iface=eth0,qdisc_bypass=0,qpairs=2";
    for (threads, expected) in [("2", "2 threads on 2 queues"), ("3", "3 threads on 2 queues")] {
        for (tensor_type, density) in [("int32", "1"), ("float32", "0.1")] {
            let environment =
                [("NETAGG_BACKEND_DPDK__DEVICE", device), ("NETAGG_GENERAL__NUM_WORKER_THREADS", threads)];
            let all = verified_run_with("both", "rate=1gbit", tensor_type, density, &environment);
            assert_eq!(all.matches(expected).count(), 3, "{all}");
        }
    }
}

#[test]
#[ignore = "needs root and runs a network of processes: scripts/test runs this file alone, in release, with --ignored"]
fn dpdk_on_both_sides_recovers_lost_frames_exactly() {
    for tensor_type in ["int32", "float32"] {
        let all = verified_run("both", "rate=200mbit,delay=1ms,loss=2%", tensor_type, "1");
        if all.contains("by a user-space delay line") {
            let lost: f64 = (0..3)
                .map(|rank| {
                    let (up, down) = pair(&report_row(&all, rank)[5]);
                    up + down
                })
                .sum();
            assert!(lost > 5.0, "{lost} frames lost:\n{all}");
        } else {
            assert!(all.contains("delay, jitter and loss by netem"), "{all}");
        }
    }
}

#[test]
#[ignore = "needs root and runs a network of processes: scripts/test runs this file alone, in release, with --ignored"]
fn dpdk_on_both_sides_sums_exactly_with_1_percent_of_datagrams_corrupted_each_way() {
    // Corrupted above DPDK, so that each datagram's UDP checksum covers the flipped bit and
    // netagg's own checksum is what finds it, at the switch and at the workers.
    let environment =
        [("NETAGG_FAULTS__SEND_CORRUPT", "0.01"), ("NETAGG_SWITCH_FAULTS__SEND_CORRUPT", "0.01")];
    for (tensor_type, density) in [("int32", "1"), ("float32", "0.1")] {
        let all = verified_run_with("both", "rate=1gbit", tensor_type, density, &environment);
        let corrupt: u64 = all
            .lines()
            .find_map(|line| line.strip_prefix("[switch] stats: datagrams "))
            .and_then(|rest| rest.split(" corrupt ").nth(1)?.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no corrupt count in the switch's stats:\n{all}"));
        assert!(corrupt >= 3, "{tensor_type}: the switch dropped {corrupt} corrupt datagrams:\n{all}");
    }
}

#[test]
#[ignore = "needs root and runs a network of processes: scripts/test runs this file alone, in release, with --ignored"]
fn a_missing_device_or_too_long_packets_fail_the_run_with_the_reason() {
    let output = launcher()
        .args(["-n", "2", "--link", "rate=1gbit", "--dpdk", "workers", "--"])
        .arg(benchmark())
        .args(["--tensor-numel", "1Ki", "--num-jobs", "1"])
        .env("NETAGG_BACKEND_DPDK__DEVICE", "net_af_packet0,iface=nosuch0")
        .env_remove("NETAGG_CONFIG")
        .output()
        .unwrap();
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    assert!(all.contains("DPDK device 'net_af_packet0,iface=nosuch0': cannot probe it"), "{all}");
    assert_eq!(namespaces_of(&prefix(&all)), Vec::<String>::new(), "left behind:\n{all}");

    // Kernel-UDP workers whose packets the DPDK switch's MTU cannot carry are refused at
    // registration, with the size that fits, rather than lost as IP fragments.
    let output = launcher()
        .args(["-n", "2", "--link", "rate=1gbit", "--dpdk", "switch", "--"])
        .arg(benchmark())
        .args(["--tensor-numel", "4Ki", "--num-jobs", "1"])
        .env("NETAGG_GENERAL__PACKET_NUMEL", "1024")
        .env_remove("NETAGG_CONFIG")
        .output()
        .unwrap();
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    assert!(all.contains("this switch's data path carries at most 1472 bytes (its MTU): the largest packet_numel that fits is 355"), "{all}");
    assert_eq!(
        namespaces_of(&prefix(&all)),
        Vec::<String>::new(),
        "left behind:
{all}"
    );

    // A switch whose DPDK port cannot start says why, and exits.
    let output = Command::new(program("netagg-switch"))
        .args(["--transport", "dpdk", "--control", "127.0.0.1:0", "--data", "127.0.0.1:0"])
        .env("NETAGG_SWITCH_DPDK__DEVICE", "net_nosuchdriver0")
        .output()
        .unwrap();
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    assert!(
        all.contains("cannot start the DPDK data path: DPDK device 'net_nosuchdriver0': cannot probe it"),
        "{all}"
    );
}
