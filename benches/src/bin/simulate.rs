//! `simulate`: predicted allreduce times from the in-memory simulator, for networks one
//! machine cannot emulate, beside the analytic model (`netagg_benches::model`).
//!
//! For every worker count, link rate, delay, loss and late rank asked, it runs netagg's
//! protocol cores through one switch and the ring's discrete model on the same simulated
//! links (`netagg_benches::predict`: links without `tbf`'s token bucket, unless `--burst`
//! gives them one, as netagg-run's have), and prints a Markdown table: the time of each, the
//! model's, their ratios, netagg / ring, and how long each took to simulate. On a network
//! of racks (`--racks R` or `--rack-workers W`, with `--uplink rate=...` or
//! `--oversubscription X`, as `netagg-run --racks R --uplink ...` builds one) netagg runs
//! as a two-level tree and as one switch at the core (`--flat`: only that), the ring
//! across the same uplinks, each beside its model. With
//! `--against FILE` it instead predicts the emulated runs recorded in FILE
//! (`benches/emulated-runs.csv`, which `emulated_compare --csv` writes) and prints each
//! beside its measurement. `--plots DIR` writes SVG plots there: time against N per
//! rate and delay, or measured against predicted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use netagg_benches::plot::{self, Agreement, Series};
use netagg_benches::predict::RackSetup;
use netagg_benches::predict::{faithful_region, rate_name, EmulatedRun, Setup};
use netagg_emulate::link::{parse_duration, parse_rate, LinkSettings};

#[derive(Debug, Parser)]
#[command(name = "simulate")]
struct Options {
    /// Worker counts.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256,1024")]
    workers: Vec<u16>,
    /// Link rates, in tc's units.
    #[arg(long, value_delimiter = ',', default_value = "10gbit,100gbit", value_parser = parse_bits)]
    rates: Vec<u64>,
    /// One-way link delays.
    #[arg(long, value_delimiter = ',', default_value = "5us,20us,50us", value_parser = parse_delay)]
    delays: Vec<Duration>,
    /// Share of frames every link loses each way (0.01: 1 %).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    losses: Vec<f64>,
    /// A late rank: the last rank starts every job this long after the others.
    #[arg(long, value_parser = parse_delay)]
    late: Option<Duration>,
    /// Bytes of the tensor.
    #[arg(long, default_value = "1Mi", value_parser = netagg_benches::parse_count)]
    tensor_bytes: usize,
    /// Bytes of each link's token bucket, which lets that many through at once after an
    /// idle spell, as `tbf` on netagg-run's links does (64Ki); 0: a link that sends every
    /// byte at its rate, as the model and the ring's simulation take it. A bucket holding
    /// a whole small job makes it take a round trip alone.
    #[arg(long, default_value = "0", value_parser = netagg_benches::parse_count)]
    burst: usize,
    /// Timed jobs, after one warm-up job.
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Also netagg with its switch on a server behind a link like the workers' (on a
    /// network of racks, every switch).
    #[arg(long)]
    server_switch: bool,
    /// With --server-switch on a flat network: this many switches sharing the session's
    /// slots, each on a server of its own (`netagg-run --switches K`).
    #[arg(
        long,
        default_value_t = 1,
        requires = "server_switch",
        conflicts_with_all = ["racks", "rack_workers"],
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    shards: u16,
    /// This many racks of contiguous ranks, each behind an uplink of its own to the core.
    #[arg(long, conflicts_with = "rack_workers")]
    racks: Option<u16>,
    /// Racks of this many workers each, whatever the worker count.
    #[arg(long)]
    rack_workers: Option<u16>,
    /// Each rack's uplink, as `netagg-run --uplink`: rate=RATE, and delay=DELAY (the
    /// emulator's uplinks have none); unlimited unless set.
    #[arg(long, value_parser = parse_uplink)]
    uplink: Option<LinkSettings>,
    /// Each uplink at its rack's links' rate together over this ratio (4: 4:1
    /// oversubscribed), instead of an --uplink rate.
    #[arg(long, value_parser = parse_ratio)]
    oversubscription: Option<f64>,
    /// One switch at the core of the racks only, no tree.
    #[arg(long)]
    flat: bool,
    /// Predict the emulated runs recorded in this file instead, beside their measurements.
    #[arg(long)]
    against: Option<PathBuf>,
    /// Write SVG plots into this directory.
    #[arg(long)]
    plots: Option<PathBuf>,
}

