//! `dpdk_compare`: the DPDK path against the kernel's on the same emulated network, as a
//! Markdown table. `scripts/dpdk-compare` builds what it needs and runs it (as root).
//!
//! The switch and N workers run in network namespaces behind shaped links
//! (`netagg-run --link`), with kernel UDP everywhere, DPDK workers, a DPDK switch, and
//! DPDK on both sides (`netagg-run --dpdk`: DPDK's af_packet driver on each namespace's
//! veth, no hugepages). The pairings run in turn, `--runs` rounds of them, so that the
//! machine's moods fall on all alike. A row gives a pairing's median job time on rank 0
//! (the median of the runs, each run's beside it), the goodput at that time, and its
//! time over kernel UDP's in the same round (the median of the rounds' ratios, each
//! round's beside it).
//!
//! af_packet over veth copies every frame through the kernel both ways: these rows say
//! what that path costs on this machine, not what DPDK does on a NIC (the criterion
//! bench `dpdk_station` measures netagg's own DPDK code per datagram).

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Duration;

use clap::Parser;
use netagg_benches::rounds::{each_round, Rounds};
use netagg_benches::summary::goodput_gbps;

#[derive(Debug, Parser)]
#[command(name = "dpdk_compare")]
struct Options {
    /// Workers, each in a network namespace of its own.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Every worker's link, as `netagg-run --link` takes it.
    #[arg(long, default_value = "rate=10gbit")]
    link: String,
    /// Int32 elements of the tensor.
    #[arg(long, default_value = "4Mi", value_parser = netagg_benches::parse_count)]
    tensor_numel: usize,
    /// Timed jobs per run, after 2 warmup jobs.
    #[arg(long, default_value_t = 10)]
    num_jobs: usize,
    /// Rounds of the four pairings; the table shows medians.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Where netagg-run, netagg-switch and allreduce_benchmark are.
    #[arg(long)]
    bin_dir: PathBuf,
}

/// Which sides' data leaves from DPDK ports.
struct Pairing {
    /// `netagg-run --dpdk`'s value; `None` for kernel UDP on both sides.
    dpdk: Option<&'static str>,
    /// The table's name: the workers' data path / the switch's.
    name: &'static str,
}

impl Pairing {
    /// The pairing in progress lines and errors.
    fn label(&self) -> &'static str {
        self.dpdk.unwrap_or("kernel")
    }
}

/// Kernel UDP on both sides first: the baseline of every row.
const PAIRINGS: [Pairing; 4] = [
    Pairing { dpdk: None, name: "kernel UDP / kernel UDP" },
    Pairing { dpdk: Some("workers"), name: "DPDK / kernel UDP" },
    Pairing { dpdk: Some("switch"), name: "kernel UDP / DPDK" },
    Pairing { dpdk: Some("both"), name: "DPDK / DPDK" },
];

