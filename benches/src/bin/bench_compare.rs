//! `bench_compare`: runs netagg's headline comparisons side by side and prints a table of
//! ratios (ours / baseline), each the median of `--runs` runs. `scripts/bench-compare`
//! builds what it needs and runs it.
//!
//! Each ratio is measured within one run, ours and its baseline back to back, because the
//! machines these run on drift by tens of percent within minutes: only ratios measured
//! together mean anything. Rows:
//! - the client path with the dummy backend, float32 as block floating point, 2 worker
//!   threads / a 2-thread memcpy (criterion bench `client_dummy`), with the default
//!   packets and, in the last row, with `configs/large-packets.cfg`;
//! - the sum kernels / a plain `a[i] += b[i]` (criterion bench `sum`, 1 Mi elements);
//! - 2- and 4-worker allreduce of 64 MiB of int32 through netagg-switch on loopback / the
//!   UDP echo relay at the same datagram size and window (`allreduce_benchmark` under
//!   `netagg-run`, `udp_echo_relay`);
//! - the same pair within one process: contexts and a switch started in process / the
//!   relay on a thread, 16 MiB of int32 (criterion bench `udp_switch`);
//! - netagg float32 allreduce / `MPI_Allreduce` over TCP loopback, same ranks and size,
//!   when `mpirun` and the MPI baseline program are there.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use netagg_benches::summary::median;
use serde_json::Value;

#[derive(Debug, Parser)]
#[command(name = "bench_compare")]
struct Options {
    /// Runs of every comparison; the table shows the median ratio.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Elements of the allreduce tensors; the default, 16Mi, is 64 MiB of 4-byte elements.
    #[arg(long, default_value = "16Mi", value_parser = netagg_benches::parse_count)]
    tensor_numel: usize,
    /// Timed jobs per allreduce run.
    #[arg(long, default_value_t = 5)]
    num_jobs: usize,
    /// The MPI baseline program (built by scripts/bench-compare with mpicc); without it,
    /// or without mpirun, the MPI rows are skipped.
    #[arg(long)]
    mpi_program: Option<PathBuf>,
}

/// One row: what is compared, its target, and each run's (ours, baseline) in a unit
/// where more is better.
struct Row {
    name: String,
    unit: &'static str,
    target: Option<f64>,
    runs: Vec<(f64, f64)>,
}

