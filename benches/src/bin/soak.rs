//! `soak DURATION`: ranks through a switch, session after session and job after job,
//! with every fault at once on both sides, every sum checked, and the resident memory
//! of the switch and the ranks sampled over time. `scripts/soak DURATION` runs it.
//!
//! The driver starts `netagg-switch` (the one beside this program) with faults injected
//! into both directions of its data path and a metrics endpoint, and `--ranks` rank
//! processes (this program's `rank` role) with the same faults in their transports. The
//! ranks live for the whole run and open one session after another when the driver
//! writes `session N` to their stdin; each session runs `--jobs` allreduces of int32 and
//! float32, dense and sparse, in turn, and each rank checks every sum (int32 exactly,
//! float32 within the rounding bound of `netagg_benches::soak`). Every `--kill-every`th
//! session, a rank other than 0 is killed mid-session (SIGKILL) and a new process takes
//! its place: the others' jobs must fail, and the next session starts with the newcomer.
//! Rank 0 is never killed, so that its memory spans the run.
//!
//! The switch's figures come from its metrics endpoint (`--metrics`, as an operator's
//! monitoring would read them), the ranks' memory from `/proc/PID/statm`. The exit status
//! is 0 only if no sum was wrong, no session failed but those a kill ended, and neither
//! the switch's nor rank 0's memory grew more than `--max-growth` percent above the
//! plateau its warm-up reached (`netagg_benches::soak::Growth`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use netagg::{Config, Context, SparseMode};
use netagg_benches::soak::{check_float32, check_int32, job_contents, Growth, RankCounts, RankEvent};
use netagg_switch::resident_bytes;
use rustix::process::{kill_process, Pid, Signal};

#[derive(Debug, Parser)]
#[command(
    name = "soak",
    version,
    about = "Ranks through a switch with every fault at once, every sum checked"
)]
struct Options {
    #[command(subcommand)]
    role: Option<Role>,
    /// How long to run: seconds, or with a unit (90s, 15m, 1h). Sessions under way
    /// then finish.
    #[arg(value_parser = parse_run_time, default_value = "60")]
    duration: Duration,
    /// Rank processes.
    #[arg(long, default_value_t = 3)]
    ranks: u16,
    /// Kill a rank (not rank 0) in every this many sessions; 0 never does.
    #[arg(long, default_value_t = 3)]
    kill_every: u64,
    /// Seconds before memory counts as warm: growth is measured above the highest sample of
    /// the warm-up's last third. Default: a quarter of the duration, at least 30 s (the
    /// switch's allocator takes some sessions to reach its plateau: 12 to 54 s in
    /// 60-second runs, later on a loaded machine).
    #[arg(long, value_parser = parse_run_time)]
    warmup: Option<Duration>,
    /// Seconds between memory samples.
    #[arg(long, value_parser = parse_run_time, default_value = "2")]
    sample_every: Duration,
    /// The most the switch's or rank 0's resident memory may grow after warm-up, in
    /// percent, before the run fails.
    #[arg(long, default_value_t = 5.0)]
    max_growth: f64,
    #[command(flatten)]
    work: Work,
}

/// What every rank does, as the driver tells each rank process.
#[derive(Debug, Clone, Args)]
struct Work {
    /// Elements per allreduce.
    #[arg(long, default_value_t = 100_000)]
    numel: usize,
    /// Allreduces per session.
    #[arg(long, default_value_t = 40)]
    jobs: u64,
    /// Seed of the tensors (every rank the same) and of the faults (each its own).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Probability that a datagram is dropped, duplicated, held back to be overtaken, in
    /// each direction on each side (a datagram meets its sender's and its receiver's).
    #[arg(long, default_value_t = 0.005)]
    loss: f64,
    #[arg(long, default_value_t = 0.005)]
    duplicate: f64,
    #[arg(long, default_value_t = 0.005)]
    reorder: f64,
    /// Probability that a bit of a datagram is flipped, as `--loss`. Off by default, so that
    /// a run without it measures recovery from the other faults alone; the checksums drop
    /// what it flips, and loss recovery resends it.
    #[arg(long, default_value_t = 0.0)]
    corrupt: f64,
    /// Every datagram is delayed by a uniform random time up to this many milliseconds,
    /// as `--loss`.
    #[arg(long, default_value_t = 0.2)]
    delay_ms: f64,
}