fn main() -> ExitCode {
    let options = Options::parse();
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("dpdk_compare: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(options: &Options) -> Result<(), String> {
    // Each pairing's median job time in ms, against kernel UDP's of the same round.
    let mut rows = vec![Rounds::default(); PAIRINGS.len()];
    for round in 1..=options.runs {
        let mut times = Vec::with_capacity(PAIRINGS.len());
        for pairing in &PAIRINGS {
            let milliseconds = median_job_ms(options, pairing)?;
            eprintln!("run {round}, {}: {milliseconds} ms", pairing.label());
            times.push(milliseconds);
        }
        for (row, &time) in rows.iter_mut().zip(&times) {
            row.push(time, times[0]);
        }
    }
    println!();
    println!(
        "{} workers, --link {}, {} int32 elements, {} jobs per run, {} runs",
        options.workers, options.link, options.tensor_numel, options.num_jobs, options.runs
    );
    println!();
    for line in table(&rows, options.tensor_numel) {
        println!("{line}");
    }
    Ok(())
}

/// The Markdown table of `rows`, one per pairing in [`PAIRINGS`]' order, of jobs of
/// `elements` 4-byte elements.
fn table(rows: &[Rounds], elements: usize) -> Vec<String> {
    let mut lines = vec![
        "| data path (workers / switch) | median job time, ms (each run's) | goodput, Gbit/s | time / kernel \
         UDP's, median (each round's) |"
            .to_string(),
        "|---|---|---|---|".to_string(),
    ];
    for (pairing, row) in PAIRINGS.iter().zip(rows) {
        let median_ms = row.median_ours();
        let goodput = goodput_gbps(elements as u64, Duration::from_secs_f64(median_ms / 1e3));
        lines.push(format!(
            "| {} | {median_ms:.1} ({}) | {goodput:.2} | {:.2} ({}) |",
            pairing.name,
            each_round(row.ours(), 1),
            row.median_ratio(),
            each_round(row.ratios(), 2)
        ));
    }
    lines
}

/// Rank 0's median job time, in milliseconds, of one run of `pairing`, once every rank
/// has verified its sums.
fn median_job_ms(options: &Options, pairing: &Pairing) -> Result<f64, String> {
    let mut command = Command::new(options.bin_dir.join("netagg-run"));
    command.args(["-n", &options.workers.to_string(), "--link", &options.link]);
    if let Some(sides) = pairing.dpdk {
        command.args(["--dpdk", sides]);
    }
    command.arg("--").arg(options.bin_dir.join("allreduce_benchmark"));
    command.args(["--tensor-numel", &options.tensor_numel.to_string()]);
    command.args([
        "--num-jobs",
        &options.num_jobs.to_string(),
        "--num-warmup-jobs",
        "2",
        "--verify",
        "--json",
    ]);
    let label = pairing.label();
    let stdout =
        netagg_benches::stdout_of(&mut command).map_err(|e| format!("the {label} run failed: {e}"))?;
    let reports = netagg_benches::json_objects(&stdout);
    let verified = reports.iter().filter(|report| report["verified"] == true).count();
    if verified != options.workers {
        return Err(format!(
            "the {label} run did not verify on every rank ({verified} of {} did):\n{stdout}",
            options.workers
        ));
    }
    let rank_0 = reports.iter().find(|report| report["rank"] == 0).ok_or("rank 0 printed no report")?;
    let median_ns = rank_0["summary"]["median_ns"].as_f64().ok_or("rank 0's report has no median")?;
    Ok(median_ns / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_pairing_is_timed_against_kernel_udp_of_the_same_round() {
        // Milliseconds of kernel, workers, switch and both in each round; the machine is
        // twice as slow in the second round.
        let rounds =
            [[100.0, 120.0, 120.0, 90.0], [200.0, 150.0, 230.0, 190.0], [110.0, 100.0, 130.0, 100.0]];
        let mut rows = vec![Rounds::default(); PAIRINGS.len()];
        for times in rounds {
            for (row, &time) in rows.iter_mut().zip(&times) {
                row.push(time, times[0]);
            }
        }
        let lines = table(&rows, 4 << 20);
        assert_eq!(lines.len(), 6);
        assert!(lines[0].starts_with("| data path (workers / switch) | median job time, ms (each run's) |"));
        // 4 Mi elements of 32 bits in 110 ms: 1.22 Gbit/s.
        assert_eq!(
            lines[2],
            "| kernel UDP / kernel UDP | 110.0 (100.0, 200.0, 110.0) | 1.22 | 1.00 (1.00, 1.00, 1.00) |"
        );
        // Each round's ratio 1.20, 0.75, 0.91: their median, not the medians' ratio (120 / 110).
        assert_eq!(
            lines[3],
            "| DPDK / kernel UDP | 120.0 (120.0, 150.0, 100.0) | 1.12 | 0.91 (1.20, 0.75, 0.91) |"
        );
        assert_eq!(
            lines[4],
            "| kernel UDP / DPDK | 130.0 (120.0, 230.0, 130.0) | 1.03 | 1.18 (1.20, 1.15, 1.18) |"
        );
        assert_eq!(lines[5], "| DPDK / DPDK | 100.0 (90.0, 190.0, 100.0) | 1.34 | 0.91 (0.90, 0.95, 0.91) |");
    }
}