fn main() -> std::process::ExitCode {
    let options = Options::parse();
    match run(&options) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("bench_compare: {message}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

fn run(options: &Options) -> Result<(), String> {
    let release = target_dir().join("release");
    let mpirun = which("mpirun");
    let mut rows = vec![
        Row {
            name: "client path, dummy backend, float32 BFP, 2 threads / 2-thread memcpy".into(),
            unit: "GB/s",
            target: Some(0.5),
            runs: vec![],
        },
        Row {
            name: "sum kernel int32, 1 Mi elements / plain add".into(),
            unit: "G elements/s",
            target: Some(0.8),
            runs: vec![],
        },
        Row {
            name: "sum kernel float32, 1 Mi elements / plain add".into(),
            unit: "G elements/s",
            target: Some(0.8),
            runs: vec![],
        },
    ];
    let numel = options.tensor_numel;
    let mib = (numel * 4) >> 20;
    let switch_rows = rows.len();
    for workers in [2, 4] {
        rows.push(Row {
            name: format!("{workers}-worker allreduce, {mib} MiB int32, via netagg-switch / UDP echo relay"),
            unit: "Gbit/s",
            target: Some(0.6),
            runs: vec![],
        });
    }
    let in_process_rows = rows.len();
    for workers in [2, 4] {
        rows.push(Row {
            name: format!(
                "{workers}-worker allreduce, int32, in one process: switch / UDP echo relay (criterion udp_switch)"
            ),
            unit: "Gbit/s",
            target: Some(0.6),
            runs: vec![],
        });
    }
    let mpi_rows = rows.len();
    let mpi = mpirun.is_some() && options.mpi_program.as_ref().is_some_and(|p| p.is_file());
    if mpi {
        for workers in [2, 4] {
            rows.push(Row {
                name: format!(
                    "{workers}-rank allreduce, {mib} MiB float32, netagg / MPI_Allreduce over TCP loopback"
                ),
                unit: "Gbit/s",
                target: None,
                runs: vec![],
            });
        }
    } else {
        eprintln!("bench_compare: no mpirun or MPI baseline program: skipping the MPI rows (scripts/bench-compare --install-mpi)");
    }

    // Last in the table, beside no other row's index.
    let client_large_packets = rows.len();
    rows.push(Row {
        name: "client path as in the first row, with configs/large-packets.cfg (4096-element packets, 16 in flight)"
            .into(),
        unit: "GB/s",
        target: Some(0.5),
        runs: vec![],
    });

    for run in 1..=options.runs {
        eprintln!("== run {run} of {}", options.runs);
        // Both groups: `client_dummy_float32_bfp` and `..._large_packets`.
        criterion("client_dummy", "client_dummy/float32_bfp")?;
        for (row, group) in [
            (0, "client_dummy_float32_bfp"),
            (client_large_packets, "client_dummy_float32_bfp_large_packets"),
        ] {
            rows[row]
                .runs
                .push((bytes_per_ns(group, "allreduce")?, bytes_per_ns(group, "memcpy_2_threads")?));
        }
        criterion("sum", "sum_(i32|f32)/1048576")?;
        for (row, group) in [(1, "sum_i32_1048576"), (2, "sum_f32_1048576")] {
            let elements = 1048576.0;
            rows[row].runs.push((
                elements / criterion_median_ns(group, "engine")?,
                elements / criterion_median_ns(group, "plain_add")?,
            ));
        }
        let mut netagg_float = Vec::new();
        for (index, workers) in [2usize, 4].into_iter().enumerate() {
            let ours = netagg_allreduce(&release, workers, numel, options.num_jobs, "int32")?;
            let relay = json_line(Command::new(release.join("udp_echo_relay")).args([
                "--workers",
                &workers.to_string(),
                "--tensor-numel",
                &numel.to_string(),
                "--num-jobs",
                &options.num_jobs.to_string(),
                "--num-warmup-jobs",
                "1",
                "--json",
            ]))?;
            let baseline = relay[0]["summary"]["median_gbps"].as_f64().ok_or("udp_echo_relay: no median")?;
            rows[switch_rows + index].runs.push((ours, baseline));
            if mpi {
                netagg_float.push(netagg_allreduce(&release, workers, numel, options.num_jobs, "float")?);
            }
        }
        if let (true, Some(mpirun), Some(program)) = (mpi, &mpirun, &options.mpi_program) {
            for (index, workers) in [2usize, 4].into_iter().enumerate() {
                let output = json_line(
                    Command::new(mpirun)
                        .args([
                            "--oversubscribe",
                            "--allow-run-as-root",
                            "--mca",
                            "btl",
                            "tcp,self",
                            "-n",
                            &workers.to_string(),
                        ])
                        .arg(program)
                        .args([numel.to_string(), options.num_jobs.to_string(), "1".into()]),
                )?;
                let baseline = output[0]["median_gbps"].as_f64().ok_or("MPI baseline: no median")?;
                rows[mpi_rows + index].runs.push((netagg_float[index], baseline));
            }
        }
        criterion("udp_switch", "udp_switch/")?;
        for (index, workers) in [2usize, 4].into_iter().enumerate() {
            let group = format!("udp_switch_{workers}_workers");
            let gbps = |function| bytes_per_ns(&group, function).map(|rate| rate * 8.0);
            rows[in_process_rows + index].runs.push((gbps("allreduce")?, gbps("udp_echo_relay")?));
        }
    }
    print_table(&rows, options.runs);
    Ok(())
}

/// Bytes per nanosecond (GB/s) of a criterion benchmark's last run: the bytes its group
/// declares per iteration over the median time of one.
fn bytes_per_ns(group: &str, function: &str) -> Result<f64, String> {
    let benchmark = criterion_record(group, function, "benchmark.json")?;
    let bytes = benchmark["throughput"]["Bytes"]
        .as_f64()
        .ok_or(format!("criterion {group}/{function}: no throughput in bytes"))?;
    Ok(bytes / criterion_median_ns(group, function)?)
}

/// Runs a criterion bench of netagg-benches, restricted to `filter`.
fn criterion(bench: &str, filter: &str) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["bench", "-p", "netagg-benches", "--bench", bench, "--", filter])
        .args(["--warm-up-time", "1", "--measurement-time", "5", "--noplot"])
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("cargo bench: {e}"))?;
    status.success().then_some(()).ok_or(format!("cargo bench --bench {bench} failed ({status})"))
}