fn parse_bits(text: &str) -> Result<u64, String> {
    parse_rate(text).map(|rate| rate as u64).map_err(|e| e.to_string())
}

fn parse_delay(text: &str) -> Result<Duration, String> {
    parse_duration(text).map_err(|e| e.to_string())
}

fn parse_ratio(text: &str) -> Result<f64, String> {
    let ratio: f64 = text.parse().map_err(|e| format!("'{text}': {e}"))?;
    if ratio.is_finite() && ratio > 0.0 {
        Ok(ratio)
    } else {
        Err(format!("'{text}': give a finite ratio above 0"))
    }
}

fn parse_uplink(text: &str) -> Result<LinkSettings, String> {
    let settings = LinkSettings::parse(text).map_err(|e| e.to_string())?;
    match settings {
        LinkSettings { jitter: None, loss: None, queue: None, burst: None, .. } => Ok(settings),
        _ => Err(format!("'{text}': an uplink here takes rate and delay only")),
    }
}

impl Options {
    /// The network of racks of `workers` workers on links of `rate`, if one is asked for.
    fn racks(&self, workers: u16, rate: u64) -> Result<Option<RackSetup>, String> {
        let count = match (self.racks, self.rack_workers) {
            (Some(count), _) => count,
            (None, Some(size)) => workers.div_ceil(size.max(1)),
            (None, None) if self.uplink.is_some() || self.oversubscription.is_some() || self.flat => {
                return Err("--uplink, --oversubscription and --flat describe racks: give --racks or \
                            --rack-workers"
                    .into())
            }
            (None, None) => return Ok(None),
        };
        if count == 0 || count > workers {
            return Err(format!("{count} racks of {workers} workers: give 1 to {workers}"));
        }
        let largest = workers.div_ceil(count);
        let uplink_bits_per_second = match self.oversubscription {
            Some(ratio) => match (f64::from(largest) * rate as f64 / ratio) as u64 {
                0 => {
                    return Err(format!(
                        "--oversubscription: racks of {largest} at {} leave an uplink under 1 bit/s; \
                         give at most {}",
                        rate_name(rate),
                        u64::from(largest) * rate
                    ))
                }
                uplink => Some(uplink),
            },
            // The parser refuses rates under 1 bit/s.
            None => self.uplink.and_then(|uplink| uplink.rate),
        };
        let uplink_delay = self.uplink.and_then(|uplink| uplink.delay).unwrap_or_default();
        Ok(Some(RackSetup { count, uplink_bits_per_second, uplink_delay, tree: !self.flat }))
    }
}

