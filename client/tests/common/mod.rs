//! What the client's integration tests share: the target directory and builds of the
//! library for C and C++ programs; a `netagg-switch` process that can be killed, frozen,
//! stopped for its counters and restarted on its ports; `netagg-allreduce` workers whose
//! output lines arrive as they are printed; and contexts of one session started at once.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use netagg::{BackendKind, Config, Context, Error};

/// `target/<profile>`, where cargo put libnetagg.so and the binaries.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test>-<hash>
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// Whether these tests were built with `--release`.
pub fn is_release() -> bool {
    target_dir().file_name().is_some_and(|profile| profile == "release")
}

/// Runs `command` and returns its stdout and stderr; fails the test, showing both, if it
/// did not succeed.
pub fn run(command: &mut Command) -> (String, String) {
    let output = command.output().unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{command:?}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}", output.status);
    (stdout, stderr)
}

/// Runs `cargo build` of this package with `args`, in the profile of these tests.
pub fn cargo_build(args: &[&str]) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    command.args(["build", "--quiet", "-p", "netagg"]).args(args);
    if is_release() {
        command.arg("--release");
    }
    run(command.current_dir(crate_dir()));
}

/// Builds libnetagg.so and .a as they are now: `cargo test` builds only the rlib its tests
/// link, so without this a C program would link a stale library.
pub fn build_c_library() {
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| {
        cargo_build(&["--lib"]);
        // Programs linked against libnetagg.so load it by its soname, as from an
        // installed tree: the link lets them run from the target directory.
        let library = target_dir().join("libnetagg.so");
        let soname = soname(&library);
        let link = target_dir().join(&soname);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("libnetagg.so", &link).unwrap();
    });
}

/// The soname a shared library was linked with (`objdump -p`, as scripts/install reads it).
pub fn soname(library: &Path) -> String {
    let output = Command::new("objdump").arg("-p").arg(library).output().expect("objdump runs");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| line.trim().strip_prefix("SONAME").map(|name| name.trim().to_string()))
        .unwrap_or_else(|| panic!("{} has no soname", library.display()))
}

pub fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh directory of this test's own, removed with everything in it when dropped: an
/// installed prefix and its builds come to hundreds of megabytes a run.
pub fn scratch_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("netagg-{name}-")).tempdir().unwrap()
}

/// Compiles C sources (relative to the crate) against include/ and libnetagg.so with
/// every warning an error and the sanitizers on; returns the program.
pub fn compile_c(work: &Path, name: &str, sources: &[&str]) -> PathBuf {
    compile("cc", &["-std=c11"], work, name, sources)
}

/// As [`compile_c`], for C++.
pub fn compile_cpp(work: &Path, name: &str, sources: &[&str]) -> PathBuf {
    compile("c++", &["-std=c++17"], work, name, sources)
}

