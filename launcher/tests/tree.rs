//! Aggregation trees on loopback: `netagg-run --racks`, an upper switch and a lower
//! switch per rack, verifying sums through both levels with loss on both hops, and the
//! departure of a worker or of a rack's switch reaching every rank.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{benchmark, launcher, program, text, uplink};
use netagg_wire::packet::datagram_len;

/// `allreduce_benchmark --verify` on 2 racks of 2 ranks, every switch dropping 1 % of
/// what it receives and of what it sends: both hops lose packets both ways.
fn lossy_tree(extra: &[&str], environment: &[(&str, &str)]) -> Output {
    launcher()
        .args(["-n", "4", "--racks", "2", "--switch-arg", "--faults", "--switch-arg"])
        .arg("receive_drop=0.01,send_drop=0.01,seed=7")
        .arg("--")
        .arg(benchmark())
        .args(["--tensor-numel", "64Ki", "--num-jobs", "2", "--num-warmup-jobs", "1", "--verify"])
        .args(extra)
        .envs(environment.iter().copied())
        .output()
        .unwrap()
}

#[test]
fn a_two_level_tree_sums_exactly_dense_and_sparse_with_loss_on_both_hops() {
    // (options, whether float32 travels as block floating point)
    let cases: [(&[&str], bool); 4] = [
        (&["--tensor-type", "int32"], false),
        (&["--tensor-type", "float"], true),
        (&["--tensor-type", "int32", "--density", "0.1"], false),
        (&["--tensor-type", "float", "--density", "0.05"], false),
    ];
    for (extra, block_floating_point) in cases {
        let quantizer = [("NETAGG_GENERAL__PREPOSTPROCESSOR", "cpu_exponent_quantizer")];
        let output = lossy_tree(extra, if block_floating_point { &quantizer } else { &[] });
        let all = text(&output);
        assert!(output.status.success(), "{extra:?}: {all}");
        assert_eq!(all.matches("Data verified successfully").count(), 4, "{extra:?}: {all}");
        for rack in 0..2 {
            // Every round went up once and came down once, whatever was sent again.
            let (up, down) = (uplink(&all, rack, "sent-up"), uplink(&all, rack, "results-down"));
            assert!(up > 0 && up == down, "rack {rack}, {extra:?}: {up} up, {down} down:\n{all}");
        }
        assert!(all.contains("[switch] stats: faults injected: receive dropped"), "{all}");
    }
}

#[test]
fn each_rack_s_uplink_carries_one_tensor_each_way() {
    // 3 jobs (one warm-up) of 64Ki int32 elements: 256 packets of 256 elements each.
    // Every switch runs two data-path threads, each relaying its share of the slots.
    let output = launcher()
        .args(["-n", "4", "--racks", "2", "--switch-arg", "--threads", "--switch-arg", "2", "--"])
        .arg(benchmark())
        .args(["--tensor-numel", "64Ki", "--num-jobs", "2", "--num-warmup-jobs", "1", "--verify"])
        .output()
        .unwrap();
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    let tensors = 3 * 256 * datagram_len(256) as u64;
    for rack in 0..2 {
        // Without loss no data goes up twice; a round waiting for the other rack costs
        // header-only requests, and a silent stretch acknowledgements.
        assert_eq!(uplink(&all, rack, "resent-up"), 0, "{all}");
        let headers = datagram_len(0) as u64 * (uplink(&all, rack, "requests") + uplink(&all, rack, "acks"));
        let (up, down) = (uplink(&all, rack, "bytes-up") - headers, uplink(&all, rack, "bytes-down"));
        // The benchmark's own start-up exchange adds a packet or so.
        let one_tensor_each = |bytes: u64| (tensors..tensors + 2048).contains(&bytes);
        assert!(
            one_tensor_each(up) && one_tensor_each(down),
            "rack {rack}: {up} B up, {down} B down:\n{all}"
        );
    }
}

