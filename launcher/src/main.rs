//! `netagg-run`: starts a switch and N local worker processes of one session, on
//! loopback or on an emulated network.
//!
//! `netagg-run -n 4 [--switch HOST:PORT] [--switch-arg ARG]... -- PROGRAM ARGS...`
//!
//! Without `--switch` it starts `netagg-switch` (found beside this program, else on the
//! PATH) on free loopback ports. Each worker gets `RANK`/`WORLD_SIZE`, the switch's
//! control address and a session name of its own, so any netagg program runs unchanged;
//! and, as torchrun sets them, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT` (a free loopback port), so that a PyTorch program's process group
//! (`init_process_group` from the environment) forms beside netagg's session.
//! Output lines are prefixed with the rank. The exit code is that of the first worker
//! to fail (the others are then stopped), 130 after Ctrl-C, or 0.
//!
//! With `--racks R` it starts an aggregation tree instead: one upper switch, and R lower
//! switches that each serve a rack of contiguous ranks and take part in the upper
//! switch's session as one member; each rank registers at its rack's switch.
//!
//! With `--link`, `--rank-link` or `--topology`, the switch and every worker run in
//! network namespaces of their own behind shaped links (see [`emulated`]); `--mpi`
//! then runs the program with `mpirun`, one rank per worker namespace, over the same
//! links.

#![deny(unsafe_code)]

mod emulated;

use netagg_emulate::fabric::ImpairerChoice;
use netagg_emulate::link::{parse_rank_settings, LinkSettings};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

struct Options {
    workers: u16,
    switch: Option<String>,
    switch_args: Vec<String>,
    /// Racks of an aggregation tree, each behind a lower switch of its own; 0 for none.
    racks: u16,
    program: Vec<String>,
    /// The emulated network, if any of these is given.
    topology: Option<PathBuf>,
    link: Option<LinkSettings>,
    rank_links: Vec<(u32, LinkSettings)>,
    impairer: ImpairerChoice,
    mpi: bool,
    /// Which side's data leaves from DPDK ports on the emulated network.
    dpdk: DpdkSides,
}

/// Which processes of an emulated network run their data path on DPDK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct DpdkSides {
    workers: bool,
    switch: bool,
}

impl std::str::FromStr for DpdkSides {
    type Err = String;
    fn from_str(text: &str) -> Result<DpdkSides, String> {
        match text {
            "workers" => Ok(DpdkSides { workers: true, switch: false }),
            "switch" => Ok(DpdkSides { workers: false, switch: true }),
            "both" => Ok(DpdkSides { workers: true, switch: true }),
            _ => Err(format!("--dpdk '{text}': expected workers, switch or both")),
        }
    }
}

impl Options {
    fn emulated(&self) -> bool {
        self.topology.is_some() || self.link.is_some() || !self.rank_links.is_empty()
    }
}

