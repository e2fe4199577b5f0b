//! `allreduce_benchmark`: SwitchML's benchmark of the same name, run on netagg.
//!
//! Same options, same defaults and the same output lines (SwitchML's
//! `dev_root/benchmarks/allreduce_benchmark`), so numbers compare directly; its defects
//! fixed (`--sync-every 0` waits only at the end instead of dividing by zero, and
//! verification catches NaN and errors of either sign); and netagg's additions: sparse
//! tensors (`--density`), a config file (`--config`), a JSON summary (`--json`),
//! aggregated tensor elements per second, bytes on the wire against what the density
//! predicts, and, on emulated links (`--link-rate`, `--link-delay`), the time the cost
//! model of `netagg_benches::model` predicts for netagg and for a ring.
//!
//! In place, SwitchML's benchmark reduces each job's result again in the next job. With
//! sparse tensors that changes what is measured: a sum holds data wherever any rank's
//! input does, so every job after the first would run at the union's density, not the
//! stated one. Here each timed job starts from the original input, copied back before
//! its timer starts.
//!
//! Configured like any netagg program, so it runs under `netagg-run -n N --` and under
//! `mpirun` (with `NETAGG_GENERAL__CONTROLLER_IP` pointing at a running switch).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget};
use netagg::config::Origin;
use netagg::{bf16, f16, Config, Context, DataType, Element, Job, SparseMode, ThreadCounters, WirePrecision};
use netagg_benches::data::Contents;
use netagg_benches::model::{Aggregators, Bound, Link, ModelError, RackNetwork, Scenario};
use netagg_benches::parse_count;
use netagg_benches::summary::{cpp_double, goodput_gbps, Summary};
use netagg_benches::traffic::{downstream_model, upstream_model, Fractions, Traffic};
use netagg_benches::verify::Verification;
use netagg_emulate::link::{parse_duration, parse_rate};
use netagg_wire::packet::ELEMENT_LEN;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// An allreduce benchmark in the format of SwitchML's, on netagg.
#[derive(Debug, Parser)]
#[command(name = "allreduce_benchmark", version)]
struct Options {
    /// Elements per allreduce: 1000, 1M (10^6), 64Mi (64 · 2^20).
    #[arg(long, default_value = "268435456", value_parser = parse_count)]
    tensor_numel: usize,
    /// Element type: float (float32), int32, float16 (half) or bfloat16.
    #[arg(long, default_value = "int32", value_parser = parse_type)]
    tensor_type: DataType,
    /// How float32 tensors travel (`general.wire_precision`, overriding the config):
    /// float32, or float16 or bfloat16 (rounded by the workers, half the bytes).
    #[arg(long)]
    wire_precision: Option<String>,
    /// Timed jobs.
    #[arg(long, default_value_t = 10)]
    num_jobs: usize,
    /// Untimed jobs before the timed ones.
    #[arg(long, default_value_t = 5)]
    num_warmup_jobs: usize,
    /// Reduce the input buffer in place (true) or into a second buffer (false).
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    inplace: bool,
    /// Check every element of the final result.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    verify: bool,
    /// Wait for the jobs every this many jobs, and time each such group; 0 waits only at
    /// the end.
    #[arg(long, default_value_t = 1)]
    sync_every: usize,
    /// Error allowed in float results, in percent of the expected value (int32 sums must
    /// be exact; 16-bit floats on the wire are checked against a bound derived from their
    /// rounding instead, which the output states).
    #[arg(long, default_value_t = 1.0, value_parser = parse_percent)]
    err: f64,
    /// Random tensors (each rank its own); otherwise x[i] = i · (-1)^i on every rank.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    random: bool,
    /// Seed of the random tensors and of which blocks are zero; 0 takes one from the clock
    /// (rank 0's, which every rank then uses).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the context's counters and reset them at every sync.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    dump_stats: bool,
    /// Fraction of blocks (a packet's elements) that hold data, from 0 to 1; the others
    /// are zero on this rank. Below 1 it sets `general.sparse = auto`, so zero blocks stay
    /// off the wire, and in place every timed job starts from the original input (which
    /// needs `--sync-every 1`).
    #[arg(long, default_value_t = 1.0, value_parser = parse_density)]
    density: f64,
    /// A straggler, as RANK:MILLISECONDS: that rank submits each timed group this much
    /// after the others (outside its own timing), and the others wait for it.
    #[arg(long, value_parser = parse_late)]
    late: Option<(u16, u64)>,
    /// A netagg config file (otherwise the usual search: $NETAGG_CONFIG, ./netagg.cfg, ...).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The workers' link rate each way, when they run on emulated links, in tc's units:
    /// one for every rank (200mbit) or one per rank (200mbit,200mbit,20mbit). Prints the
    /// time the cost model predicts for netagg and for a ring beside the measured one.
    /// `netagg-run` sets it on the networks it emulates.
    #[arg(long, env = "EMULATED_LINK_RATES", value_parser = parse_rates)]
    link_rate: Option<Rates>,
    /// The links' one-way delay, with --link-rate: 5ms, 250us.
    #[arg(long, env = "EMULATED_LINK_DELAY", default_value = "0", value_parser = parse_duration)]
    link_delay: Duration,
    /// With --link-rate: the switches (general.switches) run on hosts of their own, each
    /// behind a link of this rate each way (no delay), for the model.
    #[arg(long, env = "EMULATED_SWITCH_HOST_RATE", value_parser = parse_rate)]
    switch_host_rate: Option<f64>,
    /// With --link-rate: one switch runs on each worker's host, behind its link, for the
    /// model.
    #[arg(long, env = "EMULATED_COLOCATED")]
    colocated: bool,
    /// With --link-rate: the workers sit in this many racks of contiguous ranks, each
    /// behind an uplink to the core, for the model.
    #[arg(long, env = "EMULATED_RACKS")]
    racks: Option<usize>,
    /// With --racks: each rack's uplink rate each way (unlimited if not given).
    #[arg(long, env = "EMULATED_UPLINK_RATE", value_parser = parse_rate)]
    uplink_rate: Option<f64>,
    /// With --racks: each rack's switch sums its rack first (a two-level tree), rather
    /// than one switch at the core summing every rank.
    #[arg(long, env = "EMULATED_TREE")]
    tree: bool,
    /// Also print the results as one line of JSON, last.
    #[arg(long)]
    json: bool,
}