/// The median time of a criterion benchmark's last run, in nanoseconds.
fn criterion_median_ns(group: &str, function: &str) -> Result<f64, String> {
    let estimates = criterion_record(group, function, "estimates.json")?;
    estimates["median"]["point_estimate"]
        .as_f64()
        .ok_or(format!("criterion {group}/{function}: no median in estimates.json"))
}

/// One of the JSON files criterion keeps of a benchmark's last run.
fn criterion_record(group: &str, function: &str, file: &str) -> Result<Value, String> {
    let path = target_dir().join("criterion").join(group).join(function).join("new").join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Median goodput (Gbit/s) of an allreduce_benchmark run under netagg-run, averaged
/// over the ranks.
fn netagg_allreduce(
    release: &Path,
    workers: usize,
    numel: usize,
    jobs: usize,
    kind: &str,
) -> Result<f64, String> {
    let reports = json_line(
        Command::new(release.join("netagg-run"))
            .args(["-n", &workers.to_string(), "--"])
            .arg(release.join("allreduce_benchmark"))
            .args(["--tensor-numel", &numel.to_string(), "--tensor-type", kind])
            .args(["--num-jobs", &jobs.to_string(), "--num-warmup-jobs", "1", "--json"]),
    )?;
    let medians: Vec<f64> = reports.iter().filter_map(|r| r["summary"]["median_gbps"].as_f64()).collect();
    if medians.len() != workers {
        return Err(format!("allreduce_benchmark: {} of {workers} ranks reported", medians.len()));
    }
    Ok(medians.iter().sum::<f64>() / workers as f64)
}

/// Runs a command and returns every line of its output that is a JSON object, with a
/// launcher's `[rank] ` prefix removed.
fn json_line(command: &mut Command) -> Result<Vec<Value>, String> {
    let output =
        command.stderr(std::process::Stdio::null()).output().map_err(|e| format!("{command:?}: {e}"))?;
    if !output.status.success() {
        return Err(format!("{command:?} failed ({})", output.status));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let values: Vec<Value> = text
        .lines()
        .filter_map(|line| line.find('{').map(|start| &line[start..]))
        .filter_map(|json| serde_json::from_str(json).ok())
        .collect();
    if values.is_empty() {
        return Err(format!("{command:?} printed no JSON"));
    }
    Ok(values)
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(program))
        .find(|path| path.is_file())
}

fn print_table(rows: &[Row], runs: usize) {
    println!("| comparison | ours (median) | baseline (median) | ratio, median of {runs} runs (each run's) | target |");
    println!("|---|---|---|---|---|");
    for row in rows.iter().filter(|r| !r.runs.is_empty()) {
        let mut ours: Vec<f64> = row.runs.iter().map(|r| r.0).collect();
        let mut baseline: Vec<f64> = row.runs.iter().map(|r| r.1).collect();
        let mut ratios: Vec<f64> = row.runs.iter().map(|(o, b)| o / b).collect();
        let each = ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", ");
        for values in [&mut ours, &mut baseline, &mut ratios] {
            values.sort_by(f64::total_cmp);
        }
        let ratio = median(&ratios);
        let target = row.target.map_or("—".to_string(), |t| {
            format!("≥ {t} {}", if ratio >= t { "met" } else { "**missed**" })
        });
        println!(
            "| {} | {:.3} {} | {:.3} {} | **{ratio:.2}** ({each}) | {target} |",
            row.name,
            median(&ours),
            row.unit,
            median(&baseline),
            row.unit
        );
    }
}
