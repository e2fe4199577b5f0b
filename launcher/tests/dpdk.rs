//! DPDK on both sides of the wire, in network namespaces: workers whose datagrams leave
//! from DPDK ports with a kernel-socket switch, kernel-socket workers with a switch whose
//! data path is a DPDK port, and DPDK on both sides, on clean, lossy and corrupting links, with exact
//! results (int32 and float32 in every pairing, float16 and bfloat16 with DPDK at both
//! ends), DPDK workers following their switch to a new MAC mid-session, and sessions
//! sharded over 2 switch hosts with DPDK on the workers and on the switches, a dead or
//! unreachable shard failing every rank by name, and a two-level aggregation tree whose
//! workers, rack switches and upper switch all run on DPDK, a killed rack switch failing
//! every rank with a reason. DPDK's
//! af_packet driver runs on each namespace's interface, without hugepages (`netagg-run
//! --dpdk`). Root is needed, as CI has; like the other emulated networks these are
//! ignored in a plain `cargo test`, and `scripts/test` runs them in release, one at a
//! time.

mod common;

use std::process::Command;

use common::{
    benchmark, labelled_row, launcher, namespaces_of, pair, prefix, program, report_row, text, uplink,
};

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
    verified_run_across(1, sides, link, tensor_type, density, environment)
}

/// [`verified_run_with`] across `shards` switches: one as above, or each on a switch
/// host of its own (`--switches`), each of which must have received every rank's
/// packets.
fn verified_run_across(
    shards: usize,
    sides: &str,
    link: &str,
    tensor_type: &str,
    density: &str,
    environment: &[(&str, &str)],
) -> String {
    let placement = if shards > 1 { vec!["--switches".to_string(), shards.to_string()] } else { Vec::new() };
    let output = launcher()
        .args(["-n", "3", "--link", link, "--dpdk", sides])
        .args(&placement)
        .arg("--")
        .arg(benchmark())
        .args(["--tensor-numel", "96Ki", "--tensor-type", tensor_type, "--density", density])
        .args(["--num-jobs", "3", "--num-warmup-jobs", "1", "--verify"])
        .envs(environment.iter().copied())
        .env_remove("NETAGG_CONFIG")
        .output()
        .unwrap();
    let all = text(&output);
    let run = format!(
        "--dpdk {sides}, {shards} switches, {link}, {tensor_type}, density {density}, {environment:?}"
    );
    assert!(output.status.success(), "{run}:\n{all}");
    assert_eq!(all.matches("Data verified successfully").count(), 3, "{run}:\n{all}");

    // Each worker says what carried its packets: a DPDK port on its interface, or a
    // kernel socket. Nothing falls back from one to the other.
    let on_dpdk = all.matches("Transport: dpdk: device net_af_packet0,iface=eth0").count();
    let on_kernel = all.matches("Transport: udp: a kernel socket").count();
    let dpdk_workers = sides != "switch";
    assert_eq!((on_dpdk, on_kernel), if dpdk_workers { (3, 0) } else { (0, 3) }, "{run}:\n{all}");
    let dpdk_switches = if sides == "workers" { 0 } else { shards };
    assert_eq!(all.matches("data path on a DPDK port").count(), dpdk_switches, "{run}:\n{all}");
    // Each switch's data path received every rank's packets (whichever it runs on).
    let labels: Vec<String> = match shards {
        1 => vec!["switch".into()],
        _ => (0..shards).map(|shard| format!("switch {shard}")).collect(),
    };
    for label in labels {
        let datagrams: u64 = all
            .lines()
            .find_map(|line| line.strip_prefix(&format!("[{label}] stats: datagrams ")))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no stats of {label}:\n{all}"));
        assert!(datagrams >= 3 * 4, "{run}: {label} received {datagrams} datagrams:\n{all}");
    }
    if shards > 1 {
        let over = format!("over {shards} switch hosts");
        assert_eq!(all.matches(&over).count(), 3, "{run}:\n{all}");
    }
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

/// The switch's interface takes a new MAC mid-session (as when it is recreated): the DPDK
/// workers' frames to the old one are dropped until their stations learn the new one,
/// from the switch's next frame or by asking again by ARP once it has been silent, and
/// the session carries on, exact.
#[test]
#[ignore = "needs root and runs a network of processes: scripts/test runs this file alone, in release, with --ignored"]
fn dpdk_workers_follow_the_switch_to_a_new_mac_mid_session() {
    use std::io::{BufRead, BufReader, Read};
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    let mut run = launcher()
        .args(["-n", "2", "--link", "rate=100mbit", "--dpdk", "workers", "--"])
        .arg(benchmark())
        .args(["--tensor-numel", "96Ki", "--num-jobs", "150", "--num-warmup-jobs", "1", "--verify"])
        .env_remove("NETAGG_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The namespaces' prefix, from the launcher's first lines.
    let mut stdout = BufReader::new(run.stdout.take().unwrap());
    let mut printed = String::new();
    let prefix = loop {
        let mut line = String::new();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "the run ended early:\n{printed}");
        printed.push_str(&line);
        if line.starts_with("netagg-run: emulated network: namespaces ") {
            break prefix(&line);
        }
    };
    // The rest, read meanwhile so that the run never blocks on a full pipe.
    let rest = std::thread::spawn(move || {
        let mut text = String::new();
        stdout.read_to_string(&mut text).unwrap();
        text
    });
    let mut stderr = run.stderr.take().unwrap();
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        stderr.read_to_string(&mut text).unwrap();
        text
    });
    // Mid-session: the ranks are registered and running jobs by then.
    std::thread::sleep(Duration::from_secs(4));
    let namespace = format!("{prefix}-switch");
    let new_mac = "02:00:00:31:03:01";
    let changed = Command::new("ip")
        .args(["-n", &namespace, "link", "set", "dev", "eth0", "address", new_mac])
        .output()
        .unwrap();
    let mid_session = run.try_wait().unwrap().is_none();
    let started = Instant::now();
    let status = run.wait().unwrap();
    let all = format!("{printed}{}\n{}", rest.join().unwrap(), errors.join().unwrap());
    assert!(changed.status.success(), "{}\n{all}", text(&changed));
    assert!(mid_session, "the run ended before the MAC changed:\n{all}");
    assert!(status.success(), "{all}");
    assert_eq!(all.matches("Data verified successfully").count(), 2, "{all}");
    // Followed well within a job's timeout: the remaining jobs took seconds, not tens.
    assert!(started.elapsed() < Duration::from_secs(60), "{:?}:\n{all}", started.elapsed());
    assert_eq!(namespaces_of(&prefix), Vec::<String>::new(), "left behind:\n{all}");
}