/// Link rates in bits per second: one for every rank, or one per rank.
#[derive(Debug, Clone)]
struct Rates(Vec<f64>);

impl Rates {
    /// Every worker's link.
    fn links(&self, delay: Duration, workers: u16) -> Result<Vec<Link>, String> {
        let workers = usize::from(workers);
        match self.0[..] {
            [rate] => Ok(vec![Link { bits_per_second: rate, delay }; workers]),
            _ if self.0.len() == workers => {
                Ok(self.0.iter().map(|&rate| Link { bits_per_second: rate, delay }).collect())
            }
            _ => Err(format!("--link-rate has {} rates for {workers} workers", self.0.len())),
        }
    }
}

fn parse_rates(text: &str) -> Result<Rates, netagg_emulate::link::LinkError> {
    text.split(',').map(parse_rate).collect::<Result<_, _>>().map(Rates)
}

fn parse_late(text: &str) -> Result<(u16, u64), String> {
    let error = || format!("'{text}': expected RANK:MILLISECONDS, such as 3:50");
    let (rank, milliseconds) = text.split_once(':').ok_or_else(error)?;
    Ok((rank.parse().map_err(|_| error())?, milliseconds.parse().map_err(|_| error())?))
}

fn parse_type(text: &str) -> Result<DataType, String> {
    match text {
        "float" | "float32" => Ok(DataType::Float32),
        "int32" => Ok(DataType::Int32),
        "float16" | "half" => Ok(DataType::Float16),
        "bfloat16" => Ok(DataType::BFloat16),
        other => Err(format!("'{other}': expected float, int32, float16 or bfloat16")),
    }
}

fn parse_percent(text: &str) -> Result<f64, String> {
    text.parse::<f64>()
        .ok()
        .filter(|p| p.is_finite() && *p >= 0.0)
        .ok_or(format!("'{text}': expected a percentage of at least 0"))
}

fn parse_density(text: &str) -> Result<f64, String> {
    text.parse::<f64>()
        .ok()
        .filter(|d| (0.0..=1.0).contains(d))
        .ok_or(format!("'{text}': expected a fraction from 0 to 1"))
}

/// What the JSON line holds.
#[derive(Debug, serde::Serialize)]
struct Report {
    rank: u16,
    workers: u16,
    worker_threads: u16,
    packet_numel: u16,
    backend: String,
    prepostprocessor: String,
    wire_precision: String,
    sparse: bool,
    tensor_numel: usize,
    tensor_type: &'static str,
    inplace: bool,
    density: f64,
    num_jobs: usize,
    sync_every: usize,
    seed: u64,
    /// Each sync group: elements reduced and nanoseconds.
    groups: Vec<(u64, u64)>,
    summary: Option<Summary>,
    median_ate_per_second: Option<f64>,
    /// This worker's datagrams, headers included, per timed job.
    wire_bytes_sent_per_job: f64,
    wire_bytes_received_per_job: f64,
    /// This worker's traffic in each sync group.
    traffic: Vec<Traffic>,
    /// Payload per timed job over the tensor's bytes, each way, against the model.
    upstream: Fractions,
    downstream: Fractions,
    verified: Option<bool>,
    /// The cost model's prediction on the links of --link-rate, if given.
    model: Option<ModelReport>,
}

