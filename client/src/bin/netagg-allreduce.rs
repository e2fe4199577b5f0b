//! `netagg-allreduce`: one rank of a verified allreduce through netagg.
//!
//! Every rank fills its tensor with values it can recompute for every other rank, runs
//! the jobs, and checks each result element by element (exact for int32, within rounding
//! for float32, and for float16 and bfloat16 the exact sum rounded once to 16 bits, as
//! the switch returns it). Configured like any netagg program (config file, launcher variables,
//! `NETAGG_*`), so `netagg-run -n 4 -- netagg-allreduce` runs it across 4 local workers.
//!
//! Options: `--numel N[,N...]` (default 1000000; jobs cycle through the sizes),
//! `--type int32|float32|float16|bfloat16`, `--jobs N` (default 3),
//! `--async` (submit all jobs, then wait), `--out-of-place`, `--config FILE`.
//!
//! Results go to stdout; the library's warnings (`RUST_LOG` for more) to stderr.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use netagg::{bf16, f16, Config, Context, DataType, Element};

struct Options {
    sizes: Vec<usize>,
    data_type: DataType,
    jobs: usize,
    asynchronous: bool,
    in_place: bool,
    config: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut options = Options {
        sizes: vec![1_000_000],
        data_type: DataType::Int32,
        jobs: 3,
        asynchronous: false,
        in_place: true,
        config: None,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().cloned().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--numel" => {
                options.sizes = value("--numel")?
                    .split(',')
                    .map(|n| {
                        n.trim()
                            .parse()
                            .map_err(|_| format!("--numel {n}: expected whole numbers separated by commas"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--jobs" => options.jobs = value("--jobs")?.parse().map_err(|_| "--jobs takes a whole number")?,
            "--type" => {
                options.data_type = match value("--type")?.as_str() {
                    "int32" => DataType::Int32,
                    "float32" | "float" => DataType::Float32,
                    "float16" => DataType::Float16,
                    "bfloat16" => DataType::BFloat16,
                    other => {
                        return Err(format!("--type {other}: expected int32, float32, float16 or bfloat16"))
                    }
                }
            }
            "--async" => options.asynchronous = true,
            "--out-of-place" => options.in_place = false,
            "--config" => options.config = Some(PathBuf::from(value("--config")?)),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(options)
}

/// The value rank `rank` holds at element `i` of job `job`: small integers, so float32
/// sums are exact too.
fn value(rank: usize, i: usize, job: usize) -> i32 {
    ((i * 7 + rank * 131 + job * 17) % 2001) as i32 - 1000
}

/// An element type this program sums and checks.
trait Checked: Element + Default {
    /// [`value`] in this type (rounded to nearest, for the 16-bit floats).
    fn from_value(value: i32) -> Self;
    fn to_f64(self) -> f64;
    /// Whether `self` is the right result for the exact sum of the inputs, `sum`.
    fn is_sum_of(self, sum: f64) -> bool;
}

impl Checked for i32 {
    fn from_value(value: i32) -> i32 {
        value
    }
    fn to_f64(self) -> f64 {
        self.into()
    }
    fn is_sum_of(self, sum: f64) -> bool {
        f64::from(self) == sum
    }
}

impl Checked for f32 {
    fn from_value(value: i32) -> f32 {
        value as f32
    }
    fn to_f64(self) -> f64 {
        self.into()
    }
    fn is_sum_of(self, sum: f64) -> bool {
        (f64::from(self) - sum).abs() <= 1e-3
    }
}

/// The switch sums integers exactly in float32 and rounds once: the sum rounded to 16 bits,
/// bit for bit.
impl Checked for f16 {
    fn from_value(value: i32) -> f16 {
        f16::from_f64(value.into())
    }
    fn to_f64(self) -> f64 {
        self.into()
    }
    fn is_sum_of(self, sum: f64) -> bool {
        self.to_bits() == f16::from_f64(sum).to_bits()
    }
}

impl Checked for bf16 {
    fn from_value(value: i32) -> bf16 {
        bf16::from_f64(value.into())
    }
    fn to_f64(self) -> f64 {
        self.into()
    }
    fn is_sum_of(self, sum: f64) -> bool {
        self.to_bits() == bf16::from_f64(sum).to_bits()
    }
}

fn main() -> ExitCode {
    // The library's warnings (a lost session, injected faults; `RUST_LOG` for more), on
    // stderr, each line with the rank and the session.
    if let Err(error) = netagg::config::logging::init("warn") {
        eprintln!("netagg-allreduce: {error}");
        return ExitCode::from(2);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let options = match parse(&args) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("netagg-allreduce: {message}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("netagg-allreduce: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(options: &Options) -> Result<bool, String> {
    let config = Config::load(options.config.as_deref()).map_err(|e| e.to_string())?;
    let context = Context::start(config).map_err(|e| e.to_string())?;
    let (all_correct, elapsed) = match options.data_type {
        DataType::Int32 => run_verified::<i32>(&context, options)?,
        DataType::Float32 => run_verified::<f32>(&context, options)?,
        DataType::Float16 => run_verified::<f16>(&context, options)?,
        DataType::BFloat16 => run_verified::<bf16>(&context, options)?,
    };
    let rank = context.config().general.rank;
    let total: usize = (0..options.jobs).map(|job| options.sizes[job % options.sizes.len()]).sum();
    let bits = (total * options.data_type.size() * 8) as f64;
    println!(
        "rank {rank}: {} jobs, {} {} elements in {:.3} s: {:.3} Gbit/s, {:.1} M elements/s",
        options.jobs,
        total,
        options.data_type.name(),
        elapsed.as_secs_f64(),
        bits / elapsed.as_secs_f64() / 1e9,
        total as f64 / elapsed.as_secs_f64() / 1e6
    );
    print!("{}", context.stop());
    Ok(all_correct)
}

/// Runs the jobs in `T` and checks every element; returns whether all were right, and
/// how long the jobs took.
fn run_verified<T: Checked>(
    context: &Context,
    options: &Options,
) -> Result<(bool, std::time::Duration), String> {
    let general = &context.config().general;
    let (rank, workers) = (general.rank as usize, general.num_workers as usize);
    let size = |job: usize| options.sizes[job % options.sizes.len()];
    let input = |rank: usize, i: usize, job: usize| T::from_value(value(rank, i, job));
    let inputs: Vec<Vec<T>> =
        (0..options.jobs).map(|job| (0..size(job)).map(|i| input(rank, i, job)).collect()).collect();
    let (outputs, elapsed) = run_jobs(context, options, inputs)?;
    let mut all_correct = true;
    for (job, output) in outputs.iter().enumerate() {
        let expected = |i: usize| (0..workers).map(|r| input(r, i, job).to_f64()).sum::<f64>();
        let wrong = output.iter().enumerate().filter(|(i, v)| !v.is_sum_of(expected(*i))).count();
        all_correct &= report(rank, job, size(job), wrong);
    }
    Ok((all_correct, elapsed))
}

/// Runs the jobs; returns their results and the time they took (inputs ready, outputs
/// allocated: only the allreduces are timed).
fn run_jobs<T: netagg::Element + Default>(
    context: &Context,
    options: &Options,
    inputs: Vec<Vec<T>>,
) -> Result<(Vec<Vec<T>>, std::time::Duration), String> {
    let error = |e: netagg::Error| e.to_string();
    if options.asynchronous {
        let started = Instant::now();
        let jobs = inputs
            .into_iter()
            .map(|input| context.allreduce_async(input))
            .collect::<Result<Vec<_>, _>>()
            .map_err(error)?;
        let results = jobs.into_iter().map(|job| job.wait().map_err(error)).collect::<Result<Vec<_>, _>>()?;
        return Ok((results, started.elapsed()));
    }
    if !options.in_place {
        let mut outputs: Vec<Vec<T>> = inputs.iter().map(|input| vec![T::default(); input.len()]).collect();
        let started = Instant::now();
        for (input, output) in inputs.iter().zip(&mut outputs) {
            context.allreduce_into(input, output).map_err(error)?;
        }
        return Ok((outputs, started.elapsed()));
    }
    let mut results = inputs;
    let started = Instant::now();
    for input in &mut results {
        context.allreduce(input).map_err(error)?;
    }
    Ok((results, started.elapsed()))
}

fn report(rank: usize, job: usize, numel: usize, wrong: usize) -> bool {
    if wrong == 0 {
        println!("rank {rank}: job {job}: {numel} elements verified");
    } else {
        println!("rank {rank}: job {job}: {wrong} of {numel} elements WRONG");
    }
    wrong == 0
}
