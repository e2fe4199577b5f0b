//! Processes for the fault tests: a `netagg-switch` that can be killed, frozen, stopped
//! for its counters and restarted on its ports, and `netagg-allreduce` workers whose
//! output lines arrive as they are printed.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use netagg::Config;

/// A program of the workspace, from the target directory of this test's own build (so
/// a release test runs release binaries).
pub fn binary(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_BIN_EXE_netagg-allreduce")).with_file_name(name);
    assert!(path.is_file(), "{} is missing: build the workspace's binaries first", path.display());
    path
}

pub fn unique_session(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Sends a signal by name (`KILL`, `STOP`, `CONT`, `TERM`) to a process.
pub fn signal(child: &Child, name: &str) {
    let status = Command::new("kill").args([format!("-{name}"), child.id().to_string()]).status().unwrap();
    assert!(status.success(), "kill -{name} {}", child.id());
}

/// Stops a process (`SIGSTOP`) and waits until every one of its threads has stopped:
/// `kill` returns once the signal is sent, and a busy machine may run a thread a while
/// longer, so a switch could still answer packets sent right after.
pub fn freeze(child: &Child) {
    signal(child, "STOP");
    let tasks = PathBuf::from(format!("/proc/{}/task", child.id()));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // The state follows the command name's closing parenthesis: `T` once stopped.
        let stopped = std::fs::read_dir(&tasks).unwrap().all(|task| {
            let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
            stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
        });
        if stopped {
            return;
        }
        assert!(Instant::now() < deadline, "process {} did not stop", child.id());
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A switch process on loopback, killed on drop.
pub struct Switch {
    pub child: Child,
    stdout: BufReader<ChildStdout>,
    pub control: SocketAddr,
    pub data: SocketAddr,
}

impl Switch {
    /// Starts a switch on free loopback ports.
    pub fn start(extra: &[&str]) -> Switch {
        Switch::start_at("127.0.0.1:0".parse().unwrap(), "127.0.0.1:0".parse().unwrap(), extra)
    }

    /// Starts a switch on the given addresses (those of a dead one, to restart it).
    pub fn start_at(control: SocketAddr, data: SocketAddr, extra: &[&str]) -> Switch {
        let mut child = Command::new(binary("netagg-switch"))
            .args(["--control", &control.to_string(), "--data", &data.to_string(), "--log-level", "error"])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("netagg-switch starts");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        // "netagg-switch: control 127.0.0.1:PORT data 127.0.0.1:PORT"
        let words: Vec<&str> = line.split_whitespace().collect();
        let address = |i: usize| -> SocketAddr {
            words.get(i).and_then(|w| w.parse().ok()).unwrap_or_else(|| panic!("first line '{line}'"))
        };
        let (control, data) = (address(2), address(4));
        Switch { child, stdout, control, data }
    }

    /// A library configuration for rank `rank` of `workers` at this switch.
    pub fn config(&self, rank: u16, workers: u16, session: &str) -> Config {
        let mut config = Config::default();
        config.general.rank = rank;
        config.general.num_workers = workers;
        config.general.controller_port = self.control.port();
        config.general.session = session.to_string();
        config.general.connect_timeout = Duration::from_secs(20);
        config
    }

    /// Reads the switch's output until a line satisfies `wanted` (with
    /// `--stats-interval`, its counters come every interval); panics after `within`.
    pub fn wait_for_line(&mut self, within: Duration, wanted: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + within;
        let mut line = String::new();
        while Instant::now() < deadline {
            line.clear();
            if self.stdout.read_line(&mut line).unwrap() == 0 {
                break;
            }
            if wanted(&line) {
                return line;
            }
        }
        panic!("the switch printed no such line within {within:?}");
    }

    /// Stops the switch with SIGTERM and returns what it printed (its final counters).
    pub fn stop(mut self) -> String {
        signal(&self.child, "TERM");
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stdout, &mut rest).unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "switch exit {status}:\n{rest}");
        rest
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `netagg-allreduce` process whose stdout lines come through a channel.
pub struct Worker {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
    pub output: Vec<String>,
}

impl Worker {
    /// Starts rank `rank` of `workers` in session `session` at `switch`, with extra
    /// configuration variables and `netagg-allreduce` arguments.
    pub fn start(
        switch: &Switch,
        rank: u16,
        workers: u16,
        session: &str,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> Worker {
        let mut child = Command::new(binary("netagg-allreduce"))
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", workers.to_string())
            .env("NETAGG_GENERAL__CONTROLLER_PORT", switch.control.port().to_string())
            .env("NETAGG_GENERAL__SESSION", session)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("netagg-allreduce starts");
        let (sender, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Worker { child, lines, output: Vec::new() }
    }

    /// Waits until a line containing `text` is printed; false if the time runs out.
    pub fn wait_for_line(&mut self, text: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while let Ok(line) = self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            let found = line.contains(text);
            self.output.push(line);
            if found {
                return true;
            }
        }
        false
    }

    /// Waits for the process to end within `within`; returns whether it succeeded, its
    /// stdout and its stderr. Panics (after killing it) if it does not end in time.
    pub fn finish(mut self, within: Duration) -> (bool, String, String) {
        let deadline = Instant::now() + within;
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("worker still running after {within:?}:\n{}", self.output.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let output = self.child.wait_with_output().unwrap();
        self.output.extend(self.lines.try_iter());
        // The reader thread may still hold the last lines for a moment.
        while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
            self.output.push(line);
        }
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (output.status.success(), self.output.join("\n"), stderr)
    }
}

/// Runs `workers` ranks to completion; every one must verify every one of `jobs` jobs.
/// Returns each rank's stdout.
pub fn run_verified(
    switch: &Switch,
    workers: u16,
    jobs: usize,
    env: &[(&str, &str)],
    args: &[&str],
    within: Duration,
) -> Vec<String> {
    let session = unique_session("run");
    let started: Vec<Worker> =
        (0..workers).map(|rank| Worker::start(switch, rank, workers, &session, env, args)).collect();
    started
        .into_iter()
        .enumerate()
        .map(|(rank, worker)| {
            let (success, stdout, stderr) = worker.finish(within);
            assert!(success, "rank {rank} failed ({args:?} {env:?}):\n{stdout}\n{stderr}");
            assert_eq!(stdout.matches("elements verified").count(), jobs, "rank {rank}:\n{stdout}");
            assert!(!stdout.contains("WRONG"), "rank {rank}:\n{stdout}");
            stdout
        })
        .collect()
}