/// A session sharded over 2 switch hosts, each rank's DPDK port reaching both: with
/// kernel-socket switches (of one data-path thread, and of two, whose four endpoints each
/// rank reaches), with DPDK switches, and kernel-socket workers with DPDK switches, on
/// links losing 1 % of frames, int32 exact and float32 within the benchmark's bound,
/// dense and sparse.
#[test]
#[ignore = "needs root and runs a network of processes: scripts/test runs this file alone, in release, with --ignored"]
fn a_session_sharded_over_two_switches_sums_exactly_over_dpdk_with_loss() {
    let lossy = "rate=1gbit,loss=1%";
    let lanes = [("NETAGG_SWITCH__THREADS", "2")];
    for (sides, tensor_type, density, environment) in [
        ("workers", "int32", "1", &[][..]),
        ("workers", "float32", "0.1", &lanes[..]),
        ("both", "float32", "1", &[]),
        ("both", "int32", "0.1", &[]),
        ("switch", "int32", "1", &[]),
    ] {
        verified_run_across(2, sides, lossy, tensor_type, density, environment);
    }
}

/// A run on 1 Gbit/s links placed by `placement` (`-n`, `--dpdk`, the switches) in which
/// `program` runs before each rank's benchmark, in the rank's namespace, with the
/// namespaces' prefix in `$PREFIX`; with what it printed, after checking that it failed
/// and that nothing was left behind.
fn failed_run(placement: &[&str], program: &str, jobs: &str, environment: &[(&str, &str)]) -> String {
    let benchmark = benchmark();
    let script = format!(
        "PREFIX=${{NETAGG_GENERAL__SESSION%-session}}; {program}; exec {} --tensor-numel 96Ki --num-jobs {jobs} --verify",
        benchmark.display()
    );
    let output = launcher()
        .args(["--link", "rate=1gbit"])
        .args(placement)
        .args(["--", "sh", "-c"])
        .arg(script)
        .envs(environment.iter().copied())
        .env_remove("NETAGG_CONFIG")
        .output()
        .unwrap();
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    assert_eq!(namespaces_of(&prefix(&all)), Vec::<String>::new(), "left behind:\n{all}");
    all
}