#[test]
fn a_killed_worker_fails_every_rank_of_every_rack_with_a_reason() {
    // Rank 3 is killed mid-run; the others would run for minutes.
    let output = launcher()
        .args(["-n", "4", "--racks", "2", "--", "sh", "-c"])
        .arg(r#"if [ "$RANK" = 3 ]; then exec timeout -s KILL 2 "$0" "$@"; fi; exec "$0" "$@""#)
        .arg(program("netagg-allreduce"))
        .args(["--numel", "100000", "--jobs", "100000"])
        .output()
        .unwrap();
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    let own_rack = "reason=rank 3 left session";
    let other_rack = "whose ranks are the tree's 2 racks, ended the tree's session: rank 1 left session";
    for (rank, reason) in [(0, other_rack), (1, other_rack), (2, own_rack)] {
        let said = all.lines().any(|line| line.starts_with(&format!("[{rank}] ")) && line.contains(reason));
        assert!(said, "rank {rank} does not say '{reason}':\n{all}");
    }
}

/// A switch process on free loopback ports, and its control address.
fn switch(arguments: &[&str]) -> (Child, String) {
    let mut child = Command::new(program("netagg-switch"))
        .args(["--control", "127.0.0.1:0", "--data", "127.0.0.1:0", "--log-level", "warn"])
        .args(arguments)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    let control = first.split_whitespace().nth(2).expect("the switch's start-up line").to_string();
    (child, control)
}

#[test]
fn a_killed_rack_switch_fails_every_rank_with_a_reason() {
    let (mut upper, upper_control) = switch(&[]);
    let racks: Vec<(Child, String)> = (0..2)
        .map(|rack| switch(&["--upstream", &upper_control, "--rack", &rack.to_string(), "--racks", "2"]))
        .collect();
    let session = format!("tree-test-{}", std::process::id());
    let mut ranks: Vec<Child> = (0..4usize)
        .map(|rank| {
            let (host, port) = racks[rank / 2].1.rsplit_once(':').unwrap();
            Command::new(program("netagg-allreduce"))
                .args(["--numel", "100000", "--jobs", "100000"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "4")
                .env("NETAGG_GENERAL__CONTROLLER_IP", host)
                .env("NETAGG_GENERAL__CONTROLLER_PORT", port)
                .env("NETAGG_GENERAL__SESSION", &session)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let [(mut rack_0, _), (mut rack_1, _)] = <[_; 2]>::try_from(racks).ok().unwrap();
    rack_1.kill().unwrap();
    rack_1.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let outputs: Vec<(bool, String)> = ranks
        .iter_mut()
        .map(|rank| {
            while rank.try_wait().unwrap().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = rank.kill();
            let status = rank.wait().unwrap();
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut rank.stderr.take().unwrap(), &mut stderr).unwrap();
            (status.success(), stderr)
        })
        .collect();
    for child in [&mut upper, &mut rack_0] {
        let _ = child.kill();
        let _ = child.wait();
    }
    for (rank, (succeeded, stderr)) in outputs.iter().enumerate() {
        assert!(!succeeded, "rank {rank} went on without its rack's switch:\n{stderr}");
        let reason = if rank < 2 { "ended the tree's session: rank 1 left session" } else { "switch" };
        assert!(stderr.contains(reason), "rank {rank} does not say '{reason}':\n{stderr}");
    }
}

#[test]
fn three_levels_sum_exactly_through_racks_of_racks() {
    // A top switch; 2 middle switches, each a rack of 2 bottom switches; 4 bottom
    // switches, each a rack of 2 of the 8 ranks.
    let (top, top_control) = switch(&[]);
    let mut switches = vec![top];
    let mut middle = Vec::new();
    for rack in 0..2 {
        let (child, control) =
            switch(&["--upstream", &top_control, "--rack", &rack.to_string(), "--racks", "2"]);
        switches.push(child);
        middle.push(control);
    }
    let mut bottom = Vec::new();
    for rack in 0..4usize {
        let upstream = &middle[rack / 2];
        let (child, control) = switch(&["--upstream", upstream, "--rack", &rack.to_string(), "--racks", "4"]);
        switches.push(child);
        bottom.push(control);
    }
    let session = format!("three-levels-{}", std::process::id());
    let ranks: Vec<Child> = (0..8usize)
        .map(|rank| {
            let (host, port) = bottom[rank / 2].rsplit_once(':').unwrap();
            Command::new(program("netagg-allreduce"))
                .args(["--numel", "20000,77", "--jobs", "2", "--type", "int32"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "8")
                .env("NETAGG_GENERAL__CONTROLLER_IP", host)
                .env("NETAGG_GENERAL__CONTROLLER_PORT", port)
                .env("NETAGG_GENERAL__SESSION", &session)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> = ranks.into_iter().map(|rank| rank.wait_with_output().unwrap()).collect();
    for child in &mut switches {
        let _ = child.kill();
        let _ = child.wait();
    }
    for (rank, output) in outputs.iter().enumerate() {
        let all = text(output);
        assert!(output.status.success(), "rank {rank}: {all}");
        assert_eq!(all.matches("elements verified").count(), 2, "rank {rank}: {all}");
    }
}