fn main() -> std::process::ExitCode {
    let options = Options::parse();
    if options.oversubscription.is_some() && options.uplink.is_some_and(|uplink| uplink.rate.is_some()) {
        Options::command()
            .error(
                ErrorKind::ArgumentConflict,
                "--oversubscription and --uplink rate= both set the uplinks' rate: give one",
            )
            .exit();
    }
    let result = match &options.against {
        Some(file) => against(&options, file),
        None => predict(&options),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("simulate: {message}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// One way of running netagg in a row: simulated, modelled, and how long it took to
/// simulate.
struct Variant {
    simulated_s: f64,
    model_s: f64,
    wall_s: f64,
}

/// One row of predictions: netagg as the setup says (one switch or a tree), then one
/// switch at the core of the same racks (beside a tree) and the switches on servers, if
/// asked; and the ring.
struct Row {
    setup: Setup,
    variants: Vec<Variant>,
    ring_s: f64,
    ring_model_s: f64,
    ring_wall_s: f64,
}

/// The names of the netagg variants a row holds, for the table's head and the plots.
fn variant_names(options: &Options) -> Vec<String> {
    let racked = options.racks.is_some() || options.rack_workers.is_some();
    let mut names = vec![match (racked, options.flat) {
        (false, _) => "netagg",
        (true, false) => "netagg tree",
        (true, true) => "netagg, one switch at the core",
    }
    .to_string()];
    if racked && !options.flat {
        names.push("netagg, one switch at the core".to_string());
    }
    if options.server_switch {
        names.push(match (racked, options.shards) {
            (true, _) => "netagg, switches on servers".to_string(),
            (false, 1) => "netagg, switch on a server".to_string(),
            (false, shards) => format!("netagg, {shards} switches on servers"),
        });
    }
    names
}

fn simulate(setup: &Setup) -> Result<Variant, String> {
    let simulated = setup.netagg()?;
    Ok(Variant {
        simulated_s: simulated.time.as_secs_f64(),
        model_s: setup.scenario().netagg().map_err(|e| format!("{setup}: {e}"))?.time.as_secs_f64(),
        wall_s: simulated.wall.as_secs_f64(),
    })
}

fn predict(options: &Options) -> Result<(), String> {
    let names = variant_names(options);
    println!(
        "{} KiB tensors, {} timed job(s) after a warm-up; {}\n",
        options.tensor_bytes >> 10,
        options.jobs,
        names.join(", ")
    );
    let mut head = "| N | link |".to_string();
    for name in &names {
        head += &format!(" {name} s | model s | sim/model |");
    }
    head += " ring s | ring model s | sim/model | netagg / ring | simulated in: netagg / ring |";
    println!("{head}\n{}", "|---".repeat(head.matches(" |").count()) + "|");
    let mut rows = Vec::new();
    for &rate in &options.rates {
        for &delay in &options.delays {
            for &loss in &options.losses {
                for &workers in &options.workers {
                    let mut setup = Setup::new(workers, rate, delay, options.tensor_bytes as u64);
                    setup.loss = loss;
                    setup.burst_bytes = options.burst as u64;
                    setup.jobs = options.jobs;
                    setup.late = options.late.map(|late| (workers - 1, late));
                    setup.racks = options.racks(workers, rate)?;
                    let mut setups = vec![setup.clone()];
                    if let Some(racks) = setup.racks.filter(|racks| racks.tree) {
                        setups
                            .push(Setup { racks: Some(RackSetup { tree: false, ..racks }), ..setup.clone() });
                    }
                    if options.server_switch {
                        setups.push(Setup {
                            switch_on_server: true,
                            shards: options.shards,
                            ..setup.clone()
                        });
                    }
                    let variants = setups.iter().map(simulate).collect::<Result<Vec<_>, _>>()?;
                    let ring = setup.ring();
                    let row = Row {
                        variants,
                        ring_s: ring.time.as_secs_f64(),
                        ring_model_s: setup
                            .scenario()
                            .ring()
                            .map_err(|e| format!("{setup}: {e}"))?
                            .as_secs_f64(),
                        ring_wall_s: ring.wall.as_secs_f64(),
                        setup,
                    };
                    let mut line = format!("| {workers} | {} |", row.setup.network());
                    for variant in &row.variants {
                        line += &format!(
                            " {} | {} | {:.2} |",
                            seconds(variant.simulated_s),
                            seconds(variant.model_s),
                            variant.simulated_s / variant.model_s
                        );
                    }
                    let walls: Vec<String> =
                        row.variants.iter().map(|variant| format!("{:.1} s", variant.wall_s)).collect();
                    println!(
                        "{line} {} | {} | {:.2} | **{:.3}** | {} / {:.1} s |",
                        seconds(row.ring_s),
                        seconds(row.ring_model_s),
                        row.ring_s / row.ring_model_s,
                        row.variants[0].simulated_s / row.ring_s,
                        walls.join(" + "),
                        row.ring_wall_s,
                    );
                    rows.push(row);
                }
            }
        }
    }
    if let Some(directory) = &options.plots {
        plot_rows(directory, options, &names, &rows)?;
    }
    Ok(())
}

/// A ratio, in brackets when it compares with a run the machine bound.
fn ratio(value: f64, faithful: bool) -> String {
    if faithful {
        format!("{value:.2}")
    } else {
        format!("({value:.2})")
    }
}

/// A time readable at any scale: milliseconds below a second.
fn seconds(value: f64) -> String {
    if value < 1.0 {
        format!("{:.3} ms", value * 1e3)
    } else {
        format!("{value:.3} s")
    }
}

/// The network a row's plot shows: its links, and its racks' uplinks as asked for (by
/// their oversubscription, or rate), not the rack count, which changes with N.
fn plot_key(options: &Options, setup: &Setup) -> String {
    let mut key = Setup { racks: None, ..setup.clone() }.network();
    if let Some(racks) = setup.racks {
        key += &match (options.oversubscription, racks.uplink_bits_per_second) {
            (Some(ratio), _) => format!(", racks behind {ratio}:1 uplinks"),
            (None, Some(rate)) => format!(", racks behind {} uplinks", rate_name(rate)),
            (None, None) => ", racks behind unlimited uplinks".into(),
        };
        if !racks.uplink_delay.is_zero() {
            key += &format!(" of {:?}", racks.uplink_delay);
        }
    }
    key
}

/// One plot per network (rate, delay, loss, racks): time against N, simulated and
/// modelled, each netagg variant and the ring.
fn plot_rows(directory: &Path, options: &Options, names: &[String], rows: &[Row]) -> Result<(), String> {
    std::fs::create_dir_all(directory).map_err(|e| format!("{}: {e}", directory.display()))?;
    let network = |row: &Row| plot_key(options, &row.setup);
    let mut networks: Vec<String> = rows.iter().map(network).collect();
    networks.dedup();
    for name in networks {
        let rows: Vec<&Row> = rows.iter().filter(|row| network(row) == name).collect();
        let line = |value: &dyn Fn(&Row) -> f64| -> Vec<(f64, f64)> {
            rows.iter().map(|row| (f64::from(row.setup.workers), value(row) * 1e3)).collect()
        };
        let mut series = Vec::new();
        for (index, variant) in names.iter().enumerate() {
            let colour = if index == 0 { 0 } else { index + 1 };
            series.push(Series {
                name: format!("{variant}, simulated"),
                points: line(&|row| row.variants[index].simulated_s),
                colour,
                model: false,
            });
            series.push(Series {
                name: format!("{variant}, model"),
                points: line(&|row| row.variants[index].model_s),
                colour,
                model: true,
            });
        }
        series.push(Series {
            name: "ring, simulated".into(),
            points: line(&|row| row.ring_s),
            colour: 1,
            model: false,
        });
        series.push(Series {
            name: "ring, model".into(),
            points: line(&|row| row.ring_model_s),
            colour: 1,
            model: true,
        });
        let file = directory.join(format!("simulated-{}.svg", file_name(&name)));
        let title = format!("{} KiB allreduce, {name}", rows[0].setup.tensor_bytes >> 10);
        plot::time_against_workers(&file, &title, "time (ms)", &series)?;
        println!("\nwrote {}", file.display());
    }
    Ok(())
}

/// A network's name as a file name: `10gbit-5us`.
fn file_name(network: &str) -> String {
    let name: String = network
        .chars()
        .map(|c| match c {
            'µ' => 'u',
            c if c.is_ascii_alphanumeric() || c == '.' => c,
            _ => '-',
        })
        .collect();
    name.split('-').filter(|part| !part.is_empty()).collect::<Vec<_>>().join("-")
}

fn against(options: &Options, file: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let runs = EmulatedRun::parse_all(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    println!("| N | link | netagg: emulated s | simulated s | sim/emul | ring: emulated s | simulated s | sim/emul | pace: netagg / MPI | source |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut points = Vec::new();
    for run in &runs {
        let setup = run.setup();
        let (netagg_faithful, ring_faithful) = run.faithful();
        let netagg = setup.netagg()?.time.as_secs_f64();
        if netagg_faithful {
            points.push(Agreement { predicted: netagg, measured: run.netagg_s, colour: 0 });
        }
        let ring = run.ring_s.map(|measured| (measured, setup.ring().time.as_secs_f64()));
        let (ring_emulated, ring_simulated, ring_ratio) = match ring {
            Some((measured, predicted)) => {
                if ring_faithful {
                    points.push(Agreement { predicted, measured, colour: 1 });
                }
                (
                    format!("{measured:.3}"),
                    format!("{predicted:.3}"),
                    ratio(predicted / measured, ring_faithful),
                )
            }
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "| {} | {} | {:.3} | {netagg:.3} | {} | {ring_emulated} | {ring_simulated} | {ring_ratio} | {} | {} |",
            setup.workers,
            setup.network(),
            run.netagg_s,
            ratio(netagg / run.netagg_s, netagg_faithful),
            run.pace,
            run.source
        );
    }
    println!("\nA ratio in brackets compares with a run the machine, not its links, bound.");
    if let Some(directory) = &options.plots {
        std::fs::create_dir_all(directory).map_err(|e| format!("{}: {e}", directory.display()))?;
        let file = directory.join("simulated-against-emulated.svg");
        let title = "emulated runs against the simulator's predictions";
        plot::measured_against_predicted(&file, title, &["netagg", "MPI ring"], &points)?;
        println!("\nwrote {}", file.display());
        let file = directory.join("emulator-faithful-region.svg");
        let title = "emulated networks with 1-5 ms delays: where the links set the pace";
        plot::faithful_region(&file, title, &faithful_region(&runs))?;
        println!("wrote {}", file.display());
    }
    Ok(())
}
