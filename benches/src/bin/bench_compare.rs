//! `bench_compare`: runs netagg's headline comparisons side by side and prints a table of
//! ratios (ours / baseline), each the median of `--runs` runs. `scripts/bench-compare`
//! builds what it needs and runs it.
//!
//! Each ratio is measured within one run, ours and its baseline back to back, because the
//! machines these run on drift by tens of percent within minutes: only ratios measured
//! together mean anything. Rows:
//! - the client path with the dummy backend, float32 as block floating point, 2 worker
//!   threads / a 2-thread memcpy (criterion bench `client_dummy`), with the default
//!   packets and with `configs/large-packets.cfg`;
//! - the client path's int32 (native) / its float32 (block floating point), each
//!   `allreduce_benchmark` with the dummy backend: int32 has less to do, so should be
//!   at least as fast;
//! - each of those / the 2-thread memcpy of criterion's `client_dummy` groups: the
//!   client path against the memory's bound, type by type, which a loss in both types
//!   shows and the ratio above does not;
//! - the sum kernels / a plain `a[i] += b[i]` (criterion bench `sum`, 1 Mi elements);
//! - 2- and 4-worker allreduce of 64 MiB of int32 through netagg-switch on loopback / the
//!   UDP echo relay at the same datagram size and window (`allreduce_benchmark` under
//!   `netagg-run`, `udp_echo_relay`), with the default packets and with large ones;
//! - the same pairs within one process: contexts and a switch started in process / the
//!   relay on a thread, 16 MiB of int32 (criterion bench `udp_switch`);
//! - netagg float32 allreduce / `MPI_Allreduce` over TCP loopback, same ranks and size,
//!   when `mpirun` and the MPI baseline program are there; then the same per byte
//!   through the kernel, which on one machine carries every tensor netagg moves (2N per
//!   job: each rank's up, the sum down to each) and every one the ring moves (2(N-1));
//! - DDP training of `examples/python/train_ddp.py` with the netagg hook / with DDP's
//!   own allreduce over gloo, images per second, when `--python` is given;
//! - with `--baseline-build DIR`, the dummy client path of this build / that of another
//!   build's release directory, int32 and float32 BFP: an A/B of two commits on one
//!   machine, which `--client-path-only` runs alone.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use netagg_benches::rounds::{each_round, Rounds};
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
    /// A Python with the netagg package and PyTorch (scripts/bench-compare sets one up
    /// when Debian's python3-torch is installed); without it, the DDP rows are skipped.
    #[arg(long)]
    python: Option<PathBuf>,
    /// The release directory of another build of netagg (its `target/release`, with
    /// `allreduce_benchmark` built there): adds the dummy client path of this build
    /// against that one's, int32 and float32 BFP, the two builds run in turn, the
    /// baseline first in every other run.
    #[arg(long)]
    baseline_build: Option<PathBuf>,
    /// Only the dummy client path's `allreduce_benchmark` rows (and those of
    /// `--baseline-build`): an A/B of two builds in minutes.
    #[arg(long)]
    client_path_only: bool,
}