fn compile(compiler: &str, standard: &[&str], work: &Path, name: &str, sources: &[&str]) -> PathBuf {
    build_c_library();
    let program = work.join(name);
    let lib = target_dir();
    let output = Command::new(compiler)
        .args(standard)
        .args(["-Wall", "-Wextra", "-Werror", "-pedantic", "-g", "-pthread"])
        .args(["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"])
        .arg("-I")
        .arg(crate_dir().join("include"))
        .args(sources.iter().map(|s| crate_dir().join(s)))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lnetagg", "-lm", "-o"])
        .arg(&program)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {compiler}: {e}"));
    assert!(
        output.status.success(),
        "{compiler} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    program
}

/// A program of the workspace, from the target directory of this test's own build (so
/// a release test runs release binaries).
pub fn binary(name: &str) -> PathBuf {
    let path = target_dir().join(name);
    assert!(
        path.is_file(),
        "{} is missing: build the workspace's binaries (cargo build --workspace --bins)",
        path.display()
    );
    path
}

/// A session name no other test uses: `prefix`, this process's id and a count.
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
        let mut command = Command::new(binary("netagg-switch"));
        command.args([
            "--control",
            &control.to_string(),
            "--data",
            &data.to_string(),
            "--log-level",
            "error",
        ]);
        Switch::spawn(command.args(extra))
    }

    /// Starts a switch on free loopback ports that logs at `level` into the file `log`,
    /// with `NO_COLOR` unset.
    pub fn start_logging(level: &str, log: &Path) -> Switch {
        let log = std::fs::File::create(log).unwrap();
        Switch::spawn(
            Command::new(binary("netagg-switch"))
                .args(["--control", "127.0.0.1:0", "--data", "127.0.0.1:0", "--log-level", level])
                .env_remove("NO_COLOR")
                .env_remove("RUST_LOG")
                .stderr(log),
        )
    }

    fn spawn(command: &mut Command) -> Switch {
        let mut child = command.stdout(Stdio::piped()).spawn().expect("netagg-switch starts");
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
        worker_config(self.control, rank, workers, session)
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

/// Runs `workers` ranks of `netagg-allreduce` with `args` and the configuration
/// variables `env` to completion; every one must verify every job (`--jobs`, 3 unless
/// given) within `within`. Returns each rank's stdout.
pub fn run_verified(
    switch: &Switch,
    workers: u16,
    env: &[(&str, &str)],
    args: &[&str],
    within: Duration,
) -> Vec<String> {
    let jobs = args.iter().position(|a| *a == "--jobs").map_or(3, |i| args[i + 1].parse::<usize>().unwrap());
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

/// The number after `label` in a line of counters (the switch's or a worker's).
pub fn counter(text: &str, label: &str) -> u64 {
    let Some((_, after)) = text.split_once(&format!("{label} ")) else { panic!("no '{label}' in:\n{text}") };
    after.split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

/// A configuration of `workers` ranks on the dummy backend, as fast as the CPU allows.
/// A library configuration for rank `rank` of `workers` at the switch whose control
/// address is `control`.
pub fn worker_config(control: SocketAddr, rank: u16, workers: u16, session: &str) -> Config {
    let mut config = Config::default();
    config.general.rank = rank;
    config.general.num_workers = workers;
    config.general.controller_ip = control.ip().to_string();
    config.general.controller_port = control.port();
    config.general.session = session.to_string();
    config.general.connect_timeout = Duration::from_secs(20);
    config
}

pub fn dummy_config(workers: u16) -> Config {
    let mut config = Config::default();
    config.general.backend = BackendKind::Dummy;
    config.general.num_workers = workers;
    config.dummy.bandwidth = 0.0;
    config
}

/// Starts `workers` contexts of a new session at `switch` (each waits for all); returns
/// each rank's outcome.
pub fn start_contexts(
    switch: &Switch,
    workers: u16,
    change: impl Fn(&mut Config),
) -> Vec<Result<Context, Error>> {
    let session = unique_session("lib");
    std::thread::scope(|scope| {
        let starts: Vec<_> = (0..workers)
            .map(|rank| {
                let mut config = switch.config(rank, workers, &session);
                change(&mut config);
                scope.spawn(move || Context::start(config))
            })
            .collect();
        starts.into_iter().map(|s| s.join().unwrap()).collect()
    })
}

/// [`start_contexts`], every one of which must start.
pub fn contexts(switch: &Switch, workers: u16, change: impl Fn(&mut Config)) -> Vec<Context> {
    start_contexts(switch, workers, change).into_iter().map(Result::unwrap).collect()
}

/// Runs one allreduce on every context at once; returns each rank's outcome, and checks
/// the sums of those that succeeded: rank `r` contributes `r + 1` times each index.
pub fn allreduce_all(contexts: &[Context], numel: usize) -> Vec<Result<(), Error>> {
    let ranks = contexts.len() as i32;
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..)
            .zip(contexts)
            .map(|(rank, context)| {
                scope.spawn(move || {
                    let mut data: Vec<i32> = (0..numel as i32).map(|i| i.wrapping_mul(rank + 1)).collect();
                    context.allreduce(&mut data)?;
                    let factor = ranks * (ranks + 1) / 2;
                    let wrong =
                        (0..numel as i32).zip(&data).filter(|(i, v)| i.wrapping_mul(factor) != **v).count();
                    assert_eq!(wrong, 0, "rank {rank}: {wrong} of {numel} sums wrong");
                    Ok(())
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    })
}