impl Work {
    /// The faults, as `[faults]` keys that the switch's `--faults` and a rank's config
    /// take alike.
    fn faults(&self) -> String {
        ["send", "receive"]
            .iter()
            .map(|direction| {
                format!(
                    "{direction}_drop={},{direction}_duplicate={},{direction}_reorder={},{direction}_corrupt={},{direction}_delay={}",
                    self.loss, self.duplicate, self.reorder, self.corrupt, self.delay_ms
                )
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[derive(Debug, Subcommand)]
enum Role {
    /// One rank (the driver starts these): runs session N when its stdin says `session N`.
    Rank {
        #[arg(long)]
        control: SocketAddr,
        #[arg(long)]
        rank: u16,
        #[command(flatten)]
        work: Work,
    },
}

/// Parses `90`, `90s`, `15m` or `1h`.
fn parse_run_time(text: &str) -> Result<Duration, String> {
    let (number, unit) = match text.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((at, _)) => text.split_at(at),
        None => (text, "s"),
    };
    let scale = match unit {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("'{text}': expected seconds, or a number with s, m or h")),
    };
    let seconds = number.parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0);
    seconds.map(|s| Duration::from_secs_f64(s * scale)).ok_or(format!("'{text}': expected a positive time"))
}

fn main() -> ExitCode {
    let options = Options::parse();
    let outcome = match &options.role {
        Some(Role::Rank { control, rank, work }) => {
            run_rank(*control, *rank, options.ranks, work).map(|()| true)
        }
        None => drive(&options),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("soak: {message}");
            ExitCode::from(2)
        }
    }
}

// ---- A rank ----

/// Runs the sessions the driver names on stdin, until `exit` or the end of stdin.
fn run_rank(control: SocketAddr, rank: u16, workers: u16, work: &Work) -> Result<(), String> {
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| format!("reading the driver's commands: {e}"))?;
        let Some(session) = line.strip_prefix("session ").and_then(|n| n.parse().ok()) else { break };
        println!("{}", RankEvent::Started { session });
        let event = match run_session(control, rank, workers, work, session) {
            Ok(counts) => RankEvent::Done { session, counts },
            Err(error) => RankEvent::Lost { session, reason: error.to_string() },
        };
        println!("{event}");
    }
    Ok(())
}

fn run_session(
    control: SocketAddr,
    rank: u16,
    workers: u16,
    work: &Work,
    session: u64,
) -> Result<RankCounts, netagg::Error> {
    let mut config = Config::default();
    let general = &mut config.general;
    general.rank = rank;
    general.num_workers = workers;
    general.controller_ip = control.ip().to_string();
    general.controller_port = control.port();
    general.session = format!("soak-{session}");
    general.sparse = SparseMode::Auto;
    // Loopback round trips take microseconds: a 2 ms floor recovers a loss quickly.
    general.timeout = Duration::from_millis(2);
    general.job_timeout = Duration::from_secs(20);
    config.faults.apply_assignments("--faults", &work.faults())?;
    config.faults.seed = work.seed ^ (u64::from(rank) << 48) ^ session;
    let block_numel = usize::from(config.general.packet_numel);
    let context = Context::start(config)?;
    let jobs = (0..work.jobs).try_for_each(|job| {
        let (kind, contents) = job_contents(work.seed, session, job, block_numel);
        let wrong = if kind.float {
            let mut data: Vec<f32> = (0..work.numel).map(|i| contents.float32(rank, i)).collect();
            context.allreduce(&mut data)?;
            check_float32(&contents, workers, &data).wrong
        } else {
            let mut data: Vec<i32> = (0..work.numel).map(|i| contents.int32(rank, i)).collect();
            context.allreduce(&mut data)?;
            check_int32(&contents, workers, &data).wrong
        };
        let (kind, elements, wrong) = (kind.name.to_string(), work.numel as u64, wrong as u64);
        println!("{}", RankEvent::Job { session, job, kind, elements, wrong });
        Ok::<(), netagg::Error>(())
    });
    let total = context.stop().total();
    jobs?;
    Ok(RankCounts {
        bytes_sent: total.bytes_sent,
        bytes_received: total.bytes_received,
        retransmissions: total.retransmissions,
        timeouts: total.timeouts,
        duplicates: total.duplicates,
        stale: total.stale,
    })
}