/// The cost model's times for a sync group, and the measured median against netagg's.
#[derive(Debug, serde::Serialize)]
struct ModelReport {
    netagg_ns: u64,
    /// What bounds netagg: "link rate" or "window".
    netagg_bound: &'static str,
    ring_ns: u64,
    measured_over_model: f64,
}

fn main() -> ExitCode {
    let options = Options::parse();
    // The library's warnings (a lost session, injected faults; `RUST_LOG` for more), on
    // stderr, each line with the rank and the session.
    if let Err(error) = netagg::config::logging::init("warn") {
        eprintln!("allreduce_benchmark: {error}");
        return ExitCode::from(2);
    }
    match run(&options) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("allreduce_benchmark: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Refuses options whose figures would not mean what they say.
fn check(options: &Options) -> Result<(), String> {
    if options.link_rate.is_none() && !options.link_delay.is_zero() {
        return Err("--link-delay needs --link-rate: the model needs both".into());
    }
    if options.switch_host_rate.is_some() && options.colocated {
        return Err("--switch-host-rate puts the switches on hosts of their own, --colocated on the \
                    workers': give one of them"
            .into());
    }
    let group =
        if options.sync_every == 0 { options.num_jobs } else { options.sync_every.min(options.num_jobs) };
    if options.inplace && options.density < 1.0 && group > 1 {
        return Err(format!(
            "--density {} in place needs --sync-every 1 (or --inplace false): the jobs of a sync \
             group share one buffer, so each job after a group's first would reduce the sums of \
             the one before, which hold data wherever any rank's input does",
            options.density
        ));
    }
    Ok(())
}

/// Runs the benchmark; `Ok(false)` when verification failed.
fn run(options: &Options) -> Result<bool, String> {
    check(options)?;
    let mut signals = Signals::new([SIGINT, SIGTERM]).map_err(|e| format!("signal handler: {e}"))?;
    let signal_handle = signals.handle();
    let signal_thread = std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            // The switch sees this rank's control connection close and ends the session
            // for the others, as it would for any rank that dies.
            eprintln!("Signal {signal} received: exiting.");
            std::process::exit(128 + signal);
        }
        println!("Signal handler thread is exiting");
    });
    println!("Signal handler thread started. Waiting for any signals.");

    let mut config = Config::load(options.config.as_deref()).map_err(|e| e.to_string())?;
    if options.density < 1.0 {
        // Every rank runs with the same options, so all agree on the layout.
        config.general.sparse = SparseMode::Auto;
    }
    if let Some(precision) = &options.wire_precision {
        let flag = Origin::Flag("--wire-precision".into());
        config.set_from(&flag, "general.wire_precision", precision).map_err(|e| e.to_string())?;
        config.validate()?;
    }
    if let Some(rates) = &options.link_rate {
        // Refused before the session rather than after the jobs.
        rates.links(options.link_delay, config.general.num_workers)?;
    }
    let context = Context::start(config).map_err(|e| e.to_string())?;
    println!("Transport: {}", context.transport());
    let seed = agree_on_seed(&context, options.seed)?;
    let outcome = match options.tensor_type {
        DataType::Int32 => benchmark::<i32>(&context, options, seed),
        DataType::Float32 => benchmark::<f32>(&context, options, seed),
        DataType::Float16 => benchmark::<f16>(&context, options, seed),
        DataType::BFloat16 => benchmark::<bf16>(&context, options, seed),
    };
    println!("Cleaning up.");
    context.stop();
    signal_handle.close();
    let _ = signal_thread.join();
    let report = outcome?;
    if options.json {
        println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    }
    Ok(report.verified != Some(false))
}

/// The seed every rank uses: `seed`, or when 0 rank 0's clock, shared by an allreduce
/// to which only rank 0 contributes.
fn agree_on_seed(context: &Context, seed: u64) -> Result<u64, String> {
    if seed != 0 {
        return Ok(seed);
    }
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        .max(1);
    let mine = if context.config().general.rank == 0 { clock } else { 0 };
    let mut halves = [mine as u32 as i32, (mine >> 32) as u32 as i32];
    context.allreduce(&mut halves).map_err(|e| format!("agreeing on a seed: {e}"))?;
    Ok(halves[0] as u32 as u64 | ((halves[1] as u32 as u64) << 32))
}

