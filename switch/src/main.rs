//! `netagg-switch`: the software switch process.
//!
//! Workers register on the TCP control port; aggregation packets arrive on the UDP data
//! port. Prints one line `netagg-switch: control <addr> data <addr>` once both are bound
//! (launchers read it to learn ports chosen with port 0), logs through `tracing`
//! (`--log-level` or `RUST_LOG`), prints counters every `--stats-interval` seconds and on
//! exit, and shuts down cleanly on SIGINT or SIGTERM.

mod control;
mod datapath;

use std::net::{SocketAddr, TcpListener};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use netagg_aggregator::EngineLimits;

use crate::control::ControlPlane;
use crate::datapath::{Command, DataPath};

/// netagg's software switch: sums the packets of every worker of a session.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// TCP address workers register at (port 0: any free port).
    #[arg(long, default_value = "0.0.0.0:50099")]
    control: SocketAddr,
    /// UDP address of the data path (port 0: any free port).
    #[arg(long, default_value = "0.0.0.0:48864")]
    data: SocketAddr,
    /// Sessions open at once.
    #[arg(long, default_value_t = 64)]
    max_sessions: u16,
    /// Workers in one session.
    #[arg(long, default_value_t = 1024)]
    max_workers: u16,
    /// Slots in one session.
    #[arg(long, default_value_t = 8192)]
    max_slots: u16,
    /// Bytes of aggregation state all sessions together may hold.
    #[arg(long, default_value_t = 1 << 30)]
    max_memory: usize,
    /// Seconds without packets after which a session is closed.
    #[arg(long, default_value_t = 60.0)]
    idle_timeout: f64,
    /// Print counters every this many seconds (0: only on exit).
    #[arg(long, default_value_t = 0.0)]
    stats_interval: f64,
    /// Log level: error, warn, info, debug or trace (RUST_LOG overrides).
    #[arg(long, default_value = "info")]
    log_level: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&args.log_level));
    let filter = match filter {
        Ok(filter) => filter,
        Err(error) => {
            eprintln!("netagg-switch: --log-level '{}': {error}", args.log_level);
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("netagg-switch: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let seconds = |value: f64, flag: &str| {
        Duration::try_from_secs_f64(value)
            .map_err(|_| format!("--{flag} {value}: expected a non-negative number of seconds"))
    };
    let idle_timeout = seconds(args.idle_timeout, "idle-timeout")?;
    let stats_interval = seconds(args.stats_interval, "stats-interval")?;
    let limits = EngineLimits {
        max_sessions: args.max_sessions,
        max_workers: args.max_workers,
        max_slots: args.max_slots,
        max_bytes: args.max_memory,
        session_idle_timeout: idle_timeout,
        ..EngineLimits::default()
    };

    let control =
        TcpListener::bind(args.control).map_err(|e| format!("cannot listen on {}: {e}", args.control))?;
    let data = netagg_udp::BatchSocket::bind(args.data, datapath::SOCKET_BUFFER)
        .map_err(|e| format!("cannot bind UDP {}: {e}", args.data))?;
    let control_addr = control.local_addr().map_err(|e| e.to_string())?;
    let data_addr = data.local_addr().map_err(|e| e.to_string())?;

    let (commands, command_receiver) = crossbeam_channel::unbounded();
    let (events, event_receiver) = crossbeam_channel::unbounded();
    let datapath = DataPath::new(data, limits, command_receiver, events);
    let datapath = std::thread::Builder::new()
        .name("datapath".into())
        .spawn(move || datapath.run())
        .map_err(|e| e.to_string())?;
    let plane = ControlPlane::new(commands.clone(), data_addr.port());
    {
        let plane = Arc::clone(&plane);
        std::thread::spawn(move || plane.serve(control));
    }
    {
        let plane = Arc::clone(&plane);
        std::thread::spawn(move || plane.handle_events(event_receiver));
    }

    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop)).map_err(|e| e.to_string())?;
    }
    println!("netagg-switch: control {control_addr} data {data_addr}");
    tracing::info!(%control_addr, %data_addr, "switch ready");

    let mut next_stats = Instant::now() + stats_interval;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
        if datapath.is_finished() {
            break;
        }
        if !stats_interval.is_zero() && Instant::now() >= next_stats {
            print_counters(&commands);
            next_stats += stats_interval;
        }
    }
    print_counters(&commands);
    let _ = commands.send(Command::Shutdown);
    match datapath.join() {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(format!("data path failed: {error}")),
        Err(_) => Err("data path panicked".into()),
    }
}

fn print_counters(commands: &crossbeam_channel::Sender<Command>) {
    let (reply, result) = crossbeam_channel::bounded(1);
    if commands.send(Command::Counters { reply }).is_err() {
        return;
    }
    let Ok((engine, sessions)) = result.recv_timeout(Duration::from_secs(2)) else { return };
    println!(
        "stats: datagrams {} malformed {} unknown-session {} sessions opened {} closed {} expired {}",
        engine.datagrams,
        engine.malformed,
        engine.unknown_session,
        engine.sessions_opened,
        engine.sessions_closed,
        engine.sessions_expired
    );
    for (id, c) in sessions {
        println!(
            "stats: session {:#010x} packets {} contributions {} results {} resent {} duplicates {} stale {} stalled {} rejected {}",
            id.0, c.packets_in, c.contributions, c.results_broadcast, c.results_resent, c.duplicates, c.stale, c.stalled, c.rejected
        );
    }
}