// ---- The driver ----

/// A rank process and which of its rank's processes it is (a killed one's successor is
/// the next generation); killed and reaped when dropped, so that no error path of the
/// driver leaves it running.
struct RankProcess {
    child: Child,
    stdin: ChildStdin,
    generation: u64,
}

impl Drop for RankProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the driver hears: a line of a rank process.
struct Heard {
    rank: u16,
    generation: u64,
    line: String,
}

/// A moment's resident memory: the switch's and each rank's, in rank order.
struct Sample {
    at: Duration,
    switch: u64,
    ranks: Vec<Option<u64>>,
}

/// The run's figures.
#[derive(Default)]
struct Tally {
    sessions_done: u64,
    sessions_killed: u64,
    /// Sessions a rank failed in without a kill.
    sessions_failed: u64,
    jobs: u64,
    elements: u64,
    jobs_by_kind: HashMap<String, u64>,
    wrong_elements: u64,
    /// Results of a job on a rank with a wrong element.
    wrong_jobs: u64,
    /// Ranks' sessions that failed without a kill, and stalls.
    unexpected_failures: u64,
    /// How long the slowest survivor of a kill took to fail, over the run.
    slowest_failure_after_kill: Duration,
    counts: RankCounts,
}

/// The shortest warm-up by default.
const MIN_WARMUP: Duration = Duration::from_secs(30);

/// How long the driver waits for any rank to report before it calls the run stalled:
/// longer than a job's timeout at the ranks.
const STALL: Duration = Duration::from_secs(60);

