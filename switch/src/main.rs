//! `netagg-switch`: the software switch process.
//!
//! Workers register on the TCP control port; aggregation packets arrive on the data port
//! (UDP, or RDMA connections through rdma_cm). Prints one line `netagg-switch: control
//! <addr> data <addr>` once both are bound (launchers read it to learn ports chosen with
//! port 0), logs to stderr through `tracing` (`--log-level` or `RUST_LOG`; one line per
//! event, coloured only on a terminal without `NO_COLOR`: `netagg_config::logging`),
//! prints counters to stdout every `--stats-interval` seconds and on exit, one line per
//! group, and shuts down cleanly on SIGINT or SIGTERM. The switch itself is the library's
//! [`Switch`]; this is its shell.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Arg;
use netagg_config::{Config, Origin};
use netagg_switch::{Counters, Switch};

/// What `netagg-switch --help` says above its flags.
const ABOUT: &str = "netagg's software switch: sums the packets of every worker of a session.

Settings come from the [switch] section of the config file (--config, else $NETAGG_CONFIG,
else the first of ./netagg.cfg, ./netagg-<hostname>.cfg, /etc/netagg.cfg),
NETAGG_SWITCH__<KEY> variables, and these flags, later ones winning. Every key of [switch]
is a flag of the same name, checked by the same rules as the file.";

/// The `[switch]` keys that are flags: all but the fault section's, which `--faults`
/// takes together.
fn switch_keys() -> impl Iterator<Item = (String, String)> {
    Config::keys().filter(|(key, _)| key.starts_with("switch.") && !key.starts_with("switch.faults."))
}

/// The flag of a `[switch]` key: `switch.max_sessions` is `--max-sessions`.
fn flag_of(key: &str) -> String {
    key.trim_start_matches("switch.").replace('_', "-")
}

fn command() -> clap::Command {
    let defaults = Config::default();
    let keys = switch_keys().map(|(key, expected)| {
        let doc = Config::key_doc(&key).unwrap_or_default();
        let default = defaults.get(&key).unwrap_or_default();
        // Values go to the table's checks as they are, negative numbers included.
        Arg::new(key.clone())
            .long(flag_of(&key))
            .value_name("VALUE")
            .allow_hyphen_values(true)
            .help(format!("{doc} Takes {expected} [default {default}]").trim_start().to_string())
    });
    clap::Command::new("netagg-switch")
        .version(env!("CARGO_PKG_VERSION"))
        .about(ABOUT)
        .arg(
            Arg::new("config")
                .long("config")
                .value_name("FILE")
                .value_parser(clap::value_parser!(PathBuf))
                .help("Config file to read the [switch] section from."),
        )
        .args(keys)
        .arg(Arg::new("faults").long("faults").value_name("KEY=VALUE,...").help(
            "Faults to inject into the data path, for testing: the keys of [switch.faults] \
             (receive_drop, send_drop, ..._duplicate, ..._reorder, ..._corrupt, ..._delay in \
             ms, seed); e.g. receive_drop=0.01,send_drop=0.01 is SwitchML's \
             set_drop_probabilities(0.01, 0.01) [default none].",
        ))
}

fn main() -> ExitCode {
    let args = command().get_matches();
    let settings = match settings(&args) {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("netagg-switch: {message}");
            return ExitCode::from(2);
        }
    };
    if let Err(error) = netagg_config::logging::init(&settings.log_level) {
        eprintln!("netagg-switch: {error}");
        return ExitCode::from(2);
    }
    match run(settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("netagg-switch: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The `[switch]` settings of the config file and the environment, overridden by the
/// flags given, each checked as the file's keys are.
fn settings(args: &clap::ArgMatches) -> Result<netagg_config::Switch, String> {
    let path = args.get_one::<PathBuf>("config");
    let mut config = Config::load(path.map(PathBuf::as_path)).map_err(|e| e.to_string())?;
    for (key, _) in switch_keys() {
        if let Some(value) = args.get_one::<String>(&key) {
            let origin = Origin::Flag(format!("--{}", flag_of(&key)));
            config.set_from(&origin, &key, value).map_err(|e| e.to_string())?;
        }
    }
    if let Some(faults) = args.get_one::<String>("faults") {
        config.switch.faults.apply_assignments("--faults", faults).map_err(|e| e.to_string())?;
    }
    config.validate()?;
    Ok(config.switch)
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
    // The address alone, whatever the transport: launchers read this line.
    let data = switch.data_endpoint().socket_addr();
    // The metrics address, if served, comes last, so that readers of the first two
    // words' positions are unaffected.
    match switch.metrics_addr() {
        Some(metrics) => {
            println!("netagg-switch: control {} data {data} metrics {metrics}", switch.control_addr())
        }
        None => println!("netagg-switch: control {} data {data}", switch.control_addr()),
    }

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
    let Some(Counters { engine, sessions, uplink, faults }) = switch.counters() else { return };
    println!(
        "stats: datagrams {} corrupt {} malformed {} unknown-session {} sessions opened {} closed {} expired {}",
        engine.datagrams,
        engine.corrupt,
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
    // A lower switch of a tree: what went up to its upper switch and came back down.
    if uplink != Default::default() {
        let u = uplink;
        println!(
            "stats: uplink sent-up {} resent-up {} requests {} acks {} bytes-up {} results-down {} bytes-down {} ignored {} \
             overtaken {} timed-out {}",
            u.sent_up, u.resent_up, u.requests, u.acks, u.bytes_up, u.results_down, u.bytes_down, u.ignored,
            u.overtaken, u.timed_out
        );
    }
    for (id, c) in sessions {
        println!(
            "stats: session {:#010x} packets {} contributions {} results {} resent {} duplicates {} not-ready {} stale {} stalled {} \
             rejected {} forged {} lost-notices {} lost-notices-dropped {}",
            id.0, c.packets_in, c.contributions, c.results_broadcast, c.results_resent, c.duplicates, c.not_ready, c.stale, c.stalled,
            c.rejected, c.forged, c.lost_notices, c.lost_notices_dropped
        );
    }
}