const USAGE: &str =
    "usage: netagg-run -n N [--switch HOST:PORT] [--racks R] [--switch-arg ARG]... -- PROGRAM [ARGS...]
   or: netagg-run -n N [--link SETTINGS] [--rank-link RANK:SETTINGS]... [--topology FILE]
                  [--impairer auto|netem|user-space] [--mpi] [--dpdk workers|switch|both]
                  [--switch-arg ARG]... -- PROGRAM [ARGS...]

  an emulated network (root): the switch and each worker in a network namespace of its own,
  each worker's link shaped both ways. SETTINGS: rate=200mbit,delay=5ms,jitter=1ms,loss=1%,
  queue=100ms,burst=64kb (any of them); --rank-link 3:rate=20mbit overrides rank 3's link;
  --topology FILE gives the same as [link] and [rank.N] sections (the options win).
  --impairer: what makes delay, jitter and loss (auto: netem where the kernel has it, else a
  user-space delay line). --mpi: run PROGRAM with mpirun, one rank per worker namespace, and
  no switch. --dpdk: the workers' data, the switch's, or both, leave from DPDK ports (DPDK's
  af_packet driver on each namespace's interface) instead of kernel sockets; NETAGG_* variables
  set beforehand win.
  --racks R: an aggregation tree on loopback: an upper switch and R lower switches, rack r
  holding ranks ceil(r·N/R) to ceil((r+1)·N/R) − 1; --switch-arg goes to every switch.";

fn parse(args: &[String]) -> Result<Options, String> {
    let mut options = Options {
        workers: 0,
        switch: None,
        switch_args: Vec::new(),
        racks: 0,
        program: Vec::new(),
        topology: None,
        link: None,
        rank_links: Vec::new(),
        impairer: ImpairerChoice::Auto,
        mpi: false,
        dpdk: DpdkSides::default(),
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().cloned().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "-n" | "--workers" => {
                options.workers = value("-n")?
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or("-n takes a number of workers from 1 to 65535")?
            }
            "--switch" => options.switch = Some(value("--switch")?),
            "--switch-arg" => options.switch_args.push(value("--switch-arg")?),
            "--racks" => {
                options.racks = value("--racks")?
                    .parse()
                    .ok()
                    .filter(|&racks| racks > 0)
                    .ok_or("--racks takes a number of racks from 1 to 65535")?
            }
            "--link" => {
                let settings = LinkSettings::parse(&value("--link")?).map_err(|e| format!("--link: {e}"))?;
                options.link = Some(settings.over(&options.link.unwrap_or_default()));
            }
            "--rank-link" => options
                .rank_links
                .push(parse_rank_settings(&value("--rank-link")?).map_err(|e| format!("--rank-link: {e}"))?),
            "--topology" => options.topology = Some(value("--topology")?.into()),
            "--impairer" => {
                options.impairer = value("--impairer")?.parse().map_err(|e| format!("--impairer: {e}"))?
            }
            "--mpi" => options.mpi = true,
            "--dpdk" => options.dpdk = value("--dpdk")?.parse()?,
            "--" => {
                options.program = args.cloned().collect();
                break;
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown option {other}\n{USAGE}")),
        }
    }
    if options.workers == 0 || options.program.is_empty() {
        return Err(USAGE.into());
    }
    if options.emulated() && options.switch.is_some() {
        return Err("--switch: on an emulated network the switch runs in a namespace of its own; \
                    drop --switch or the link options"
            .into());
    }
    if options.racks > 0 && (options.emulated() || options.switch.is_some()) {
        return Err(
            "--racks starts the switches of a tree on loopback: drop --switch and the link options".into()
        );
    }
    if options.racks > options.workers {
        return Err(format!("--racks {}: more racks than the {} ranks", options.racks, options.workers));
    }
    if options.dpdk != DpdkSides::default() && (!options.emulated() || options.mpi) {
        return Err("--dpdk puts DPDK ports on an emulated network's interfaces: give its links (--link, \
                    --rank-link or --topology), without --mpi"
            .into());
    }
    if options.mpi && !options.emulated() {
        return Err("--mpi runs the program across an emulated network's namespaces: \
                    give its links (--link, --rank-link or --topology)"
            .into());
    }
    Ok(options)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let options = match parse(&args) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("netagg-run: {message}");
            return ExitCode::from(2);
        }
    };
    match run(options) {
        Ok(code) => ExitCode::from(code),
        Err(message) => {
            eprintln!("netagg-run: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(options: Options) -> Result<u8, String> {
    // Ctrl-C and SIGTERM stop the ranks and the switch, and (on an emulated network)
    // remove the namespaces, instead of killing this process before it can.
    // A second one ends this process at once, leaving the namespaces to the next run.
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(signal, 130, Arc::clone(&interrupted))
            .and_then(|_| signal_hook::flag::register(signal, Arc::clone(&interrupted)))
            .map_err(|e| e.to_string())?;
    }
    if options.emulated() {
        return emulated::run(&options, &interrupted);
    }
    let mut switches = Vec::new();
    let control = match &options.switch {
        Some(address) => address.clone(),
        None => {
            let (child, control) =
                start_switch(Command::new(switch_program()), "127.0.0.1", &options.switch_args, "switch")?;
            switches.push(child);
            control
        }
    };
    // Each rank's switch: the one above, or its rack's.
    let mut controls = vec![control.clone(); usize::from(options.workers)];
    for rack in 0..options.racks {
        let mut arguments = options.switch_args.clone();
        arguments.extend(
            ["--upstream", &control, "--rack", &rack.to_string(), "--racks", &options.racks.to_string()]
                .map(String::from),
        );
        let started =
            start_switch(Command::new(switch_program()), "127.0.0.1", &arguments, &format!("rack {rack}"));
        let (child, rack_control) = match started {
            Ok(started) => started,
            Err(message) => {
                switches.into_iter().for_each(stop_switch);
                return Err(message);
            }
        };
        switches.push(child);
        for rank in netagg_wire::control::rack_ranks(rack, options.racks, options.workers) {
            controls[usize::from(rank)] = rack_control.clone();
        }
    }
    // The switch is stopped on every path, errors included: it must not outlive us.
    let result = free_loopback_port().and_then(|rendezvous_port| {
        let session = format!("netagg-run-{}", std::process::id());
        let ranks = (0..options.workers)
            .map(|rank| {
                let mut command = Command::new(&options.program[0]);
                command.args(&options.program[1..]);
                set_rank_environment(
                    &mut command,
                    rank,
                    options.workers,
                    ("127.0.0.1", rendezvous_port),
                    &controls[usize::from(rank)],
                    &session,
                )?;
                Ok((rank.to_string(), command))
            })
            .collect::<Result<Vec<_>, String>>()?;
        run_ranks(ranks, &interrupted)
    });
    // The lower switches first, so that each prints its counters while its upper
    // switch still runs.
    switches.into_iter().rev().for_each(stop_switch);
    result
}

fn switch_program() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("netagg-switch")))
        .filter(|path| path.is_file())
        .unwrap_or_else(|| PathBuf::from("netagg-switch"))
}

