//! `simulate`: predicted allreduce times from the in-memory simulator, for networks one
//! machine cannot emulate, beside the analytic model (`netagg_benches::model`).
//!
//! For every worker count, link rate, delay, loss and late rank asked, it runs netagg's
//! protocol cores through one switch and the ring's discrete model on the same simulated
//! links (`netagg_benches::predict`), and prints a Markdown table: the time of each, the
//! model's, their ratios, netagg / ring, and how long each took to simulate. With
//! `--against FILE` it instead predicts the emulated runs recorded in FILE
//! (`benches/emulated-runs.csv`, which `emulated_compare --csv` writes) and prints each
//! beside its measurement. `--plots DIR` writes SVG plots there: time against N per
//! rate and delay, or measured against predicted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use netagg_benches::plot::{self, Agreement, Series};
use netagg_benches::predict::{faithful_region, EmulatedRun, Setup};
use netagg_emulate::link::{parse_duration, parse_rate};

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
    /// Timed jobs, after one warm-up job.
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Also netagg with its switch on a server behind a link like the workers'.
    #[arg(long)]
    server_switch: bool,
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

fn main() -> std::process::ExitCode {
    let options = Options::parse();
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

/// One row of predictions.
struct Row {
    setup: Setup,
    netagg_s: f64,
    /// netagg with its switch on a server, if asked.
    server_s: Option<f64>,
    ring_s: f64,
    model_s: f64,
    ring_model_s: f64,
}

fn predict(options: &Options) -> Result<(), String> {
    println!(
        "{} KiB tensors, {} timed job(s) after a warm-up; netagg through one switch that is the network\n",
        options.tensor_bytes >> 10,
        options.jobs
    );
    let server = if options.server_switch { " switch on a server s | server / ring |" } else { "" };
    let server_rule = if options.server_switch { "---|---|" } else { "" };
    println!("| N | link | netagg s | model s | sim/model | ring s | ring model s | sim/model | netagg / ring |{server} simulated in: netagg / ring |");
    println!("|---|---|---|---|---|---|---|---|---|---|{server_rule}");
    let mut rows = Vec::new();
    for &rate in &options.rates {
        for &delay in &options.delays {
            for &loss in &options.losses {
                for &workers in &options.workers {
                    let mut setup = Setup::new(workers, rate, delay, options.tensor_bytes as u64);
                    setup.loss = loss;
                    setup.jobs = options.jobs;
                    setup.late = options.late.map(|late| (workers - 1, late));
                    let netagg = setup.netagg()?;
                    let ring = setup.ring();
                    let server =
                        options.server_switch.then(|| Setup { switch_on_server: true, ..setup.clone() });
                    let server = server.map(|setup| setup.netagg()).transpose()?;
                    let scenario = setup.scenario();
                    let row = Row {
                        netagg_s: netagg.time.as_secs_f64(),
                        server_s: server.map(|server| server.time.as_secs_f64()),
                        ring_s: ring.time.as_secs_f64(),
                        model_s: scenario.netagg().time.as_secs_f64(),
                        ring_model_s: scenario.ring().as_secs_f64(),
                        setup,
                    };
                    let server_cells = row.server_s.map_or(String::new(), |server_s| {
                        format!(" {} | {:.2} |", seconds(server_s), server_s / row.ring_s)
                    });
                    println!(
                        "| {workers} | {} | {} | {} | {:.2} | {} | {} | {:.2} | **{:.3}** |{server_cells} {:.1} s / {:.1} s |",
                        row.setup.network(),
                        seconds(row.netagg_s),
                        seconds(row.model_s),
                        row.netagg_s / row.model_s,
                        seconds(row.ring_s),
                        seconds(row.ring_model_s),
                        row.ring_s / row.ring_model_s,
                        row.netagg_s / row.ring_s,
                        netagg.wall.as_secs_f64(),
                        ring.wall.as_secs_f64(),
                    );
                    rows.push(row);
                }
            }
        }
    }
    if let Some(directory) = &options.plots {
        plot_rows(directory, &rows)?;
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

/// One plot per network (rate, delay, loss): time against N, simulated and modelled.
fn plot_rows(directory: &Path, rows: &[Row]) -> Result<(), String> {
    std::fs::create_dir_all(directory).map_err(|e| format!("{}: {e}", directory.display()))?;
    let mut networks: Vec<String> = rows.iter().map(|row| row.setup.network()).collect();
    networks.dedup();
    for network in networks {
        let rows: Vec<&Row> = rows.iter().filter(|row| row.setup.network() == network).collect();
        let line = |value: fn(&Row) -> f64| -> Vec<(f64, f64)> {
            rows.iter().map(|row| (f64::from(row.setup.workers), value(row) * 1e3)).collect()
        };
        let series = [
            Series {
                name: "netagg, simulated".into(),
                points: line(|row| row.netagg_s),
                colour: 0,
                model: false,
            },
            Series { name: "netagg, model".into(), points: line(|row| row.model_s), colour: 0, model: true },
            Series {
                name: "ring, simulated".into(),
                points: line(|row| row.ring_s),
                colour: 1,
                model: false,
            },
            Series {
                name: "ring, model".into(),
                points: line(|row| row.ring_model_s),
                colour: 1,
                model: true,
            },
        ];
        let server: Vec<(f64, f64)> =
            rows.iter().filter_map(|row| Some((f64::from(row.setup.workers), row.server_s? * 1e3))).collect();
        let server = (!server.is_empty()).then(|| Series {
            name: "netagg, switch on a server, simulated".into(),
            points: server,
            colour: 2,
            model: false,
        });
        let series: Vec<Series> = series.into_iter().chain(server).collect();
        let file = directory.join(format!("simulated-{}.svg", file_name(&network)));
        let title = format!("{} KiB allreduce, {network}", rows[0].setup.tensor_bytes >> 10);
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