fn drive(options: &Options) -> Result<bool, String> {
    let bin = std::env::current_exe().map_err(|e| format!("where this program is: {e}"))?;
    let switch_bin = bin.with_file_name("netagg-switch");
    let faults = options.work.faults();
    let (switch, control, metrics) =
        start_switch(&switch_bin, &format!("{faults},seed={}", options.work.seed))?;
    println!(
        "soak: {} ranks through netagg-switch (control {control}, metrics http://{metrics}/metrics) for {:?}",
        options.ranks, options.duration
    );
    println!("soak: faults on both sides, each direction: {faults}");
    println!(
        "soak: {} jobs of {} elements per session (int32 and float32, dense and sparse at 0.1); a rank killed every {} sessions",
        options.work.jobs, options.work.numel, options.kill_every
    );

    let (heard, hearing) = mpsc::channel();
    let mut ranks: Vec<RankProcess> = (0..options.ranks)
        .map(|rank| spawn_rank(&bin, control, rank, 0, options, &heard))
        .collect::<Result<_, _>>()?;
    let started = Instant::now();
    let warmup = options.warmup.unwrap_or((options.duration / 4).max(MIN_WARMUP));
    let mut samples: Vec<Sample> = Vec::new();
    let mut next_sample = started;
    let mut next_progress = started + options.duration / 10;
    let mut tally = Tally::default();
    let mut rng_state = options.work.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut session = 0u64;

    while started.elapsed() < options.duration {
        for process in &mut ranks {
            writeln!(process.stdin, "session {session}")
                .map_err(|e| format!("telling a rank to start: {e}"))?;
        }
        // The victim and the job after whose report it dies.
        let kill = (options.kill_every > 0 && options.ranks > 1 && (session + 1) % options.kill_every == 0)
            .then(|| {
                let victim = 1 + (next_random(&mut rng_state) % u64::from(options.ranks - 1)) as u16;
                let at_job =
                    options.work.jobs / 4 + next_random(&mut rng_state) % (options.work.jobs / 2).max(1);
                (victim, at_job)
            });
        let mut killed_at: Option<Instant> = None;
        let failures_before = tally.unexpected_failures;
        let mut pending: Vec<u16> = (0..options.ranks).collect();
        let mut last_heard = Instant::now();
        while !pending.is_empty() {
            if Instant::now() >= next_sample {
                samples.push(sample(started, metrics, &ranks)?);
                next_sample += options.sample_every;
            }
            if Instant::now() >= next_progress {
                progress(started, &tally, samples.last());
                next_progress += options.duration / 10;
            }
            let wait = next_sample.saturating_duration_since(Instant::now()).min(Duration::from_millis(500));
            let Ok(Heard { rank, generation, line }) = hearing.recv_timeout(wait) else {
                if last_heard.elapsed() > STALL {
                    println!("soak: STALLED: no rank reported for {STALL:?} in session {session} (waiting for ranks {pending:?})");
                    tally.unexpected_failures += 1;
                    tally.sessions_failed += 1;
                    stop(ranks, switch);
                    return Ok(report(options, &tally, &samples, warmup, None));
                }
                continue;
            };
            last_heard = Instant::now();
            if generation != ranks[usize::from(rank)].generation {
                continue; // A killed process's last words.
            }
            let event = match line.parse::<RankEvent>() {
                Ok(event) => event,
                Err(_) => {
                    println!("[rank {rank}] {line}");
                    continue;
                }
            };
            match event {
                RankEvent::Started { .. } => {}
                RankEvent::Job { session: of, job, kind, elements, wrong } => {
                    if rank == 0 {
                        tally.jobs += 1;
                        tally.elements += elements;
                        *tally.jobs_by_kind.entry(kind.clone()).or_default() += 1;
                    }
                    if wrong > 0 {
                        println!("soak: WRONG SUM: rank {rank}, session {of}, job {job} ({kind}): {wrong} of {elements} elements");
                        tally.wrong_elements += wrong;
                        tally.wrong_jobs += 1;
                    }
                    if kill == Some((rank, job)) && of == session {
                        let victim = &mut ranks[usize::from(rank)];
                        let _ = victim.child.kill();
                        let _ = victim.child.wait();
                        killed_at = Some(Instant::now());
                        pending.retain(|&r| r != rank);
                        let generation = victim.generation + 1;
                        ranks[usize::from(rank)] =
                            spawn_rank(&bin, control, rank, generation, options, &heard)?;
                    }
                }
                RankEvent::Done { counts, .. } => {
                    tally.counts = tally.counts + counts;
                    pending.retain(|&r| r != rank);
                }
                RankEvent::Lost { session: of, reason } => {
                    pending.retain(|&r| r != rank);
                    match killed_at {
                        Some(killed) => {
                            tally.slowest_failure_after_kill =
                                tally.slowest_failure_after_kill.max(killed.elapsed());
                        }
                        None => {
                            println!(
                                "soak: SESSION FAILED without a kill: rank {rank}, session {of}: {reason}"
                            );
                            tally.unexpected_failures += 1;
                        }
                    }
                }
            }
        }
        if tally.unexpected_failures > failures_before {
            tally.sessions_failed += 1;
        } else if killed_at.is_some() {
            tally.sessions_killed += 1;
        } else {
            tally.sessions_done += 1;
        }
        session += 1;
    }
    let last = scrape(metrics).ok();
    samples.push(sample(started, metrics, &ranks)?);
    stop(ranks, switch);
    Ok(report(options, &tally, &samples, warmup, last.as_ref()))
}

/// Starts the switch on loopback ports of its choosing, with `faults` and a metrics
/// endpoint; its control and metrics addresses.
fn start_switch(bin: &Path, faults: &str) -> Result<(SwitchProcess, SocketAddr, SocketAddr), String> {
    let mut child = Command::new(bin)
        .args(["--control", "127.0.0.1:0", "--data", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
        .args(["--log-level", "error", "--faults", faults])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e} (build the workspace's binaries first)", bin.display()))?;
    let mut stdout = BufReader::new(child.stdout.take().ok_or("the switch has no stdout")?);
    let mut first = String::new();
    let _ = stdout.read_line(&mut first);
    // "netagg-switch: control ADDRESS data ADDRESS metrics ADDRESS"
    let words: Vec<&str> = first.split_whitespace().collect();
    let address = |index: usize| words.get(index).and_then(|word| word.parse::<SocketAddr>().ok());
    let (Some(control), Some(metrics)) = (address(2), address(6)) else {
        let _ = child.kill();
        return Err(format!("the switch did not start (it printed '{}')", first.trim()));
    };
    // Drained, so that the switch never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    Ok((SwitchProcess(Some(child)), control, metrics))
}

/// The switch process, stopped (SIGTERM, then waited for) when dropped.
struct SwitchProcess(Option<Child>);

impl Drop for SwitchProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = kill_process(Pid::from_child(&child), Signal::TERM);
            let _ = child.wait();
        }
    }
}

