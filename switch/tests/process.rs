//! The `netagg-switch` process: configuration, start-up line, clean shutdown.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SWITCH: &str = env!("CARGO_BIN_EXE_netagg-switch");

fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("netagg-switch-test-{}-{name}", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn config_errors_name_the_file_and_the_key() {
    let path = temp_file("bad.cfg", "[switch]\nmax_sesions = 4\n");
    let output = Command::new(SWITCH).arg("--config").arg(&path).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("{}: unknown key 'switch.max_sesions'; known keys:", path.display())),
        "{stderr}"
    );
    let path = temp_file("value.cfg", "[switch]\ncontrol = localhost\n");
    let output = Command::new(SWITCH).arg("--config").arg(&path).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("key 'switch.control' = 'localhost': expected an address IP:PORT"), "{stderr}");
    let output = Command::new(SWITCH).args(["--idle-timeout", "-1"]).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn flags_override_the_file_and_sigterm_stops_cleanly_with_counters() {
    // The file's control port is taken; the flag's free one must win.
    let path =
        temp_file("good.cfg", "[switch]\ncontrol = 127.0.0.1:1\ndata = 127.0.0.1:0\nstats_interval = 0.1\n");
    let mut child = Command::new(SWITCH)
        .arg("--config")
        .arg(&path)
        .args(["--control", "127.0.0.1:0", "--log-level", "warn"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(
        first.starts_with("netagg-switch: control 127.0.0.1:") && !first.contains("127.0.0.1:1 "),
        "{first}"
    );
    let mut stats = String::new();
    stdout.read_line(&mut stats).unwrap();
    assert!(stats.starts_with("stats: datagrams 0 corrupt 0 malformed 0"), "periodic stats line: {stats}");

    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the switch did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(rest.lines().last().is_some_and(|l| l.starts_with("stats: datagrams")), "final counters: {rest}");
}

#[test]
fn a_registration_in_another_protocol_version_is_refused_with_a_reason() {
    let mut child = Command::new(SWITCH)
        .args(["--control", "127.0.0.1:0", "--data", "127.0.0.1:0", "--log-level", "error"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    let control = first.split_whitespace().nth(2).unwrap().to_string();
    let mut stream = std::net::TcpStream::connect(&control).unwrap();
    // A control header of version 9, with an empty body.
    stream.write_all(&[9, 1, 0, 0, 5, 0, 0, 0]).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let (_, reply) = netagg_wire::ControlMessage::read_from(&mut stream).unwrap();
    assert_eq!(
        reply,
        netagg_wire::ControlMessage::Reject {
            code: netagg_wire::RejectCode::Version,
            message: format!(
                "protocol version 9 is not supported (this side speaks {})",
                netagg_wire::CONTROL_VERSION
            )
        }
    );
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn bad_fault_flags_and_memory_limits_name_the_flag_the_key_and_what_is_allowed() {
    let run = |args: &[&str]| {
        let output = Command::new(SWITCH).args(args).output().unwrap();
        (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
    };
    assert_eq!(
        run(&["--faults", "receive_drop=0.5,send_drop=1.5"]),
        (
            Some(2),
            "netagg-switch: flag --faults: key 'send_drop' = '1.5': expected a probability from 0 to 1\n"
                .into()
        )
    );
    let (code, stderr) = run(&["--faults", "loss=0.1"]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.starts_with("netagg-switch: flag --faults: unknown key 'loss'; known keys: send_drop, "),
        "{stderr}"
    );
    let path = temp_file("faults.cfg", "[switch.faults]\nreceive_delay = 20000\n");
    let (code, stderr) = run(&["--config", path.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert!(
        stderr
            .contains("key 'switch.faults.receive_delay' = '20000': expected milliseconds, from 0 to 10000"),
        "{stderr}"
    );
    let (code, stderr) = run(&["--max-session-memory", "-1"]);
    assert_eq!(code, Some(2), "{stderr}");
}

#[test]
fn flags_are_checked_by_the_rules_of_the_file() {
    let run = |args: &[&str]| {
        let output = Command::new(SWITCH).args(args).output().unwrap();
        (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
    };
    // Refused in the file, so refused as a flag: a switch with no session allowed would
    // refuse every one.
    let path = temp_file("zero.cfg", "[switch]\nmax_sessions = 0\n");
    let (code, from_file) = run(&["--config", path.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert!(from_file.ends_with("key 'switch.max_sessions' = '0': expected an integer from 1 to 65535\n"));
    for flag in ["--max-sessions", "--max-workers", "--max-slots", "--max-connections"] {
        let (code, stderr) = run(&[flag, "0"]);
        assert_eq!(code, Some(2), "{stderr}");
        let key = flag.trim_start_matches("--").replace('-', "_");
        assert!(
            stderr.starts_with(&format!("netagg-switch: flag {flag}: key 'switch.{key}' = '0': expected ")),
            "{stderr}"
        );
    }
    for flag in ["--max-memory", "--max-session-memory"] {
        assert_eq!(run(&[flag, "0"]).0, Some(2), "{flag} 0");
    }
    assert_eq!(
        run(&["--log-level", "loud"]),
        (
            Some(2),
            "netagg-switch: flag --log-level: key 'switch.log_level' = 'loud': expected error, warn, info, \
             debug or trace\n"
                .into()
        )
    );
}

/// Seconds of CPU the process has used, from /proc.
/// A rack's switch on RDMA is refused by the config's rules, naming the flags that asked
/// for it, before any device is touched.
#[test]
fn a_rack_switch_on_rdma_is_refused_by_name() {
    let output = Command::new(SWITCH)
        .args(["--transport", "rdma", "--upstream", "10.0.0.1:50099", "--racks", "2"])
        .output()
        .unwrap();
    assert_eq!(
        (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned()),
        (
            Some(2),
            "netagg-switch: switch.upstream 10.0.0.1:50099 (from flag --upstream) needs switch.transport \
             udp or dpdk, not switch.transport rdma (from flag --transport): the rdma data path only \
             accepts connections, so it cannot send to the upper switch\n"
                .into()
        )
    );
}

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // utime and stime, the 14th and 15th fields, count after the command's ')'.
    let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

#[test]
fn a_flood_of_connections_under_a_small_descriptor_limit_neither_spins_nor_floods_the_log() {
    // 100 descriptors at most, soft and hard: the switch fits its connections to them.
    let mut child = Command::new("prlimit")
        .args(["--nofile=100:100", SWITCH, "--control", "127.0.0.1:0", "--data", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("prlimit (util-linux) runs the switch");
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    let control = first.split_whitespace().nth(2).unwrap().to_string();
    // Far more idle connections than descriptors, kept open.
    let flood: Vec<_> = (0..300).filter_map(|_| std::net::TcpStream::connect(&control).ok()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let before = cpu_seconds(child.id());
    std::thread::sleep(Duration::from_secs(2));
    let spent = cpu_seconds(child.id()) - before;
    assert!(spent < 0.2, "the switch used {spent} s of CPU in 2 s while flooded");
    // Room for a legitimate worker once some of the flood leaves.
    drop(flood);
    std::thread::sleep(Duration::from_millis(300));
    let mut worker = std::net::TcpStream::connect(&control).unwrap();
    worker.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let register = netagg_wire::ControlMessage::Register {
        rank: 0,
        world_size: 1,
        packet_elements: 4,
        slots: 1,
        depth: 2,
        encoding: netagg_wire::ValueEncoding::Native,
        sparse_blocks: false,
        name: "after-the-flood".into(),
        endpoints: vec![netagg_wire::Endpoint::Udp("0.0.0.0:9".parse().unwrap())],
    };
    register.write_to(1, &mut worker).unwrap();
    let (_, reply) = netagg_wire::ControlMessage::read_from(&mut worker).unwrap();
    assert!(matches!(reply, netagg_wire::ControlMessage::Accept { .. }), "{reply:?}");
    let _ = child.kill();
    let _ = child.wait();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(stderr.lines().count() < 20, "{} log lines:\n{stderr}", stderr.lines().count());
    assert!(stderr.contains("max_connections lowered"), "{stderr}");
}

#[test]
fn a_log_into_a_file_is_plain_text_one_line_per_event() {
    let log_path = temp_file("switch.log", "");
    let mut child = Command::new(SWITCH)
        .args(["--control", "127.0.0.1:0", "--data", "127.0.0.1:0", "--log-level", "info"])
        .args(["--faults", "receive_drop=0.01"])
        .env_remove("NO_COLOR")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(child.wait().unwrap().success());
    let mut counters = String::new();
    stdout.read_to_string(&mut counters).unwrap();
    assert!(counters.lines().any(|l| l.starts_with("stats: faults injected:")), "{counters}");

    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(!log.contains("\x1b["), "coloured although written to a file:\n{log}");
    for wanted in
        [" WARN netagg_switch: injecting faults into the data path", " INFO netagg_switch: switch ready"]
    {
        assert_eq!(log.lines().filter(|l| l.contains(wanted)).count(), 1, "'{wanted}' in:\n{log}");
    }
    // Every line is an event: its timestamp, then its level.
    let is_event = |line: &str| {
        line.split_whitespace().nth(1).is_some_and(|level| ["ERROR", "WARN", "INFO"].contains(&level))
    };
    assert!(log.lines().all(is_event), "a line that is not an event in:\n{log}");
}

#[test]
fn metrics_flag_serves_the_counters_and_its_address_ends_the_first_line() {
    let output = Command::new(SWITCH).args(["--metrics", "somewhere"]).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("key 'switch.metrics' = 'somewhere': expected an address IP:PORT, or nothing"),
        "{stderr}"
    );

    let mut child = Command::new(SWITCH)
        .args(["--control", "127.0.0.1:0", "--data", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
        .args(["--log-level", "error"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    // "netagg-switch: control ADDRESS data ADDRESS metrics ADDRESS"
    let words: Vec<&str> = first.split_whitespace().collect();
    assert_eq!((words.len(), words[5]), (7, "metrics"), "{first}");
    let mut stream = std::net::TcpStream::connect(words[6]).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(response.contains("\r\nContent-Type: application/openmetrics-text; version=1.0.0"), "{response}");
    assert!(response.contains("\nnetagg_switch_sessions{state=\"open\"} 0\n"), "{response}");
}
