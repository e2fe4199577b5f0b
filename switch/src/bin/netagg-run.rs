//! `netagg-run`: starts a switch and N local worker processes of one session.
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
//! to fail (the others are then stopped), or 0.

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

struct Options {
    workers: u16,
    switch: Option<String>,
    switch_args: Vec<String>,
    program: Vec<String>,
}

const USAGE: &str = "usage: netagg-run -n N [--switch HOST:PORT] [--switch-arg ARG]... -- PROGRAM [ARGS...]";

fn parse(args: &[String]) -> Result<Options, String> {
    let mut options = Options { workers: 0, switch: None, switch_args: Vec::new(), program: Vec::new() };
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

fn switch_program() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("netagg-switch")))
        .filter(|path| path.is_file())
        .unwrap_or_else(|| PathBuf::from("netagg-switch"))
}

/// Starts a switch on free loopback ports and returns it with its control address.
fn start_switch(extra: &[String]) -> Result<(Child, String), String> {
    let program = switch_program();
    let mut child = Command::new(&program)
        .args(["--control", "127.0.0.1:0", "--data", "127.0.0.1:0"])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", program.display()))?;
    let Some(stdout) = child.stdout.take() else { return Err("switch has no stdout".into()) };
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    // "netagg-switch: control 127.0.0.1:PORT data 127.0.0.1:PORT"
    let Some(control) = first.split_whitespace().nth(2).map(str::to_string) else {
        let _ = child.kill();
        return Err(format!("the switch did not start (it printed '{first}')"));
    };
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            println!("[switch] {line}");
        }
    });
    Ok((child, control))
}

fn run(options: Options) -> Result<u8, String> {
    let mut switch = None;
    let control = match &options.switch {
        Some(address) => address.clone(),
        None => {
            let (child, control) = start_switch(&options.switch_args)?;
            switch = Some(child);
            control
        }
    };
    // The switch is stopped on every path, errors included: it must not outlive us.
    let result = run_workers(&options, &control);
    if let Some(switch) = switch {
        stop_switch(switch);
    }
    result
}

/// A TCP port free on loopback now, for rank 0 of a PyTorch process group to listen on
/// (as torchrun picks one, it may be taken before then, rarely).
fn free_loopback_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .map_err(|e| format!("cannot find a free loopback port: {e}"))
}

/// Starts the ranks and waits for them; the first failure stops the others.
fn run_workers(options: &Options, control: &str) -> Result<u8, String> {
    let (host, port) =
        control.rsplit_once(':').ok_or(format!("switch address '{control}' is not HOST:PORT"))?;
    let session = format!("netagg-run-{}", std::process::id());
    let rendezvous_port = free_loopback_port()?.to_string();
    let (exits, exited) = mpsc::channel();
    let mut workers = Vec::new();
    for rank in 0..options.workers {
        let mut child = Command::new(&options.program[0])
            .args(&options.program[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", options.workers.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", options.workers.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &rendezvous_port)
            .env("NETAGG_GENERAL__CONTROLLER_IP", host)
            .env("NETAGG_GENERAL__CONTROLLER_PORT", port)
            .env("NETAGG_GENERAL__SESSION", &session)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", options.program[0]))?;
        for (stream, is_err) in [
            (child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>), false),
            (child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>), true),
        ] {
            let Some(stream) = stream else { continue };
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if is_err {
                        eprintln!("[{rank}] {line}");
                    } else {
                        println!("[{rank}] {line}");
                    }
                }
            });
        }
        workers.push(child);
    }
    // Poll the workers: the first failure stops the rest.
    let mut code = 0u8;
    let mut running: Vec<(u16, Child)> =
        workers.into_iter().enumerate().map(|(r, c)| (r as u16, c)).collect();
    let mut stop_by: Option<Instant> = None;
    while !running.is_empty() {
        running.retain_mut(|(rank, child)| match child.try_wait() {
            Ok(Some(status)) => {
                let _ = exits.send((*rank, status));
                false
            }
            Ok(None) => true,
            Err(_) => false,
        });
        while let Ok((rank, status)) = exited.try_recv() {
            if !status.success() && code == 0 {
                code = status.code().map_or(1, |c| c.clamp(1, 255) as u8);
                eprintln!("netagg-run: rank {rank} failed ({status}); stopping the others");
                stop_by = Some(Instant::now() + Duration::from_secs(5));
            }
        }
        if stop_by.is_some_and(|deadline| Instant::now() >= deadline) {
            for (_, child) in &mut running {
                let _ = child.kill();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(code)
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