/// One row: what is compared, its target, and each run's figures of ours and of the
/// baseline, in a unit where more is better.
struct Row {
    name: String,
    unit: &'static str,
    target: Option<f64>,
    runs: Rounds,
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
    let large_packets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/large-packets.cfg");
    let numel = options.tensor_numel;
    let mib = (numel * 4) >> 20;
    let mut table = Table::default();
    let client =
        table.row("client path, dummy backend, float32 BFP, 2 threads / 2-thread memcpy", "GB/s", 0.5);
    let client_large = table.row(
        "client path as above, with configs/large-packets.cfg (4096-element packets, 16 in flight)",
        "GB/s",
        0.5,
    );
    let client_int32 = table.row(
        "client path, dummy backend, 4 workers, 2 threads, 64 Mi elements: int32 native / float32 BFP \
         (allreduce_benchmark)",
        "Gbit/s",
        1.0,
    );
    // The same client path against the memory's bound, each type on its own: a loss in
    // both types (the pacer's shared lock, once) leaves the ratio above unchanged. The
    // target is 3 times the 0.1 that SwitchML's client path reaches on this class of
    // machine.
    let [int32_vs_memcpy, float32_vs_memcpy] = ["int32 native", "float32 BFP"].map(|kind| {
        table.row(
            &format!(
                "client path, dummy backend, 4 workers, 2 threads, 64 Mi elements, {kind} \
                 (allreduce_benchmark) / 2-thread memcpy of 64 MiB (criterion client_dummy)"
            ),
            "GB/s",
            0.3,
        )
    });
    let against_build = options.baseline_build.as_ref().map(|build| {
        ["int32 native", "float32 BFP"].map(|kind| {
            table.untargeted(
                &format!(
                    "client path, dummy backend, 4 workers, 2 threads, 64 Mi elements, {kind} \
                     (allreduce_benchmark): this build / {}",
                    build.display()
                ),
                "Gbit/s",
            )
        })
    });
    let sum_int32 = table.row("sum kernel int32, 1 Mi elements / plain add", "G elements/s", 0.8);
    let sum_float32 = table.row("sum kernel float32, 1 Mi elements / plain add", "G elements/s", 0.8);
    let mut via_switch = Vec::new();
    for (packets, config) in [("default packets", None), ("large packets", Some(large_packets.as_path()))] {
        for workers in [2, 4] {
            let row = table.row(
                &format!("{workers}-worker allreduce, {mib} MiB int32, {packets}: via netagg-switch / UDP echo relay"),
                "Gbit/s",
                0.8,
            );
            via_switch.push((row, workers, config));
        }
    }
    let mut in_process = Vec::new();
    for (packets, suffix) in [("default packets", ""), ("large packets", "_large_packets")] {
        for workers in [2, 4] {
            let row = table.row(
                &format!(
                    "{workers}-worker allreduce, 16 MiB int32, {packets}, in one process: switch / UDP echo \
                     relay (criterion udp_switch)"
                ),
                "Gbit/s",
                0.8,
            );
            in_process.push((row, format!("udp_switch_{workers}_workers{suffix}")));
        }
    }
    let mpi = match (which("mpirun"), &options.mpi_program) {
        (Some(mpirun), Some(program)) if program.is_file() => Some((mpirun, program)),
        _ => {
            eprintln!(
                "bench_compare: no mpirun or MPI baseline program: skipping the MPI rows \
                 (scripts/bench-compare --install-mpi)"
            );
            None
        }
    };
    let mut against_mpi = Vec::new();
    if mpi.is_some() {
        for workers in [2, 4] {
            let goodput = table.untargeted(
                &format!(
                    "{workers}-rank allreduce, {mib} MiB float32, netagg / MPI_Allreduce over TCP loopback"
                ),
                "Gbit/s",
            );
            let kernel = table.untargeted(
                &format!(
                    "the same, per byte through the kernel: netagg moves 2·{workers} tensors per job, the ring \
                     2·{}",
                    workers - 1
                ),
                "Gbit/s",
            );
            against_mpi.push((goodput, kernel, workers));
        }
    }

    let mut ddp_rows = Vec::new();
    if let Some(python) = &options.python {
        for ranks in [2, 4] {
            let row = table.untargeted(
                &format!(
                    "{ranks}-rank DDP training, small CNN, 1 MiB of gradients a step: netagg hook / gloo \
                     (examples/python/train_ddp.py)"
                ),
                "images/s",
            );
            ddp_rows.push((row, ranks, python));
        }
    }