/// An element type the benchmark fills, sums and checks.
trait Value: Element + Default {
    const NAME: &'static str;
    /// Sums are exact (int32) rather than within `--err`.
    const EXACT: bool;
    /// What an output buffer holds before the first result (SwitchML's 123456789).
    const UNWRITTEN: Self;
    fn generate(contents: &Contents, rank: u16, index: usize) -> Self;
    /// The sum over `workers` ranks of element `index`, reduced `reductions` times (in
    /// place, each job sums the previous job's sums).
    fn expected(contents: &Contents, workers: u16, index: usize, reductions: u32) -> f64;
    fn to_f64(self) -> f64;
}

impl Value for i32 {
    const NAME: &'static str = "int32";
    const EXACT: bool = true;
    const UNWRITTEN: i32 = 123_456_789;
    fn generate(contents: &Contents, rank: u16, index: usize) -> i32 {
        contents.int32(rank, index)
    }
    fn expected(contents: &Contents, workers: u16, index: usize, reductions: u32) -> f64 {
        let sum = (0..workers).fold(0i32, |sum, rank| sum.wrapping_add(contents.int32(rank, index)));
        // The switch's int32 sums wrap, and so do these.
        sum.wrapping_mul((workers as i32).wrapping_pow(reductions.saturating_sub(1))) as f64
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Value for f32 {
    const NAME: &'static str = "float32";
    const EXACT: bool = false;
    const UNWRITTEN: f32 = 123_456_789.0;
    fn generate(contents: &Contents, rank: u16, index: usize) -> f32 {
        contents.float32(rank, index)
    }
    fn expected(contents: &Contents, workers: u16, index: usize, reductions: u32) -> f64 {
        sum_of::<f32>(contents, workers, index, reductions)
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Value for f16 {
    const NAME: &'static str = "float16";
    const EXACT: bool = false;
    const UNWRITTEN: f16 = f16::from_f32_const(12345.0);
    /// The float32 element rounded to float16: the pattern's elements past 65504 are
    /// infinite, and so are their sums.
    fn generate(contents: &Contents, rank: u16, index: usize) -> f16 {
        f16::from_f32(contents.float32(rank, index))
    }
    fn expected(contents: &Contents, workers: u16, index: usize, reductions: u32) -> f64 {
        sum_of::<f16>(contents, workers, index, reductions)
    }
    fn to_f64(self) -> f64 {
        self.into()
    }
}

impl Value for bf16 {
    const NAME: &'static str = "bfloat16";
    const EXACT: bool = false;
    const UNWRITTEN: bf16 = bf16::from_f32_const(12345.0);
    fn generate(contents: &Contents, rank: u16, index: usize) -> bf16 {
        bf16::from_f32(contents.float32(rank, index))
    }
    fn expected(contents: &Contents, workers: u16, index: usize, reductions: u32) -> f64 {
        sum_of::<bf16>(contents, workers, index, reductions)
    }
    fn to_f64(self) -> f64 {
        self.into()
    }
}

/// The float64 sum of every rank's element `index`, times `workers` for each reduction
/// after the first.
fn sum_of<T: Value>(contents: &Contents, workers: u16, index: usize, reductions: u32) -> f64 {
    let sum: f64 = (0..workers).map(|rank| T::generate(contents, rank, index).to_f64()).sum();
    sum * (workers as f64).powi(reductions.saturating_sub(1) as i32)
}

/// A 16-bit float format on the wire: what its roundings may cost a sum.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rounding16 {
    name: &'static str,
    /// The unit roundoff: half the spacing of the format's numbers at 1 (2^-11 for
    /// float16's 11 significant bits, 2^-8 for bfloat16's 8), the largest relative
    /// error of one rounding to nearest in the normal range.
    unit: f64,
    /// Half the smallest subnormal: the largest absolute error of a rounding below the
    /// normal range.
    half_subnormal: f64,
    /// The magnitude from which rounding gives infinity: the largest finite value plus
    /// half a spacing.
    overflow: f64,
    /// Whether the inputs are float32, rounded to the format by the workers (a float32
    /// tensor with `--wire-precision`); otherwise they are 16-bit already.
    narrowed: bool,
}

impl Rounding16 {
    /// The format a tensor of `data_type` travels in, if 16-bit.
    fn of(data_type: DataType, precision: WirePrecision) -> Option<Rounding16> {
        let float16 = Rounding16 {
            name: "float16",
            unit: 2f64.powi(-11),
            half_subnormal: 2f64.powi(-25),
            overflow: 65520.0,
            narrowed: false,
        };
        let bfloat16 = Rounding16 {
            name: "bfloat16",
            unit: 2f64.powi(-8),
            half_subnormal: 2f64.powi(-134),
            overflow: (2.0 - 2f64.powi(-8)) * 2f64.powi(127),
            narrowed: false,
        };
        match (data_type, precision) {
            (DataType::Float16, _) => Some(float16),
            (DataType::BFloat16, _) => Some(bfloat16),
            (DataType::Float32, WirePrecision::Float16) => Some(Rounding16 { narrowed: true, ..float16 }),
            (DataType::Float32, WirePrecision::BFloat16) => Some(Rounding16 { narrowed: true, ..bfloat16 }),
            _ => None,
        }
    }

    /// The expected sum of `workers` inputs whose sum is `sum` and whose magnitudes sum
    /// to `magnitudes`, after `reductions` in-place reductions, and the bound of a
    /// result's error: each input's rounding to 16 bits (if narrowed), the switch's
    /// float32 additions ((n - 1) · 2^-24 of the magnitudes added), and one rounding of
    /// the sum to 16 bits, per reduction. A reduction after the first sums results every
    /// rank holds, already 16-bit: n times the previous sum, with n times its error.
    fn reference(&self, workers: u16, sum: f64, magnitudes: f64, reductions: u32) -> (f64, f64) {
        let n = f64::from(workers);
        let float32_unit = 2f64.powi(-24);
        let (mut expected, mut bound) = (sum, 0.0);
        if self.narrowed {
            bound = self.unit * magnitudes + n * self.half_subnormal;
        }
        let mut added = magnitudes + bound;
        for reduction in 0..reductions.max(1) {
            if reduction > 0 {
                added = n * (expected.abs() + bound);
                expected *= n;
                bound *= n;
            }
            bound += (n - 1.0) * float32_unit * added;
            bound += self.unit * (expected.abs() + bound) + self.half_subnormal;
        }
        (expected, bound)
    }

    /// The bound as the output states it.
    fn describe(&self) -> String {
        let inputs =
            if self.narrowed { "u * sum|x| + n * e (each float32 input rounded to 16 bits) + " } else { "" };
        format!(
            "Error bound ({} on the wire, u = {}, e = {}): |result - float64 sum| <= {inputs}(n - 1) * 2^-24 * sum|x| \
             (float32 additions at the switch) + u * (|sum| + the bound so far) + e (one rounding of the \
             result), per reduction; a sum past {} is infinite. --err does not apply.",
            self.name,
            cpp_double(self.unit),
            cpp_double(self.half_subnormal),
            cpp_double(self.overflow)
        )
    }
}

/// What a result may differ by from the float64 sum of the inputs.
#[derive(Debug, Clone, Copy)]
enum Tolerance {
    /// `--err` percent (int32 exactly).
    Percent(f64),
    /// The bound of a 16-bit format's roundings.
    Rounding(Rounding16),
}

/// A progress bar on a terminal; none when the output goes to a pipe or a file.
fn progress_bar(jobs: usize) -> ProgressBar {
    let target = if std::io::stdout().is_terminal() && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    ProgressBar::with_draw_target(Some(jobs as u64), target)
}

fn benchmark<T: Value>(context: &Context, options: &Options, seed: u64) -> Result<Report, String> {
    let general = &context.config().general;
    let (rank, workers, numel) = (general.rank, general.num_workers, options.tensor_numel);
    let rounding = Rounding16::of(T::DATA_TYPE, general.wire_precision);
    let (element_size, wire_element_size) =
        (T::DATA_TYPE.size(), rounding.map_or(T::DATA_TYPE.size(), |_| 2));
    let contents = Contents {
        seed,
        random: options.random,
        density: options.density,
        // A packet's payload bytes are fixed, so 16-bit blocks hold twice the elements.
        block_numel: general.packet_numel as usize * ELEMENT_LEN / wire_element_size,
    };
    let mut input: Vec<T> = (0..numel).map(|i| T::generate(&contents, rank, i)).collect();
    // In place, a job leaves its sums in the input, and they hold data in the union of all
    // ranks' blocks: each timed group starts from this copy instead (`check` makes every
    // sparse group in place a single job).
    let original = (options.inplace && options.density < 1.0).then(|| input.clone());
    let mut output: Vec<T> = if options.inplace { Vec::new() } else { vec![T::UNWRITTEN; numel] };
    let input_pointer = input.as_mut_ptr();
    let output_pointer = if options.inplace { input_pointer } else { output.as_mut_ptr() };
    let submit = || -> Result<Job, String> {
        // SAFETY: both buffers outlive every job: each group of jobs is waited for before
        // the next is submitted, and the last before this function returns. Jobs of one
        // group share the buffers, as SwitchML's do: every job of the same size is cut
        // into the same slices for the same worker threads, and each thread runs its
        // slices in submission order, so no two jobs touch an element at once.
        unsafe {
            context.submit_raw(
                input_pointer.cast_const().cast(),
                output_pointer.cast(),
                numel,
                T::DATA_TYPE,
                None,
            )
        }
        .map_err(|e| e.to_string())
    };
    let wait = |jobs: &mut Vec<Job>| -> Result<(), String> {
        jobs.drain(..).try_for_each(|job| job.wait().map_err(|e| format!("job {} failed: {e}", job.id())))
    };

    println!("Submitting {} warmup jobs.", options.num_warmup_jobs);
    let mut jobs = (0..options.num_warmup_jobs).map(|_| submit()).collect::<Result<Vec<_>, _>>()?;
    wait(&mut jobs)?;
    println!("Warmup finished.");

    // Jobs the in-place buffer has been reduced by since it last held the input.
    let mut reductions = options.num_warmup_jobs as u32;
    let mut mark = ThreadCounters::default();
    let mut counted: Vec<ThreadCounters> = Vec::new();
    let group_size = if options.sync_every == 0 { options.num_jobs.max(1) } else { options.sync_every };
    let bar = progress_bar(options.num_jobs);
    let mut groups: Vec<(u64, Duration)> = Vec::new();
    println!("Submitting {} jobs.", options.num_jobs);
    let (mut first, mut started) = (0, Instant::now());
    for job in 0..options.num_jobs {
        if job == first {
            if let Some(original) = &original {
                // SAFETY: no job is running (the previous group was waited for), the input
                // holds `numel` elements, and `original` is another allocation as long.
                unsafe { std::ptr::copy_nonoverlapping(original.as_ptr(), input_pointer, numel) };
                reductions = 0;
                // A barrier, so that no rank's timer runs while another still copies: the
                // others' jobs would wait for its packets.
                context
                    .allreduce(&mut [0i32])
                    .map_err(|e| format!("barrier after restoring the input: {e}"))?;
            }
            if let Some((_, delay)) = options.late.filter(|&(late, _)| late == rank) {
                std::thread::sleep(Duration::from_millis(delay));
            }
            mark = context.stats().total();
            started = Instant::now();
        }
        jobs.push(submit()?);
        reductions += 1;
        let last = job + 1 == options.num_jobs;
        if (job + 1) % group_size != 0 && !last {
            continue;
        }
        wait(&mut jobs)?;
        let duration = started.elapsed();
        let elements = ((job + 1 - first) * numel) as u64;
        let range = if job == first { format!("{job}") } else { format!("{first}-{job}") };
        bar.suspend(|| {
            println!(
                "Job(s) #{range}# finished. Duration: #{}# ns Goodput: #{}# Gbps.",
                duration.as_nanos(),
                cpp_double(goodput_gbps(elements, duration))
            )
        });
        bar.inc((job + 1 - first) as u64);
        // Every slice reports its thread's counters before its job can end.
        counted.push(context.stats().total().since(&mark));
        if options.dump_stats {
            bar.suspend(|| print!("{}", context.stats()));
            context.reset_stats();
        }
        groups.push((elements, duration));
        first = job + 1;
    }
    bar.finish_and_clear();
    println!("All jobs finished.");

    let verified = options.verify.then(|| {
        let reductions = if options.inplace { reductions } else { 1 };
        let results = if options.inplace { &input } else { &output };
        verify::<T>(
            &contents,
            workers,
            rank,
            results,
            (!options.inplace).then_some(&input[..]),
            reductions,
            rounding.map_or(Tolerance::Percent(options.err), Tolerance::Rounding),
        )
    });

    let summary = Summary::of(&groups);
    println!("\n");
    if let Some(summary) = &summary {
        for line in summary.lines() {
            println!("{line}");
        }
        if element_size != 4 {
            println!(
                "Goodput counts 32 bits an element, as SwitchML's does; these elements have {}.",
                element_size * 8
            );
        }
    }
    let wire = counted.iter().fold(ThreadCounters::default(), |sum, group| sum + *group);
    let jobs_timed = options.num_jobs.max(1) as f64;
    let (sent, received) = (wire.bytes_sent as f64 / jobs_timed, wire.bytes_received as f64 / jobs_timed);
    if let Some(summary) = &summary {
        println!("Median ATE/s {}", cpp_double(summary.median_ate_per_second()));
    }
    let tensor_bytes = (numel * element_size) as f64;
    println!(
        "Wire bytes per job (this worker): {} sent, {} received ({} and {} times the tensor's {} bytes)",
        cpp_double(sent),
        cpp_double(received),
        cpp_double(sent / tensor_bytes.max(1.0)),
        cpp_double(received / tensor_bytes.max(1.0)),
        numel * element_size
    );
    let (upstream, downstream) = payload_fractions(
        &contents,
        numel,
        wire_element_size,
        rank,
        workers,
        &Traffic::of(&wire),
        jobs_timed,
    );
    print_traffic(&Traffic::of(&wire), jobs_timed, options.density, workers, &upstream, &downstream);
    let model = match (&options.link_rate, &summary) {
        (Some(rates), Some(summary)) => {
            let elements = groups.first().map_or(0, |(elements, _)| *elements);
            let window = u64::from(general.max_outstanding_packets);
            let count = context.config().switch_addresses().len();
            let server = |rate| Link { bits_per_second: rate, delay: Duration::ZERO };
            let aggregators = match options.switch_host_rate {
                _ if options.colocated => Aggregators::Colocated,
                rate if options.tree => Aggregators::Tree { switch_link: rate.map(server) },
                Some(rate) => Aggregators::Dedicated { count, link: server(rate) },
                None => Aggregators::Ideal,
            };
            let racks = options.racks.map(|count| RackNetwork {
                count,
                uplink: server(options.uplink_rate.unwrap_or(f64::INFINITY)),
            });
            let scenario = Scenario {
                links: rates.links(options.link_delay, workers)?,
                aggregators,
                racks,
                tensor_bytes: elements * wire_element_size as u64,
                packet_payload_bytes: u64::from(general.packet_numel) * ELEMENT_LEN as u64,
                window_packets: window,
            };
            Some(predict(&scenario, summary).map_err(|e| e.to_string())?)
        }
        _ => None,
    };
    Ok(Report {
        rank,
        workers,
        worker_threads: general.num_worker_threads,
        packet_numel: general.packet_numel,
        backend: format!("{:?}", general.backend).to_lowercase(),
        prepostprocessor: general.prepostprocessor.clone(),
        wire_precision: general.wire_precision.to_string(),
        sparse: general.sparse == SparseMode::Auto,
        tensor_numel: numel,
        tensor_type: T::NAME,
        inplace: options.inplace,
        density: options.density,
        num_jobs: options.num_jobs,
        sync_every: options.sync_every,
        seed,
        groups: groups.iter().map(|(e, d)| (*e, d.as_nanos() as u64)).collect(),
        median_ate_per_second: summary.as_ref().map(Summary::median_ate_per_second),
        summary,
        wire_bytes_sent_per_job: sent,
        wire_bytes_received_per_job: received,
        traffic: counted.iter().map(Traffic::of).collect(),
        upstream,
        downstream,
        verified,
        model,
    })
}

/// Prints, and returns, what the cost model predicts for a sync group in `scenario`,
/// beside the measured median.
fn predict(scenario: &Scenario, summary: &Summary) -> Result<ModelReport, ModelError> {
    let aggregated = match scenario.aggregators {
        Aggregators::Ideal => String::new(),
        Aggregators::Dedicated { count, link } => {
            format!(
                " over {count} switch hosts at {}",
                netagg_emulate::link::format_rate(link.bits_per_second as u64)
            )
        }
        Aggregators::Colocated => format!(" over {} colocated switches", scenario.links.len()),
        Aggregators::Tree { switch_link } => format!(
            " through a tree of {} rack switches{}",
            scenario.racks.map_or(1, |racks| racks.count),
            switch_link.map_or(String::new(), |link| format!(
                " on servers at {}",
                netagg_emulate::link::format_rate(link.bits_per_second as u64)
            ))
        ),
    };
    let aggregated = match scenario.racks {
        Some(racks) if racks.uplink.bits_per_second.is_finite() => format!(
            "{aggregated}, {} racks behind {} uplinks",
            racks.count,
            netagg_emulate::link::format_rate(racks.uplink.bits_per_second as u64)
        ),
        Some(racks) => format!("{aggregated}, {} racks behind unlimited uplinks", racks.count),
        None => aggregated,
    };
    let (netagg, ring) = (scenario.netagg()?, scenario.ring()?);
    let bound = match netagg.bound {
        Bound::LinkRate => "link rate",
        Bound::Window => "window",
    };
    let measured_over_model = summary.median_ns as f64 / netagg.time.as_nanos().max(1) as f64;
    println!(
        "Model on these links: netagg {} s (bound by the {bound}){aggregated}, a ring {} s; measured median {} s, measured / model {}",
        cpp_double(netagg.time.as_secs_f64()),
        cpp_double(ring.as_secs_f64()),
        cpp_double(summary.median_ns as f64 / 1e9),
        cpp_double(measured_over_model)
    );
    Ok(ModelReport {
        netagg_ns: netagg.time.as_nanos() as u64,
        netagg_bound: bound,
        ring_ns: ring.as_nanos() as u64,
        measured_over_model,
    })
}

/// This worker's payload per job each way as fractions of the tensor's bytes on the wire
/// (`wire_element_size` an element): the model's, this seed's blocks' and the measured.
fn payload_fractions(
    contents: &Contents,
    numel: usize,
    wire_element_size: usize,
    rank: u16,
    workers: u16,
    traffic: &Traffic,
    jobs: f64,
) -> (Fractions, Fractions) {
    let elements = numel.max(1) as f64;
    let tensor_bytes = elements * wire_element_size as f64;
    let upstream = Fractions {
        model: upstream_model(contents.density),
        seed: contents.elements_with_data(numel, std::iter::once(rank)) as f64 / elements,
        measured: traffic.payload_sent as f64 / jobs / tensor_bytes,
    };
    let downstream = Fractions {
        model: downstream_model(contents.density, workers),
        seed: contents.elements_with_data(numel, 0..workers) as f64 / elements,
        measured: traffic.payload_received as f64 / jobs / tensor_bytes,
    };
    (upstream, downstream)
}

fn print_traffic(
    traffic: &Traffic,
    jobs: f64,
    density: f64,
    workers: u16,
    upstream: &Fractions,
    downstream: &Fractions,
) {
    let per_job = |count: u64| cpp_double(count as f64 / jobs);
    println!(
        "Upstream per job (this worker): {} data packets ({} retransmitted), {} acks ({} probes); payload {} of the tensor's bytes, model {} (this seed's blocks {}), measured / model {}",
        per_job(traffic.data_packets),
        per_job(traffic.retransmissions),
        per_job(traffic.acks),
        per_job(traffic.probes),
        cpp_double(upstream.measured),
        cpp_double(upstream.model),
        cpp_double(upstream.seed),
        cpp_double(upstream.ratio())
    );
    println!(
        "Downstream per job (this worker): {} results; payload {} of the tensor's bytes, model 1 - (1 - {})^{} = {} (this seed's blocks {}), measured / model {}",
        per_job(traffic.results),
        cpp_double(downstream.measured),
        cpp_double(density),
        workers,
        cpp_double(downstream.model),
        cpp_double(downstream.seed),
        cpp_double(downstream.ratio())
    );
}

/// Checks the results (and, out of place, that the input is unchanged) and prints
/// SwitchML's verification lines; returns whether everything is right.
fn verify<T: Value>(
    contents: &Contents,
    workers: u16,
    rank: u16,
    results: &[T],
    input: Option<&[T]>,
    reductions: u32,
    tolerance: Tolerance,
) -> bool {
    println!("Verifying final results");
    let sums = match tolerance {
        Tolerance::Rounding(rounding) => {
            println!("{}", rounding.describe());
            Verification::check_within(
                results.len(),
                rounding.overflow,
                |i| {
                    let inputs = (0..workers).map(|rank| T::generate(contents, rank, i).to_f64());
                    let (sum, magnitudes) = inputs.fold((0.0, 0.0), |(s, m), x| (s + x, m + x.abs()));
                    rounding.reference(workers, sum, magnitudes, reductions)
                },
                |i| results[i].to_f64(),
            )
        }
        Tolerance::Percent(err) => Verification::check(
            results.len(),
            T::EXACT,
            err,
            |i| T::expected(contents, workers, i, reductions),
            |i| results[i].to_f64(),
        ),
    };
    let unchanged = input.map(|input| {
        Verification::check(
            input.len(),
            true,
            0.0,
            |i| T::generate(contents, rank, i).to_f64(),
            |i| input[i].to_f64(),
        )
    });
    for mismatch in &sums.first {
        println!(
            "Verification error at output buffer index [{}]. Expected {} but found {} ({}% error).",
            mismatch.index,
            cpp_double(mismatch.expected),
            cpp_double(mismatch.found),
            cpp_double(mismatch.error_percent)
        );
    }
    if let Some(unchanged) = unchanged.as_ref().filter(|u| !u.passed()) {
        let first = &unchanged.first[0];
        println!(
            "The input buffer changed: {} elements, first at index [{}] ({} instead of {}).",
            unchanged.wrong,
            first.index,
            cpp_double(first.found),
            cpp_double(first.expected)
        );
    }
    let passed = sums.passed() && unchanged.as_ref().is_none_or(Verification::passed);
    if passed {
        println!("Data verified successfully.");
    } else {
        println!("Verification failed. There could be more errors but we do not print more than 10.");
        println!("{} of {} elements are wrong.", sums.wrong, results.len());
    }
    passed
}