fn spawn_rank(
    bin: &Path,
    control: SocketAddr,
    rank: u16,
    generation: u64,
    options: &Options,
    heard: &mpsc::Sender<Heard>,
) -> Result<RankProcess, String> {
    let work = &options.work;
    let mut child = Command::new(bin)
        .args(["--ranks", &options.ranks.to_string(), "rank", "--control", &control.to_string()])
        .args([
            "--rank",
            &rank.to_string(),
            "--numel",
            &work.numel.to_string(),
            "--jobs",
            &work.jobs.to_string(),
        ])
        .args(["--seed", &work.seed.to_string(), "--loss", &work.loss.to_string()])
        .args(["--duplicate", &work.duplicate.to_string(), "--reorder", &work.reorder.to_string()])
        .args(["--corrupt", &work.corrupt.to_string(), "--delay-ms", &work.delay_ms.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start rank {rank}: {e}"))?;
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return Err(format!("rank {rank} has no stdin or stdout"));
    };
    let heard = heard.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if heard.send(Heard { rank, generation, line }).is_err() {
                break;
            }
        }
    });
    Ok(RankProcess { child, stdin, generation })
}

/// Tells the ranks to exit and waits for them (killing any that do not within a few
/// seconds), then stops the switch.
fn stop(mut ranks: Vec<RankProcess>, switch: SwitchProcess) {
    for process in &mut ranks {
        let _ = writeln!(process.stdin, "exit");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for process in &mut ranks {
        while matches!(process.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    drop(ranks);
    drop(switch);
}

/// A small pseudo-random sequence (xorshift), for the victims and the moments of kills:
/// repeatable for a seed.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// The switch's metrics: every sample, `name{labels}` to value.
fn scrape(metrics: SocketAddr) -> Result<HashMap<String, f64>, String> {
    let fail = |e: std::io::Error| format!("scraping http://{metrics}/metrics: {e}");
    let mut stream = TcpStream::connect_timeout(&metrics, Duration::from_secs(5)).map_err(fail)?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).map_err(fail)?;
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {metrics}\r\nConnection: close\r\n\r\n").map_err(fail)?;
    let mut response = String::new();
    stream.read_to_string(&mut response).map_err(fail)?;
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    Ok(netagg_benches::soak::parse_metrics(body))
}

fn sample(started: Instant, metrics: SocketAddr, ranks: &[RankProcess]) -> Result<Sample, String> {
    let scraped = scrape(metrics)?;
    let switch = scraped.get("process_resident_memory_bytes").copied().unwrap_or_default() as u64;
    let ranks = ranks
        .iter()
        .map(|process| resident_bytes(&PathBuf::from(format!("/proc/{}", process.child.id()))).ok())
        .collect();
    Ok(Sample { at: started.elapsed(), switch, ranks })
}

fn megabytes(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

fn progress(started: Instant, tally: &Tally, last: Option<&Sample>) {
    let memory = last.map_or(String::new(), |sample| {
        let ranks: Vec<String> =
            sample.ranks.iter().map(|bytes| bytes.map_or("-".into(), megabytes)).collect();
        format!("; resident: switch {}, ranks {}", megabytes(sample.switch), ranks.join(" "))
    });
    println!(
        "soak: {:>6.0} s: {} sessions ({} with a kill), {} jobs, {} wrong{memory}",
        started.elapsed().as_secs_f64(),
        tally.sessions_done + tally.sessions_killed + tally.sessions_failed,
        tally.sessions_killed,
        tally.jobs,
        tally.wrong_jobs
    );
}

/// Prints the run's figures; whether it passed.
fn report(
    options: &Options,
    tally: &Tally,
    samples: &[Sample],
    warmup: Duration,
    metrics: Option<&HashMap<String, f64>>,
) -> bool {
    let elapsed = samples.last().map_or(Duration::ZERO, |sample| sample.at);
    println!("\nsoak: ran {:.0} s on {} ranks", elapsed.as_secs_f64(), options.ranks);
    println!(
        "sessions: {} completed, {} with a rank killed (slowest survivor failed {:.2} s after the kill), {} failed otherwise",
        tally.sessions_done,
        tally.sessions_killed,
        tally.slowest_failure_after_kill.as_secs_f64(),
        tally.sessions_failed
    );
    let mut kinds: Vec<_> = tally.jobs_by_kind.iter().collect();
    kinds.sort();
    let kinds: Vec<String> = kinds.iter().map(|(kind, jobs)| format!("{kind} {jobs}")).collect();
    println!(
        "jobs: {} ({}), {} elements, {:.2} GB of tensors reduced",
        tally.jobs,
        kinds.join(", "),
        tally.elements,
        tally.elements as f64 * 4.0 / 1e9
    );
    println!(
        "wrong sums: {} results of a job on a rank, {} elements",
        tally.wrong_jobs, tally.wrong_elements
    );
    let c = &tally.counts;
    println!(
        "ranks, sessions completed: {:.2} GB sent, {:.2} GB received; recovered by {} retransmissions after {} timeouts; {} duplicate and {} stale results ignored",
        c.bytes_sent as f64 / 1e9,
        c.bytes_received as f64 / 1e9,
        c.retransmissions,
        c.timeouts,
        c.duplicates,
        c.stale
    );
    if let Some(metrics) = metrics {
        let matching = |prefix: &str| {
            let mut found: Vec<String> = metrics
                .iter()
                .filter(|(series, _)| series.starts_with(prefix))
                .map(|(series, value)| format!("{}={value}", &series[prefix.len()..]))
                .collect();
            found.sort();
            found.join(" ")
        };
        println!("switch, faults injected: {}", matching("netagg_switch_faults_injected_total"));
        println!("switch, dropped: {}", matching("netagg_switch_dropped_total"));
        let at = |name: &str| metrics.get(name).copied().unwrap_or_default();
        println!(
            "switch: {} packets, {} results, {} resent, {} duplicate contributions answered",
            at("netagg_switch_packets_total"),
            at("netagg_switch_results_total"),
            at("netagg_switch_results_resent_total"),
            at("netagg_switch_duplicates_total")
        );
    }

    println!("resident memory (warm-up {:.0} s):", warmup.as_secs_f64());
    // About ten lines, and the last sample's.
    let step = (samples.len() / 10).max(1);
    let last = samples.len().saturating_sub(1);
    let shown = samples.iter().enumerate().filter(|&(index, _)| index % step == 0 || index == last);
    for (_, sample) in shown {
        let ranks: Vec<String> =
            sample.ranks.iter().map(|bytes| bytes.map_or("-".into(), megabytes)).collect();
        println!(
            "  {:>6.0} s: switch {}, ranks {}",
            sample.at.as_secs_f64(),
            megabytes(sample.switch),
            ranks.join(" ")
        );
    }
    let series = |pick: &dyn Fn(&Sample) -> Option<u64>| -> Vec<(Duration, u64)> {
        samples.iter().filter_map(|sample| Some((sample.at, pick(sample)?))).collect()
    };
    let mut passed = tally.wrong_jobs == 0 && tally.unexpected_failures == 0;
    let growths = [
        ("switch", Growth::of(&series(&|s| Some(s.switch)), warmup)),
        ("rank 0", Growth::of(&series(&|s| s.ranks.first().copied().flatten()), warmup)),
    ];
    for (who, growth) in growths {
        match growth {
            Some(growth) => {
                let within = growth.percent() <= options.max_growth;
                passed &= within;
                println!(
                    "  {who}: {} at the warm-up's plateau, {} at the end ({:+.1} %, bound {} %{}), peak {}",
                    megabytes(growth.warm),
                    megabytes(growth.last),
                    growth.percent(),
                    options.max_growth,
                    if within { "" } else { ": EXCEEDED" },
                    megabytes(growth.peak)
                );
            }
            None => println!("  {who}: too few samples after warm-up to measure growth"),
        }
    }
    println!("soak: {}", if passed { "PASSED" } else { "FAILED" });
    passed
}
