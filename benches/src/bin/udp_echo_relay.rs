//! `udp_echo_relay`: the kernel's UDP price for an allreduce's traffic, without the switch.
//!
//! Starts a relay that echoes every datagram to its sender, and `--workers` emulated
//! workers of `num_worker_threads` threads each, which stream a tensor of
//! `--tensor-numel` int32 elements through it as allreduce_benchmark's workers stream
//! theirs through netagg-switch: datagrams of a netagg header plus `packet_numel`
//! elements, `max_outstanding_packets` in flight per worker, the same batched sockets.
//! Those three settings and the socket buffer come from the netagg configuration (file,
//! `NETAGG_*` variables), so one environment configures both sides of the comparison.
//! Prints allreduce_benchmark's timing lines, per job.

use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::Parser;
use netagg::Config;
use netagg_benches::parse_count;
use netagg_benches::relay::{thread_shares, EchoRelay, StreamClient, StreamCounters};
use netagg_benches::summary::{cpp_double, goodput_gbps, Summary};

/// A UDP echo relay and emulated workers: the baseline of allreduce through the switch.
#[derive(Debug, Parser)]
#[command(name = "udp_echo_relay", version)]
struct Options {
    /// Emulated workers, each with num_worker_threads threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Elements per worker and job: 1000, 1M (10^6), 64Mi (64 · 2^20).
    #[arg(long, default_value = "64Mi", value_parser = parse_count)]
    tensor_numel: usize,
    #[arg(long, default_value_t = 10)]
    num_jobs: usize,
    #[arg(long, default_value_t = 2)]
    num_warmup_jobs: usize,
    /// Also print the results as one line of JSON, last.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    workers: usize,
    worker_threads: u16,
    packet_numel: u16,
    window: u16,
    tensor_numel: usize,
    groups: Vec<(u64, u64)>,
    summary: Option<Summary>,
    resent: u64,
}

fn main() -> ExitCode {
    let options = Options::parse();
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("udp_echo_relay: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(options: &Options) -> Result<(), String> {
    let config = Config::load(None).map_err(|e| e.to_string())?;
    let general = &config.general;
    let threads = general.num_worker_threads as usize;
    let packet_bytes = general.packet_numel as usize * 4;
    let window = config.slots_per_thread() as usize;
    let relay = EchoRelay::start("127.0.0.1:0".parse().map_err(|_| "loopback")?)
        .map_err(|e| format!("relay socket: {e}"))?;

    let shares = thread_shares(options.tensor_numel * 4, packet_bytes, threads);
    let jobs = options.num_warmup_jobs + options.num_jobs;
    let clients = options.workers * threads;
    let start = Arc::new(Barrier::new(clients + 1));
    let end = Arc::new(Barrier::new(clients + 1));
    let mut handles = Vec::new();
    for client in 0..clients {
        let bytes = shares[client % threads];
        let mut stream =
            StreamClient::connect(relay.address(), config.udp.socket_buffer).map_err(|e| e.to_string())?;
        let (start, end) = (Arc::clone(&start), Arc::clone(&end));
        handles.push(std::thread::spawn(move || -> std::io::Result<StreamCounters> {
            let input: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
            let mut output = vec![0u8; bytes];
            let mut total = StreamCounters::default();
            let mut failure = None;
            // A failed client still meets the others at every barrier, so none waits for
            // ever; its error is reported at the end.
            for _ in 0..jobs {
                start.wait();
                if failure.is_none() {
                    match stream.stream(&input, &mut output, packet_bytes, window) {
                        Ok(counters) => total.resent += counters.resent,
                        Err(error) => failure = Some(error),
                    }
                }
                end.wait();
            }
            failure.map_or(Ok(total), Err)
        }));
    }

    println!("Submitting {} warmup jobs.", options.num_warmup_jobs);
    let mut groups = Vec::new();
    for job in 0..jobs {
        if job == options.num_warmup_jobs {
            println!("Warmup finished.");
            println!("Submitting {} jobs.", options.num_jobs);
        }
        start.wait();
        let started = Instant::now();
        end.wait();
        let duration = started.elapsed();
        if job >= options.num_warmup_jobs {
            let index = job - options.num_warmup_jobs;
            let elements = options.tensor_numel as u64;
            println!(
                "Job(s) #{index}# finished. Duration: #{}# ns Goodput: #{}# Gbps.",
                duration.as_nanos(),
                cpp_double(goodput_gbps(elements, duration))
            );
            groups.push((elements, duration));
        }
    }
    println!("All jobs finished.");
    let mut resent = 0;
    for handle in handles {
        resent += handle.join().map_err(|_| "a client thread panicked")?.map_err(|e| e.to_string())?.resent;
    }
    relay.stop().map_err(|e| format!("relay: {e}"))?;

    let summary = Summary::of(&groups);
    println!("\n");
    if let Some(summary) = &summary {
        summary.lines().iter().for_each(|line| println!("{line}"));
    }
    println!("Datagrams sent again after a loss: {resent}");
    if options.json {
        let report = Report {
            workers: options.workers,
            worker_threads: general.num_worker_threads,
            packet_numel: general.packet_numel,
            window: general.max_outstanding_packets,
            tensor_numel: options.tensor_numel,
            groups: groups.iter().map(|(e, d): &(u64, Duration)| (*e, d.as_nanos() as u64)).collect(),
            summary,
            resent,
        };
        println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    }
    Ok(())
}
