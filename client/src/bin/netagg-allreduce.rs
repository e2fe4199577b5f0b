//! `netagg-allreduce`: one rank of a verified allreduce through netagg.
//!
//! Every rank fills its tensor with values it can recompute for every other rank, runs
//! the jobs, and checks each result element by element (exact for int32, within rounding
//! for float32). Configured like any netagg program (config file, launcher variables,
//! `NETAGG_*`), so `netagg-run -n 4 -- netagg-allreduce` runs it across 4 local workers.
//!
//! Options: `--numel N[,N...]` (default 1000000; jobs cycle through the sizes),
//! `--type int32|float32`, `--jobs N` (default 3),
//! `--async` (submit all jobs, then wait), `--out-of-place`, `--config FILE`.
//!
//! Results go to stdout; the library's warnings (`RUST_LOG` for more) to stderr.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use netagg::{Config, Context};

struct Options {
    sizes: Vec<usize>,
    float: bool,
    jobs: usize,
    asynchronous: bool,
    in_place: bool,
    config: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut options = Options {
        sizes: vec![1_000_000],
        float: false,
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
                options.float = match value("--type")?.as_str() {
                    "int32" => false,
                    "float32" | "float" => true,
                    other => return Err(format!("--type {other}: expected int32 or float32")),
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
    let (rank, workers) = (config.general.rank as usize, config.general.num_workers as usize);
    let context = Context::start(config).map_err(|e| e.to_string())?;
    let expected = |i: usize, job: usize| (0..workers).map(|r| value(r, i, job) as i64).sum::<i64>();
    let mut all_correct = true;
    let elapsed;
    let size = |job: usize| options.sizes[job % options.sizes.len()];
    let total: usize = (0..options.jobs).map(size).sum();
    if options.float {
        let inputs: Vec<Vec<f32>> = (0..options.jobs)
            .map(|job| (0..size(job)).map(|i| value(rank, i, job) as f32).collect())
            .collect();
        let (outputs, took) = run_jobs(&context, options, inputs)?;
        elapsed = took;
        for (job, output) in outputs.iter().enumerate() {
            let wrong = output
                .iter()
                .enumerate()
                .filter(|(i, v)| (**v as f64 - expected(*i, job) as f64).abs() > 1e-3)
                .count();
            all_correct &= report(rank, job, size(job), wrong);
        }
    } else {
        let inputs: Vec<Vec<i32>> =
            (0..options.jobs).map(|job| (0..size(job)).map(|i| value(rank, i, job)).collect()).collect();
        let (outputs, took) = run_jobs(&context, options, inputs)?;
        elapsed = took;
        for (job, output) in outputs.iter().enumerate() {
            let wrong = output.iter().enumerate().filter(|(i, v)| **v as i64 != expected(*i, job)).count();
            all_correct &= report(rank, job, size(job), wrong);
        }
    }
    let bits = (total * 4 * 8) as f64;
    println!(
        "rank {rank}: {} jobs, {} {} elements in {:.3} s: {:.3} Gbit/s, {:.1} M elements/s",
        options.jobs,
        total,
        if options.float { "float32" } else { "int32" },
        elapsed.as_secs_f64(),
        bits / elapsed.as_secs_f64() / 1e9,
        total as f64 / elapsed.as_secs_f64() / 1e6
    );
    print!("{}", context.stop());
    Ok(all_correct)
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