/// Checks that `rank`'s benchmark printed a line holding each of `failure`.
fn assert_rank_failed_with(all: &str, rank: usize, failure: &[&str]) {
    let rank_line = format!("[{rank}] allreduce_benchmark: ");
    let failed = all
        .lines()
        .any(|line| line.starts_with(&rank_line) && failure.iter().all(|fragment| line.contains(fragment)));
    assert!(failed, "rank {rank} did not fail with {failure:?}:\n{all}");
}

/// A run of `placement` (`-n`, `--dpdk`, the switches) in which rank 0's benchmark
/// writes through a reader that kills the switch on switch host `s1` (the second shard,
/// or rack 1's switch) at the first job's line, so that jobs are running; with what it
/// printed, after checking that it failed at once, well within the job timeout a job in
/// flight at the kill would otherwise wait out, and left nothing behind. Jobs enough for
/// a minute or so: a run the kill missed ends, and fails.
fn run_killing_switch_host_1(placement: &[&str]) -> String {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    let kill = r#"if [ "$RANK" = 0 ]; then
        lines=$(mktemp -u); mkfifo "$lines"
        (killed=; while IFS= read -r line; do
            printf '%s\n' "$line"
            case "$line" in *"Job(s) #"*) if [ -z "$killed" ]; then
                ip netns pids "$PREFIX-s1" | xargs kill -9
                echo "killed switch host s1 at $(date +%s.%N)" >&2; killed=yes
            fi;; esac
        done <"$lines") &
        exec >"$lines"; rm "$lines"
    fi"#;
    let job_timeout = Duration::from_secs(60);
    let timeout = job_timeout.as_secs().to_string();
    let environment = [("NETAGG_GENERAL__JOB_TIMEOUT", timeout.as_str())];
    let all = failed_run(placement, kill, "2000", &environment);
    let ended = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let killed = all
        .lines()
        .find_map(|line| {
            line.split_once("killed switch host s1 at ").map(|(_, at)| at.parse::<f64>().unwrap())
        })
        .unwrap_or_else(|| panic!("no job ran before the run failed:\n{all}"));
    // From the kill to the run's end: every rank's failure, then the teardown.
    let after_kill = ended.as_secs_f64() - killed;
    assert!(after_kill < job_timeout.as_secs_f64() / 2.0, "{after_kill} s after the kill:\n{all}");
    all
}

/// The second shard killed mid-session fails every rank's job at once, naming it; a
/// second shard whose host is off the network fails every rank's registration, naming
/// it. The DPDK ranks neither hang nor wait for their job timeout.
#[test]
#[ignore = "needs root and runs a network of processes: scripts/test runs this file alone, in release, with --ignored"]
fn a_dead_or_unreachable_shard_fails_every_dpdk_rank_naming_it() {
    let shards = ["-n", "3", "--dpdk", "workers", "--switches", "2"];
    // Each rank's jobs fail with the killed switch's address (the second host's,
    // 10.213.7.202).
    let all = run_killing_switch_host_1(&shards);
    for rank in 0..3 {
        let failure = ["failed: session lost: the switch at 10.213.7.202:", "closed the control connection"];
        assert_rank_failed_with(&all, rank, &failure);
    }

    // The second switch host's link goes down before any rank registers.
    let unplug = "ip -n \"$PREFIX-s1\" link set eth0 down";
    let environment = [("NETAGG_GENERAL__CONNECT_TIMEOUT", "2")];
    let all = failed_run(&shards, unplug, "1", &environment);
    for rank in 0..3 {
        assert_rank_failed_with(&all, rank, &["cannot reach the switch at 10.213.7.202:"]);
    }
    assert!(!all.contains("Data verified successfully"), "{all}");
}