    for run in 1..=options.runs {
        eprintln!("== run {run} of {}", options.runs);
        if let (Some(rows), Some(build)) = (against_build, &options.baseline_build) {
            let encodings = [("int32", "native"), ("float", "cpu_exponent_quantizer")];
            for (row, (kind, prepostprocessor)) in rows.into_iter().zip(encodings) {
                let [ours, baseline] = if run % 2 == 0 {
                    let baseline = dummy_allreduce(build, kind, prepostprocessor)?;
                    [dummy_allreduce(&release, kind, prepostprocessor)?, baseline]
                } else {
                    let ours = dummy_allreduce(&release, kind, prepostprocessor)?;
                    [ours, dummy_allreduce(build, kind, prepostprocessor)?]
                };
                table.push(row, ours, baseline);
            }
        }
        if options.client_path_only {
            let int32 = dummy_allreduce(&release, "int32", "native")?;
            table.push(client_int32, int32, dummy_allreduce(&release, "float", "cpu_exponent_quantizer")?);
            continue;
        }
        // Every group: `client_dummy_float32_bfp`, `..._large_packets` and `client_dummy_int32`.
        criterion("client_dummy", "client_dummy/")?;
        for (row, group) in
            [(client, "client_dummy_float32_bfp"), (client_large, "client_dummy_float32_bfp_large_packets")]
        {
            table.push(row, bytes_per_ns(group, "allreduce")?, bytes_per_ns(group, "memcpy_2_threads")?);
        }
        let int32 = dummy_allreduce(&release, "int32", "native")?;
        let float32 = dummy_allreduce(&release, "float", "cpu_exponent_quantizer")?;
        table.push(client_int32, int32, float32);
        // Goodput in Gbit/s against the memcpy's GB/s, in GB/s.
        for (row, gbps, group) in [
            (int32_vs_memcpy, int32, "client_dummy_int32"),
            (float32_vs_memcpy, float32, "client_dummy_float32_bfp"),
        ] {
            table.push(row, gbps / 8.0, bytes_per_ns(group, "memcpy_2_threads")?);
        }
        criterion("sum", "sum_(i32|f32)/1048576")?;
        for (row, group) in [(sum_int32, "sum_i32_1048576"), (sum_float32, "sum_f32_1048576")] {
            let elements = 1048576.0;
            table.push(
                row,
                elements / criterion_median_ns(group, "engine")?,
                elements / criterion_median_ns(group, "plain_add")?,
            );
        }
        for &(row, workers, config) in &via_switch {
            let ours = netagg_allreduce(&release, config, workers, numel, options.num_jobs, "int32")?;
            table.push(row, ours, relay(&release, config, workers, numel, options.num_jobs)?);
        }
        if let Some((mpirun, program)) = &mpi {
            for &(goodput, kernel, workers) in &against_mpi {
                let ours = netagg_allreduce(&release, None, workers, numel, options.num_jobs, "float")?;
                let output = json_line(
                    Command::new(mpirun)
                        .args(["--oversubscribe", "--allow-run-as-root", "--mca", "btl", "tcp,self"])
                        .args(["-n", &workers.to_string()])
                        .arg(program)
                        .args([numel.to_string(), options.num_jobs.to_string(), "1".into()]),
                )?;
                let baseline = output[0]["median_gbps"].as_f64().ok_or("MPI baseline: no median")?;
                table.push(goodput, ours, baseline);
                // Every rank's goodput times the tensors that cross the kernel per
                // tensor reduced: up and down through the switch for each of N ranks,
                // against the ring's 2(N-1)/N per rank, N ranks.
                let tensors = workers as f64;
                table.push(kernel, ours * 2.0 * tensors, baseline * 2.0 * (tensors - 1.0));
            }
        }
        for &(row, ranks, python) in &ddp_rows {
            let ours = ddp_training(&release, python, ranks, None)?;
            table.push(row, ours, ddp_training(&release, python, ranks, Some("gloo"))?);
        }
        criterion("udp_switch", "udp_switch/")?;
        for (row, group) in &in_process {
            let gbps = |function| bytes_per_ns(group, function).map(|rate| rate * 8.0);
            table.push(*row, gbps("allreduce")?, gbps("udp_echo_relay")?);
        }
    }
    table.print(options.runs);
    Ok(())
}

/// The comparisons, in the order printed.
#[derive(Default)]
struct Table {
    rows: Vec<Row>,
}

impl Table {
    /// Adds a row whose ratio should reach `target`; returns its index.
    fn row(&mut self, name: &str, unit: &'static str, target: f64) -> usize {
        self.rows.push(Row { name: name.into(), unit, target: Some(target), runs: Rounds::default() });
        self.rows.len() - 1
    }

    /// Adds a row reported without a target; returns its index.
    fn untargeted(&mut self, name: &str, unit: &'static str) -> usize {
        self.rows.push(Row { name: name.into(), unit, target: None, runs: Rounds::default() });
        self.rows.len() - 1
    }

    /// One run's figures of row `row`.
    fn push(&mut self, row: usize, ours: f64, baseline: f64) {
        self.rows[row].runs.push(ours, baseline);
    }

