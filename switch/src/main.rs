//! `netagg-switch`: the software switch process.
//!
//! Workers register on the TCP control port; aggregation packets arrive on the UDP data
//! port. Prints one line `netagg-switch: control <addr> data <addr>` once both are bound
//! (launchers read it to learn ports chosen with port 0), logs through `tracing`
//! (`--log-level` or `RUST_LOG`), prints counters every `--stats-interval` seconds and on
//! exit, and shuts down cleanly on SIGINT or SIGTERM. The switch itself is the library's
//! [`Switch`]; this is its shell.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use netagg_switch::{Counters, Switch};
use netagg_wire::Endpoint;

/// netagg's software switch: sums the packets of every worker of a session.
///
/// Settings come from the `[switch]` section of the config file (`--config`, else
/// `$NETAGG_CONFIG`, else the first of ./netagg.cfg, ./netagg-<hostname>.cfg,
/// /etc/netagg.cfg), `NETAGG_SWITCH__<KEY>` variables, and these flags, later ones winning.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Config file to read the [switch] section from.
    #[arg(long)]
    config: Option<PathBuf>,
    /// TCP address workers register at (port 0: any free port) [default 0.0.0.0:50099].
    #[arg(long)]
    control: Option<SocketAddr>,
    /// UDP address of the data path (port 0: any free port) [default 0.0.0.0:48864].
    #[arg(long)]
    data: Option<SocketAddr>,
    /// Control connections at once, at most the descriptor limit less 64 [default 1024].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Sessions open or assembling at once [default 64].
    #[arg(long)]
    max_sessions: Option<u16>,
    /// Workers in one session [default 1024].
    #[arg(long)]
    max_workers: Option<u16>,
    /// Slots in one session [default 8192].
    #[arg(long)]
    max_slots: Option<u16>,
    /// Bytes of aggregation state all sessions together may hold [default 1 GiB].
    #[arg(long)]
    max_memory: Option<usize>,
    /// Bytes of aggregation state one session may hold [default 256 MiB].
    #[arg(long)]
    max_session_memory: Option<usize>,
    /// Seconds without packets after which a session is closed although its workers are
    /// connected; 0 never does [default 0].
    #[arg(long)]
    idle_timeout: Option<f64>,
    /// Seconds a control connection may take to register, and its session to assemble
    /// after that [default 60].
    #[arg(long)]
    register_timeout: Option<f64>,
    /// Print counters every this many seconds; 0 prints them only on exit [default 0].
    #[arg(long)]
    stats_interval: Option<f64>,
    /// Log level: error, warn, info, debug or trace; RUST_LOG overrides [default info].
    #[arg(long)]
    log_level: Option<String>,
    /// Faults to inject into the data path, for testing: KEY=VALUE,... with the keys of
    /// [switch.faults] (receive_drop, send_drop, ..._duplicate, ..._reorder,
    /// ..._corrupt, ..._delay in ms, seed); e.g. receive_drop=0.01,send_drop=0.01
    /// is SwitchML's set_drop_probabilities(0.01, 0.01) [default none].
    #[arg(long, value_name = "KEY=VALUE,...")]
    faults: Option<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let settings = match settings(&args) {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("netagg-switch: {message}");
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&settings.log_level));
    let filter = match filter {
        Ok(filter) => filter,
        Err(error) => {
            eprintln!("netagg-switch: log level '{}': {error}", settings.log_level);
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    match run(settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("netagg-switch: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The `[switch]` settings of the config file, overridden by the flags given.
fn settings(args: &Args) -> Result<netagg_config::Switch, String> {
    let mut settings = netagg_config::Config::load(args.config.as_deref()).map_err(|e| e.to_string())?.switch;
    let seconds = |value: f64, flag: &str| {
        Duration::try_from_secs_f64(value)
            .map_err(|_| format!("--{flag} {value}: expected a non-negative number of seconds"))
    };
    if let Some(control) = args.control {
        settings.control = control;
    }
    if let Some(data) = args.data {
        settings.data = data;
    }
    settings.max_connections = args.max_connections.unwrap_or(settings.max_connections);
    settings.max_sessions = args.max_sessions.unwrap_or(settings.max_sessions);
    settings.max_workers = args.max_workers.unwrap_or(settings.max_workers);
    settings.max_slots = args.max_slots.unwrap_or(settings.max_slots);
    settings.max_memory = args.max_memory.unwrap_or(settings.max_memory);
    settings.max_session_memory = args.max_session_memory.unwrap_or(settings.max_session_memory);
    if let Some(value) = args.idle_timeout {
        settings.idle_timeout = seconds(value, "idle-timeout")?;
    }
    if let Some(value) = args.register_timeout {
        settings.register_timeout = seconds(value, "register-timeout")?;
    }
    if let Some(value) = args.stats_interval {
        settings.stats_interval = seconds(value, "stats-interval")?;
    }
    if let Some(level) = &args.log_level {
        settings.log_level = level.clone();
    }
    if let Some(faults) = &args.faults {
        settings.faults.apply_assignments("--faults", faults).map_err(|e| e.to_string())?;
    }
    Ok(settings)
}

fn run(settings: netagg_config::Switch) -> Result<(), String> {
    // Each control connection holds a descriptor: as many as the hard limit allows, as
    // servers do, so that the default limits fit a default `ulimit -n`.
    if let Err(error) = rlimit::increase_nofile_limit(u64::MAX) {
        tracing::warn!(%error, "cannot raise the descriptor limit");
    }
    let switch = Switch::start(&settings).map_err(|e| e.to_string())?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop)).map_err(|e| e.to_string())?;
    }
    let Endpoint::Udp(data) = switch.data_endpoint();
    println!("netagg-switch: control {} data {data}", switch.control_addr());

    let stats_interval = settings.stats_interval;
    let mut next_stats = Instant::now() + stats_interval;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
        if !switch.is_running() {
            break;
        }
        if !stats_interval.is_zero() && Instant::now() >= next_stats {
            print_counters(&switch);
            next_stats += stats_interval;
        }
    }
    print_counters(&switch);
    switch.stop().map_err(|e| e.to_string())
}

fn print_counters(switch: &Switch) {
    let Some(Counters { engine, sessions, faults }) = switch.counters() else { return };
    println!(
        "stats: datagrams {} malformed {} unknown-session {} sessions opened {} closed {} expired {}",
        engine.datagrams,
        engine.malformed,
        engine.unknown_session,
        engine.sessions_opened,
        engine.sessions_closed,
        engine.sessions_expired
    );
    if let Some((receive, send)) = faults {
        println!(
            "stats: faults injected: receive dropped {} duplicated {} reordered {} corrupted {} delayed {}; send dropped {} duplicated {} reordered {} corrupted {} delayed {}",
            receive.dropped, receive.duplicated, receive.reordered, receive.corrupted, receive.delayed,
            send.dropped, send.duplicated, send.reordered, send.corrupted, send.delayed
        );
    }
    for (id, c) in sessions {
        println!(
            "stats: session {:#010x} packets {} contributions {} results {} resent {} duplicates {} stale {} stalled {} rejected {} forged {}",
            id.0, c.packets_in, c.contributions, c.results_broadcast, c.results_resent, c.duplicates, c.stale, c.stalled, c.rejected, c.forged
        );
    }
}