/// A two-level aggregation tree over DPDK: 2 racks of 2 DPDK ranks, each behind a DPDK
/// rack switch whose rounds go up to a DPDK upper switch from the same port, on links
/// losing 1 % of frames, every switch dropping 1 % of what it receives and of what it
/// sends (so that the uplinks, which lose nothing of their own, lose both ways): int32
/// exact and float32 within the benchmark's bound (as block floating point, exponents
/// combined across levels), dense and sparse, one session after another in one network.
#[test]
#[ignore = "needs root and runs a network of processes: scripts/test runs this file alone, in release, with --ignored"]
fn a_two_level_tree_sums_exactly_over_dpdk_with_loss_on_both_hops() {
    // (the benchmark's options, its environment): each run a session of its own name.
    let runs = [
        ("--tensor-type int32", ""),
        ("--tensor-type float", "NETAGG_GENERAL__PREPOSTPROCESSOR=cpu_exponent_quantizer"),
        ("--tensor-type int32 --density 0.1", ""),
        ("--tensor-type float --density 0.05", ""),
    ];
    let benchmark = benchmark();
    let script: Vec<String> = (runs.iter().enumerate())
        .map(|(run, (options, environment))| {
            format!(
                "env NETAGG_GENERAL__SESSION=\"$NETAGG_GENERAL__SESSION-{run}\" {environment} {} \
                 --tensor-numel 96Ki --num-jobs 2 --num-warmup-jobs 1 --verify {options}",
                benchmark.display()
            )
        })
        .collect();
    let output = launcher()
        .args(["-n", "4", "--racks", "2", "--link", "rate=1gbit,loss=1%", "--dpdk", "both"])
        .args(["--switch-arg", "--faults", "--switch-arg", "receive_drop=0.01,send_drop=0.01,seed=7"])
        .args(["--", "sh", "-c"])
        .arg(format!("set -e; {}", script.join("; ")))
        .env_remove("NETAGG_CONFIG")
        .output()
        .unwrap();
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    let sessions = 4 * runs.len();
    assert_eq!(all.matches("Data verified successfully").count(), sessions, "{all}");
    let on_dpdk = all.matches("Transport: dpdk: device net_af_packet0,iface=eth0").count();
    assert_eq!(on_dpdk, sessions, "{all}");
    // The upper switch and both racks' switches: each has one data path, the DPDK port,
    // which carries its uplink too.
    assert_eq!(all.matches("data path on a DPDK port").count(), 3, "{all}");
    assert!(all.contains("[upper switch] stats: faults injected: receive dropped"), "{all}");
    // Every round of the upper switch came down once to each rack, whatever was sent
    // again; a rack went up in each round once, but for the sparse rounds none of its
    // ranks had a block in (silent), and at least for every packet of the dense runs (2
    // runs of 3 jobs of 384 packets).
    let rounds = uplink(&all, 0, "results-down");
    for rack in 0..2 {
        let (up, down) = (uplink(&all, rack, "sent-up"), uplink(&all, rack, "results-down"));
        assert!(
            down == rounds && (2 * 3 * 384..=down).contains(&up),
            "rack {rack}: {up} up, {down} down:\n{all}"
        );
        assert!(uplink(&all, rack, "resent-up") > 0, "rack {rack} lost nothing on its uplink:\n{all}");
        // The rack's uplink carried at least the two dense runs' tensors (3 jobs of 96Ki
        // 4-byte elements) each way: the rounds crossed it, not some other path.
        let (carried_up, carried_down) = pair(&labelled_row(&all, &format!("u{rack}"))[2]);
        let dense = 2.0 * 3.0 * 96.0 * 1024.0 * 4.0 / 1e6;
        assert!(carried_up > dense && carried_down > dense, "rack {rack}'s uplink:\n{all}");
    }
    assert_eq!(namespaces_of(&prefix(&all)), Vec::<String>::new(), "left behind:\n{all}");
}

/// Rack 1's DPDK switch killed mid-session fails every rank of both racks at once: its
/// own ranks saying their switch closed its connection, the other rack's with the upper
/// switch's word that rack 1 (its rank 1) left.
#[test]
#[ignore = "needs root and runs a network of processes: scripts/test runs this file alone, in release, with --ignored"]
fn a_killed_dpdk_rack_switch_fails_every_rank_with_a_reason() {
    // Rack r's switch runs on switch host s<r>. A rank of rack 1 knows one switch, its
    // rack's, which its message names by its address (the second host's).
    let all = run_killing_switch_host_1(&["-n", "4", "--racks", "2", "--dpdk", "both"]);
    let own_rack = ["failed: session lost: the switch at 10.213.7.202:", "closed the control connection"];
    let other_rack = ["whose ranks are the tree's 2 racks, ended the tree's session: rank 1 left session"];
    for (rank, failure) in [(0, &other_rack[..]), (1, &other_rack), (2, &own_rack), (3, &own_rack)] {
        assert_rank_failed_with(&all, rank, failure);
    }
}
