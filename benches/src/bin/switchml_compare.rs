//! `switchml_compare`: netagg's client path beside SwitchML's, CPU against CPU, as a
//! Markdown table. `scripts/switchml-compare` builds SwitchML's benchmark and runs it.
//!
//! Both libraries run their dummy backends (no network, the switch's sum emulated in the
//! client) with 4 emulated workers, 2 worker threads, 256-element packets, 256 slots and
//! no bandwidth limit; int32, and float32 through each one's block floating point
//! (netagg's `cpu_exponent_quantizer` against SwitchML's). Rounds alternate which program
//! runs first; each round runs each program with 9 timed jobs and with 1 under
//! `perf stat`, so that the CPU time of one job is their difference over 8 (start-up and
//! the tensors' generation cancel out), and takes the 9-job run's median goodput.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::Parser;
use netagg_benches::rounds::Rounds;

#[derive(Debug, Parser)]
#[command(name = "switchml_compare")]
struct Options {
    /// SwitchML's allreduce_benchmark, built with its dummy backend.
    #[arg(long)]
    switchml_benchmark: PathBuf,
    /// netagg's allreduce_benchmark; by default the one beside this program.
    #[arg(long)]
    netagg_benchmark: Option<PathBuf>,
    /// Rounds of both programs and both types; the summary shows medians.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Elements of the tensor.
    #[arg(long, default_value = "64Mi", value_parser = netagg_benches::parse_count)]
    numel: usize,
}

/// Timed jobs of the long run and of the short one, whose difference is the CPU time of
/// `LONG_JOBS - SHORT_JOBS` jobs.
const LONG_JOBS: usize = 9;
const SHORT_JOBS: usize = 1;

/// SwitchML's configuration, read from `switchml.cfg` in its working directory: the
/// settings that `NETAGG_SETTINGS` gives netagg.
const SWITCHML_CONFIG: &str = "[general]
rank = 0
num_workers = 4
num_worker_threads = 2
max_outstanding_packets = 256
packet_numel = 256
backend = dummy
scheduler = fifo
prepostprocessor = cpu_exponent_quantizer
instant_job_completion = false
controller_ip = 127.0.0.1
controller_port = 50099
timeout = 10
timeout_threshold = 100
timeout_threshold_increment = 100
[backend.dummy]
bandwidth = 0
process_packets = true
";

/// netagg's settings as environment variables, those of [`SWITCHML_CONFIG`] but the
/// prepostprocessor, which goes with the element type.
const NETAGG_SETTINGS: [(&str, &str); 6] = [
    ("NETAGG_GENERAL__BACKEND", "dummy"),
    ("NETAGG_GENERAL__NUM_WORKERS", "4"),
    ("NETAGG_GENERAL__NUM_WORKER_THREADS", "2"),
    ("NETAGG_GENERAL__PACKET_NUMEL", "256"),
    ("NETAGG_GENERAL__MAX_OUTSTANDING_PACKETS", "256"),
    ("NETAGG_BACKEND_DUMMY__BANDWIDTH", "0"),
];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Program {
    Netagg,
    SwitchMl,
}

impl Program {
    fn name(self) -> &'static str {
        match self {
            Program::Netagg => "netagg",
            Program::SwitchMl => "SwitchML",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum TensorType {
    Int32,
    Float32,
}

impl TensorType {
    /// `--tensor-type` as both benchmarks spell it.
    fn argument(self) -> &'static str {
        match self {
            TensorType::Int32 => "int32",
            TensorType::Float32 => "float",
        }
    }

    /// netagg's prepostprocessor for this type: SwitchML's ignores int32 tensors.
    fn netagg_prepostprocessor(self) -> &'static str {
        match self {
            TensorType::Int32 => "native",
            TensorType::Float32 => "cpu_exponent_quantizer",
        }
    }
}

const TYPES: [TensorType; 2] = [TensorType::Int32, TensorType::Float32];

/// One program's figures of one round and type.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Measured {
    /// The median goodput of the long run's jobs.
    gbps: f64,
    /// CPU milliseconds of one job: the long run's task-clock less the short run's, per
    /// job between them.
    cpu_ms_per_job: f64,
}

/// One type's rounds: goodput netagg against SwitchML, and CPU per job SwitchML against
/// netagg (the table's ratio: above 1, netagg spends less).
#[derive(Debug, Clone, Default)]
struct TypeRounds {
    goodput: Rounds,
    cpu: Rounds,
}

impl TypeRounds {
    fn push(&mut self, netagg: Measured, switchml: Measured) {
        self.goodput.push(netagg.gbps, switchml.gbps);
        self.cpu.push(switchml.cpu_ms_per_job, netagg.cpu_ms_per_job);
    }
}

struct Benchmarks<'a> {
    netagg: &'a Path,
    switchml: &'a Path,
    /// The working directory of every run, with SwitchML's `switchml.cfg` and perf's
    /// output.
    directory: &'a Path,
    numel: usize,
}

