//! `netagg-run`: a switch and N ranks, prefixed output, the first failure's exit code.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

mod common;

use common::{launcher, launcher_path, program};

/// `netagg-allreduce` from the client package.
fn allreduce() -> PathBuf {
    program("netagg-allreduce")
}

#[test]
fn runs_a_switch_and_every_rank_with_prefixed_output() {
    let output = launcher()
        .args(["-n", "3", "--"])
        .arg(allreduce())
        .args(["--numel", "1000,77", "--jobs", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    for rank in 0..3 {
        for (job, numel) in [(0, 1000), (1, 77)] {
            let line = format!("[{rank}] rank {rank}: job {job}: {numel} elements verified");
            assert!(stdout.contains(&line), "missing '{line}' in:\n{stdout}");
        }
    }
    assert!(stdout.contains("[switch] stats: datagrams"), "the switch's final counters:\n{stdout}");
}

#[test]
fn runs_several_switches_and_gives_every_rank_their_list() {
    let output = launcher()
        .args(["-n", "3", "--switches", "2", "--"])
        .arg(allreduce())
        .args(["--numel", "1000,77", "--jobs", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    for rank in 0..3 {
        let line = format!("[{rank}] rank {rank}: job 1: 77 elements verified");
        assert!(stdout.contains(&line), "missing '{line}' in:\n{stdout}");
    }
    // Both switches summed: each printed its final counters, with sessions in them.
    for switch in ["[switch 0] stats: datagrams", "[switch 1] stats: datagrams"] {
        assert!(stdout.contains(switch), "missing '{switch}' in:\n{stdout}");
    }
    let listed = launcher()
        .args(["-n", "1", "--switches", "3", "--", "sh", "-c"])
        .arg("echo $NETAGG_GENERAL__SWITCHES")
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    let list = listed.lines().find_map(|line| line.strip_prefix("[0] ")).expect("rank 0's line");
    assert_eq!(list.split(',').filter(|address| address.starts_with("127.0.0.1:")).count(), 3, "{listed}");
    for (args, expected) in [
        (&["--switches", "0"][..], "--switches takes a number of switches from 1 to 53"),
        (&["--colocated"][..], "--colocated puts a switch in each worker's namespace of an emulated network"),
        (&["--switches", "2", "--switch", "h:1"][..], "--switch names one running switch"),
    ] {
        let output = launcher().args(["-n", "2"]).args(args).args(["--", "true"]).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

#[test]
fn sets_the_rank_variables_of_netagg_and_of_pytorch() {
    let output = launcher()
        .args(["-n", "2", "--", "sh", "-c"])
        .arg("echo $RANK/$WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT $NETAGG_GENERAL__SESSION")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    let lines: Vec<Vec<&str>> = (0..2)
        .map(|rank| {
            let prefix = format!("[{rank}] ");
            let line = stdout.lines().find_map(|line| line.strip_prefix(&prefix)).expect("a line per rank");
            line.split(' ').collect()
        })
        .collect();
    for (rank, fields) in lines.iter().enumerate() {
        assert_eq!(fields[..2], [format!("{rank}/2"), format!("{rank}/2")], "{stdout}");
        let port = fields[2].strip_prefix("127.0.0.1:").and_then(|port| port.parse::<u16>().ok());
        assert!(port.is_some_and(|port| port > 0), "MASTER_ADDR:MASTER_PORT in {stdout}");
    }
    // One rendezvous and one session for both ranks.
    assert_eq!(lines[0][2..], lines[1][2..], "{stdout}");
    assert!(lines[0][3].starts_with("netagg-run-"), "{stdout}");
}

#[test]
fn exits_with_the_first_failure_and_stops_the_other_ranks() {
    let started = Instant::now();
    let status = launcher()
        .args(["-n", "2", "--", "sh", "-c", r#"if [ "$RANK" = 1 ]; then exit 7; fi; sleep 60"#])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(7));
    assert!(started.elapsed() < Duration::from_secs(20), "rank 0 was not stopped: {:?}", started.elapsed());
    let usage = launcher().args(["-n", "0", "--", "true"]).output().unwrap();
    assert_eq!(usage.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&usage.stderr).contains("-n takes a number of workers from 1 to 65535"));
}

/// 4 KiB packets over a link whose MTU is 1500: the datagrams must be fragmented, not
/// refused. Runs in a network namespace of its own (root, as on CI).
#[test]
fn packets_larger_than_the_mtu_are_fragmented() {
    let script = format!(
        "ip link set lo up && ip link set lo mtu 1500 && NETAGG_GENERAL__PACKET_NUMEL=1024 {} -n 2 -- {} --numel 100000 --jobs 2",
        launcher_path(),
        allreduce().display()
    );
    let output = Command::new("unshare").args(["--net", "sh", "-c", &script]).output().expect("unshare runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(stdout.matches("elements verified").count(), 4, "{stdout}");
}