/// Starts a switch (`command`: the switch program, or a command that runs it) on free
/// ports of `host`, its output lines prefixed with `label`, and returns it with its
/// control address.
fn start_switch(
    mut command: Command,
    host: &str,
    extra: &[String],
    label: &str,
) -> Result<(Child, String), String> {
    let mut child = command
        .args(["--control", &format!("{host}:0"), "--data", &format!("{host}:0")])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", command.get_program()))?;
    let Some(stdout) = child.stdout.take() else { return Err("switch has no stdout".into()) };
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    // "netagg-switch: control HOST:PORT data HOST:PORT"
    let Some(control) = first.split_whitespace().nth(2).map(str::to_string) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("the switch did not start (it printed '{first}')"));
    };
    let label = label.to_string();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            println!("[{label}] {line}");
        }
    });
    Ok((child, control))
}

/// A TCP port free on loopback now, for rank 0 of a PyTorch process group to listen on
/// (as torchrun picks one, it may be taken before then, rarely).
fn free_loopback_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .map_err(|e| format!("cannot find a free loopback port: {e}"))
}

/// What a rank needs to know: netagg's rank, world and switch, and PyTorch's
/// rendezvous (`master`: rank 0's address and a port).
fn set_rank_environment(
    command: &mut Command,
    rank: u16,
    workers: u16,
    master: (&str, u16),
    control: &str,
    session: &str,
) -> Result<(), String> {
    let (host, port) =
        control.rsplit_once(':').ok_or(format!("switch address '{control}' is not HOST:PORT"))?;
    command
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", workers.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", workers.to_string())
        .env("MASTER_ADDR", master.0)
        .env("MASTER_PORT", master.1.to_string())
        .env("NETAGG_GENERAL__CONTROLLER_IP", host)
        .env("NETAGG_GENERAL__CONTROLLER_PORT", port)
        .env("NETAGG_GENERAL__SESSION", session);
    Ok(())
}

/// Starts each labelled command with its output prefixed by its label, and waits for
/// all: the first failure stops the others (after 5 s to finish on their own), and so
/// does an interrupt (at once). Returns the first failure's exit code, or 130 after an
/// interrupt, or 0.
fn run_ranks(commands: Vec<(String, Command)>, interrupted: &AtomicBool) -> Result<u8, String> {
    let (exits, exited) = mpsc::channel();
    let mut running = Vec::new();
    for (label, mut command) in commands {
        let spawned = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut running);
                return Err(format!("cannot start {:?}: {e}", command.get_program()));
            }
        };
        for (stream, is_err) in [
            (child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>), false),
            (child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>), true),
        ] {
            let Some(stream) = stream else { continue };
            let label = label.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if is_err {
                        eprintln!("[{label}] {line}");
                    } else {
                        println!("[{label}] {line}");
                    }
                }
            });
        }
        running.push((label, child));
    }
    let mut code = 0u8;
    let mut stop_by: Option<Instant> = None;
    while !running.is_empty() {
        running.retain_mut(|(label, child)| match child.try_wait() {
            Ok(Some(status)) => {
                let _ = exits.send((label.clone(), status));
                false
            }
            Ok(None) => true,
            Err(_) => false,
        });
        // An interrupt first: the ranks it reached too then exit, and are no failures.
        if interrupted.load(Ordering::Relaxed) && code != 130 {
            eprintln!("netagg-run: interrupted; stopping the ranks");
            code = 130;
            stop_by = Some(Instant::now());
        }
        while let Ok((label, status)) = exited.try_recv() {
            if !status.success() && code == 0 {
                code = status.code().map_or(1, |c| c.clamp(1, 255) as u8);
                eprintln!("netagg-run: rank {label} failed ({status}); stopping the others");
                stop_by = Some(Instant::now() + Duration::from_secs(5));
            }
        }
        if stop_by.is_some_and(|deadline| Instant::now() >= deadline) {
            stop_all(&mut running);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(code)
}

fn stop_all(running: &mut Vec<(String, Child)>) {
    for (_, child) in running.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
    running.clear();
}

fn stop_switch(mut switch: Child) {
    // SIGTERM lets the switch print its final counters.
    let _ = Command::new("kill").args(["-TERM", &switch.id().to_string()]).status();
    let deadline = Instant::now() + Duration::from_secs(5);
    while switch.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = switch.kill();
    let _ = switch.wait();
}