fn main() -> ExitCode {
    let options = Options::parse();
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("switchml_compare: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(options: &Options) -> Result<(), String> {
    Command::new("perf")
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run perf ({e}): install linux-perf"))?;
    let netagg = match &options.netagg_benchmark {
        Some(path) => path.clone(),
        None => std::env::current_exe()
            .map_err(|e| format!("cannot find this program's directory: {e}"))?
            .with_file_name("allreduce_benchmark"),
    };
    for program in [&netagg, &options.switchml_benchmark] {
        if !program.is_file() {
            return Err(format!("{} is not a file", program.display()));
        }
    }
    let directory = tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
    let config = directory.path().join("switchml.cfg");
    std::fs::write(&config, SWITCHML_CONFIG)
        .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
    let benchmarks = Benchmarks {
        netagg: &netagg,
        switchml: &options.switchml_benchmark,
        directory: directory.path(),
        numel: options.numel,
    };

    println!("{TABLE_HEADER}");
    println!("|---|---|---|---|---|---|---|");
    let mut rounds = [TypeRounds::default(), TypeRounds::default()];
    for round in 1..=options.rounds {
        for (tensor_type, type_rounds) in TYPES.into_iter().zip(&mut rounds) {
            // The order alternates each round, so that neither program always runs first.
            let (netagg, switchml) = if round % 2 == 1 {
                let netagg = benchmarks.measure(Program::Netagg, tensor_type)?;
                (netagg, benchmarks.measure(Program::SwitchMl, tensor_type)?)
            } else {
                let switchml = benchmarks.measure(Program::SwitchMl, tensor_type)?;
                (benchmarks.measure(Program::Netagg, tensor_type)?, switchml)
            };
            println!("{}", table_row(round, tensor_type, netagg, switchml));
            type_rounds.push(netagg, switchml);
        }
    }
    for (tensor_type, type_rounds) in TYPES.into_iter().zip(&rounds) {
        println!("{}", summary_line(tensor_type, type_rounds));
    }
    Ok(())
}

const TABLE_HEADER: &str =
    "| round | type | netagg Gbit/s | SwitchML Gbit/s | netagg CPU ms/job | SwitchML CPU ms/job \
                            | CPU ratio (SwitchML / netagg) |";

fn table_row(round: usize, tensor_type: TensorType, netagg: Measured, switchml: Measured) -> String {
    format!(
        "| {round} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
        tensor_type.argument(),
        netagg.gbps,
        switchml.gbps,
        netagg.cpu_ms_per_job,
        switchml.cpu_ms_per_job,
        switchml.cpu_ms_per_job / netagg.cpu_ms_per_job
    )
}

fn summary_line(tensor_type: TensorType, rounds: &TypeRounds) -> String {
    format!(
        "{}: median goodput netagg {:.2}, SwitchML {:.2} Gbit/s; median CPU per job, SwitchML / netagg: {:.2}",
        tensor_type.argument(),
        rounds.goodput.median_ours(),
        rounds.goodput.median_baseline(),
        rounds.cpu.median_ratio()
    )
}

impl Benchmarks<'_> {
    /// One program's figures for one type: its long run and its short one.
    fn measure(&self, program: Program, tensor_type: TensorType) -> Result<Measured, String> {
        let (gbps, long_cpu_ms) = self.run(program, tensor_type, LONG_JOBS)?;
        let (_, short_cpu_ms) = self.run(program, tensor_type, SHORT_JOBS)?;
        Ok(Measured { gbps, cpu_ms_per_job: (long_cpu_ms - short_cpu_ms) / (LONG_JOBS - SHORT_JOBS) as f64 })
    }

    /// The median goodput and the CPU milliseconds (perf's task-clock) of one run of
    /// `jobs` timed jobs after one warmup job.
    fn run(&self, program: Program, tensor_type: TensorType, jobs: usize) -> Result<(f64, f64), String> {
        let perf_output = self.directory.join("perf.csv");
        let mut command = Command::new("perf");
        command.current_dir(self.directory);
        command.args(["stat", "-x,", "-e", "task-clock", "-o"]).arg(&perf_output).arg("--");
        match program {
            Program::Netagg => {
                command.arg(self.netagg).envs(NETAGG_SETTINGS).env_remove("NETAGG_CONFIG");
                command.env("NETAGG_GENERAL__PREPOSTPROCESSOR", tensor_type.netagg_prepostprocessor());
            }
            Program::SwitchMl => {
                command.arg(self.switchml);
            }
        }
        command.args(["--tensor-numel", &self.numel.to_string(), "--tensor-type", tensor_type.argument()]);
        command.args(["--num-jobs", &jobs.to_string(), "--num-warmup-jobs", "1"]);
        if program == Program::Netagg {
            command.arg("--json");
        }
        let what = format!("{}'s {} run of {jobs} jobs", program.name(), tensor_type.argument());
        let stdout = netagg_benches::stdout_of(&mut command).map_err(|e| format!("{what} failed: {e}"))?;
        let gbps = match program {
            Program::Netagg => netagg_median_gbps(&stdout),
            Program::SwitchMl => switchml_median_gbps(&stdout),
        }
        .ok_or_else(|| format!("{what} printed no median goodput:\n{stdout}"))?;
        let perf = std::fs::read_to_string(&perf_output)
            .map_err(|e| format!("{what}: cannot read perf's output {}: {e}", perf_output.display()))?;
        let cpu_ms =
            task_clock_ms(&perf).ok_or_else(|| format!("{what}: perf counted no task-clock:\n{perf}"))?;
        Ok((gbps, cpu_ms))
    }
}