    fn print(&self, runs: usize) {
        println!("| comparison | ours (median) | baseline (median) | ratio, median of {runs} runs (each run's) | target |");
        println!("|---|---|---|---|---|");
        for row in self.rows.iter().filter(|r| !r.runs.is_empty()) {
            let each = each_round(row.runs.ratios(), 2);
            let ratio = row.runs.median_ratio();
            let target = row.target.map_or("—".to_string(), |t| {
                format!("≥ {t} {}", if ratio >= t { "met" } else { "**missed**" })
            });
            println!(
                "| {} | {:.3} {} | {:.3} {} | **{ratio:.2}** ({each}) | {target} |",
                row.name,
                row.runs.median_ours(),
                row.unit,
                row.runs.median_baseline(),
                row.unit
            );
        }
    }
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
    config: Option<&Path>,
    workers: usize,
    numel: usize,
    jobs: usize,
    kind: &str,
) -> Result<f64, String> {
    let mut command = Command::new(release.join("netagg-run"));
    if let Some(config) = config {
        command.env("NETAGG_CONFIG", config);
    }
    let reports = json_line(
        command
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

/// Median goodput (Gbit/s) of `udp_echo_relay` moving what `netagg_allreduce` moves, with
/// the same configuration.
fn relay(
    release: &Path,
    config: Option<&Path>,
    workers: usize,
    numel: usize,
    jobs: usize,
) -> Result<f64, String> {
    let mut command = Command::new(release.join("udp_echo_relay"));
    if let Some(config) = config {
        command.env("NETAGG_CONFIG", config);
    }
    let reports = json_line(
        command.args(["--workers", &workers.to_string(), "--tensor-numel", &numel.to_string()]).args([
            "--num-jobs",
            &jobs.to_string(),
            "--num-warmup-jobs",
            "1",
            "--json",
        ]),
    )?;
    reports[0]["summary"]["median_gbps"].as_f64().ok_or("udp_echo_relay: no median".into())
}

/// Median goodput (Gbit/s) of `allreduce_benchmark` on the dummy backend at unlimited
/// bandwidth: 4 emulated workers, 2 threads, 64 Mi elements of `kind` encoded by
/// `prepostprocessor`.
fn dummy_allreduce(release: &Path, kind: &str, prepostprocessor: &str) -> Result<f64, String> {
    let reports = json_line(
        Command::new(release.join("allreduce_benchmark"))
            .env("NETAGG_GENERAL__BACKEND", "dummy")
            .env("NETAGG_GENERAL__NUM_WORKERS", "4")
            .env("NETAGG_GENERAL__NUM_WORKER_THREADS", "2")
            .env("NETAGG_GENERAL__PREPOSTPROCESSOR", prepostprocessor)
            .env("NETAGG_BACKEND_DUMMY__BANDWIDTH", "0")
            .args(["--tensor-numel", "64Mi", "--tensor-type", kind])
            .args(["--num-jobs", "5", "--num-warmup-jobs", "1", "--json"]),
    )?;
    reports[0]["summary"]["median_gbps"].as_f64().ok_or("allreduce_benchmark: no median".into())
}

/// Images per second of `examples/python/train_ddp.py` on `ranks` ranks under netagg-run,
/// with the netagg hook or the `baseline` allreduce.
fn ddp_training(release: &Path, python: &Path, ranks: usize, baseline: Option<&str>) -> Result<f64, String> {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/python/train_ddp.py");
    let mut command = Command::new(release.join("netagg-run"));
    command.args(["-n", &ranks.to_string(), "--"]).arg(python).arg(example).args(["--steps", "60", "--json"]);
    if let Some(baseline) = baseline {
        command.args(["--baseline", baseline]);
    }
    let reports = json_line(&mut command)?;
    reports[0]["images_per_second"].as_f64().ok_or("train_ddp.py: no images_per_second".into())
}

/// Runs a command and returns every line of its output that is a JSON object, with a
/// launcher's `[rank] ` prefix removed.
fn json_line(command: &mut Command) -> Result<Vec<Value>, String> {
    let output =
        command.stderr(std::process::Stdio::null()).output().map_err(|e| format!("{command:?}: {e}"))?;
    if !output.status.success() {
        return Err(format!("{command:?} failed ({})", output.status));
    }
    let values = netagg_benches::json_objects(&String::from_utf8_lossy(&output.stdout));
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