/// The median goodput in netagg's `--json` report.
fn netagg_median_gbps(stdout: &str) -> Option<f64> {
    netagg_benches::json_objects(stdout).iter().find_map(|report| report["summary"]["median_gbps"].as_f64())
}

/// The median goodput in SwitchML's summary: `Median 8569697 ns 3.91547 Gbps`.
fn switchml_median_gbps(stdout: &str) -> Option<f64> {
    stdout.lines().find_map(|line| match line.split_whitespace().collect::<Vec<_>>()[..] {
        ["Median", _, "ns", gbps, "Gbps"] => gbps.parse().ok(),
        _ => None,
    })
}

/// The task-clock milliseconds in `perf stat -x,`'s output: `16.30,msec,task-clock,...`.
fn task_clock_ms(perf: &str) -> Option<f64> {
    perf.lines().find_map(|line| match line.split(',').collect::<Vec<_>>()[..] {
        [value, "msec", "task-clock", ..] => value.parse().ok(),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SWITCHML_OUTPUT: &str = "Signal handler thread started. Waiting for any signals.
Submitting 1 warmup jobs.
Warmup finished.
Submitting 2 jobs.
Job(s) #0# finished. Duration: #8569697# ns Goodput: #3.91547# Gbps.
Job(s) #1# finished. Duration: #4350683# ns Goodput: #7.71245# Gbps.
All jobs finished.


Min 4350683 ns 7.71245 Gbps
Max 8569697 ns 3.91547 Gbps
Median 8569697 ns 3.91547 Gbps
Mean 6460190 ns 5.19403 Gbps
Std dev 2.10951e+06 ns
Cleaning up.
Signal handler thread is exiting
";

    #[test]
    fn switchml_goodput_is_its_median_line() {
        assert_eq!(switchml_median_gbps(SWITCHML_OUTPUT), Some(3.91547));
        // A run that stopped before its summary has no figure.
        let cut = SWITCHML_OUTPUT.split("Min").next().unwrap();
        assert_eq!(switchml_median_gbps(cut), None);
        assert_eq!(switchml_median_gbps("Median 8569697 ns x Gbps\n"), None);
    }

    #[test]
    fn netagg_goodput_is_its_reports_median() {
        // The same text lines as SwitchML's, then the JSON report.
        let stdout = "Median 33976603 ns 0.138481 Gbps\n\
            {\"rank\":0,\"workers\":4,\"summary\":{\"min_ns\":8680975,\"median_ns\":33976603,\
            \"median_gbps\":0.13848096582965164,\"mean_gbps\":0.13848096582965164},\"verified\":null}\n";
        assert_eq!(netagg_median_gbps(stdout), Some(0.13848096582965164));
        assert_eq!(netagg_median_gbps("Median 33976603 ns 0.138481 Gbps\n"), None);
    }

    #[test]
    fn cpu_time_is_perfs_task_clock() {
        let perf = "# started on Fri Nov 27 08:40:01 2026\n\n\
            16.30,msec,task-clock,16295953,100.00,0.005,CPUs utilized\n";
        assert_eq!(task_clock_ms(perf), Some(16.30));
        assert_eq!(task_clock_ms("<not counted>,msec,task-clock,0,0.00,,\n"), None);
        assert_eq!(task_clock_ms("# started on Fri Nov 27 08:40:01 2026\n"), None);
    }

    #[test]
    fn rows_and_medians_pair_figures_of_the_same_round() {
        let mut rounds = TypeRounds::default();
        // SwitchML spends 1.5, then 3.0 (a slow moment for netagg), then 2.0 times netagg's CPU.
        let measured = [
            (Measured { gbps: 10.0, cpu_ms_per_job: 100.0 }, Measured { gbps: 4.0, cpu_ms_per_job: 150.0 }),
            (Measured { gbps: 2.0, cpu_ms_per_job: 100.0 }, Measured { gbps: 6.0, cpu_ms_per_job: 300.0 }),
            (Measured { gbps: 8.0, cpu_ms_per_job: 50.0 }, Measured { gbps: 5.0, cpu_ms_per_job: 100.0 }),
        ];
        for (netagg, switchml) in measured {
            rounds.push(netagg, switchml);
        }
        let (netagg, switchml) = measured[0];
        assert_eq!(
            table_row(1, TensorType::Float32, netagg, switchml),
            "| 1 | float | 10.00 | 4.00 | 100.00 | 150.00 | 1.50 |"
        );
        assert_eq!(
            TABLE_HEADER.matches('|').count(),
            table_row(1, TensorType::Int32, netagg, switchml).matches('|').count()
        );
        assert_eq!(
            summary_line(TensorType::Int32, &rounds),
            "int32: median goodput netagg 8.00, SwitchML 5.00 Gbit/s; median CPU per job, SwitchML / netagg: 2.00"
        );
    }
}
