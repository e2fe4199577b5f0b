//! `emulated_compare`: netagg against MPI's ring on identical emulated networks, beside
//! the cost model of each (`netagg_benches::model`), as a Markdown table.
//!
//! For every worker count, link rate and delay asked, each run starts
//! `netagg-run -n N --link rate=R,delay=D -- allreduce_benchmark ...` (a switch and N
//! workers in network namespaces behind shaped links) and then
//! `netagg-run ... --mpi -- allreduce_mpi ...` on the same links, with OpenMPI's ring
//! algorithm (as the model, and as large allreduces use), each step's chunk sent eagerly
//! (as the model's steps are); a row gives the
//! medians over the runs of each side's median job time, the model's prediction for
//! each, the ratios, and what set the pace of each side's runs (the links, the CPU, or
//! round trips and losses: netagg-run's verdict). Extra rows: every link losing 1 %
//! of its frames, and a sparse tensor with 10 % of its blocks non-zero. Needs root,
//! iproute2 and OpenMPI (scripts/emulated-compare sets it up).

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use netagg_benches::plot::{self, Series};
use netagg_benches::predict::{faithful_region, EmulatedRun, EMULATED_RUN_COLUMNS};
use netagg_benches::summary::median_of;
use netagg_emulate::link::{parse_duration, parse_rate};

#[derive(Debug, Parser)]
#[command(name = "emulated_compare")]
struct Options {
    /// Worker counts.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    workers: Vec<usize>,
    /// Link rates, in tc's units.
    #[arg(long, value_delimiter = ',', default_value = "50mbit,100mbit")]
    rates: Vec<String>,
    /// One-way link delays.
    #[arg(long, value_delimiter = ',', default_value = "1ms,5ms")]
    delays: Vec<String>,
    /// Float32 elements of the tensor.
    #[arg(long, default_value = "1Mi", value_parser = netagg_benches::parse_count)]
    tensor_numel: usize,
    /// Timed jobs per run (after one warmup job).
    #[arg(long, default_value_t = 3)]
    num_jobs: usize,
    /// Runs of each row; the table shows medians.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The MPI baseline program (benches/mpi/allreduce.c built with mpicc).
    #[arg(long)]
    mpi_program: PathBuf,
    /// Where netagg-run and allreduce_benchmark are.
    #[arg(long)]
    bin_dir: PathBuf,
    /// Skip the extra rows (1 % loss, sparse at 10 % density).
    #[arg(long)]
    no_extra_rows: bool,
    /// Write SVG plots into this directory: time against N for each rate and delay, and
    /// where the links set the pace.
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Append each dense row to this file of emulated runs (`benches/emulated-runs.csv`'s
    /// form), for `simulate --against` to predict.
    #[arg(long)]
    csv: Option<PathBuf>,
}

/// One row's network and workload.
#[derive(Debug, Clone)]
struct Case {
    workers: usize,
    rate: String,
    delay: String,
    loss: f64,
    link: String,
    /// allreduce_benchmark's extra options (a density), and a note for the table.
    netagg_options: Vec<String>,
    note: &'static str,
}

/// One run of netagg: the slowest rank's median, the model's netagg and ring times,
/// and the launcher's verdict on the pace.
struct NetaggRun {
    median_s: f64,
    model_s: f64,
    ring_model_s: f64,
    pace: String,
}

fn main() -> std::process::ExitCode {
    let options = Options::parse();
    match run(&options) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("emulated_compare: {message}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(options: &Options) -> Result<(), String> {
    let mut cases = Vec::new();
    for &workers in &options.workers {
        for rate in &options.rates {
            for delay in &options.delays {
                cases.push(Case {
                    workers,
                    rate: rate.clone(),
                    delay: delay.clone(),
                    loss: 0.0,
                    link: format!("rate={rate},delay={delay}"),
                    netagg_options: vec![],
                    note: "",
                });
            }
        }
    }
    if !options.no_extra_rows {
        let (rate, delay) = (&options.rates[0], &options.delays[0]);
        cases.push(Case {
            workers: 4,
            rate: rate.clone(),
            delay: delay.clone(),
            loss: 0.01,
            link: format!("rate={rate},delay={delay},loss=1%"),
            netagg_options: vec![],
            note: "1 % loss each way on every link",
        });
        cases.push(Case {
            workers: 4,
            rate: rate.clone(),
            delay: delay.clone(),
            loss: 0.0,
            link: format!("rate={rate},delay={delay}"),
            netagg_options: vec!["--density".into(), "0.1".into()],
            note: "sparse: 10 % of blocks non-zero (MPI sums the dense tensor)",
        });
    }
    println!(
        "{} MiB float32, {} timed jobs after a warmup, medians of {} runs\n",
        (options.tensor_numel * 4) >> 20,
        options.num_jobs,
        options.runs
    );
    let rendezvous: Vec<String> = options
        .workers
        .iter()
        .filter(|&&workers| mpi_eager_limit(options.tensor_numel * 4, workers).is_none())
        .map(|workers| workers.to_string())
        .collect();
    if !rendezvous.is_empty() {
        println!(
            "MPI at N = {}: each step's chunk is above the {} MiB sent eagerly, so OpenMPI's rendezvous adds a round trip to each step (and at N = 2 about half the jobs take twice the model)\n",
            rendezvous.join(", "),
            MPI_EAGER_CHUNK_CAP >> 20
        );
    }
    println!(
        "| N | link | netagg s | model s | meas/model | MPI ring s | ring model s | meas/model | netagg / ring | pace: netagg / MPI |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for case in &cases {
        let mut netagg = Vec::new();
        let mut ring = Vec::new();
        for _ in 0..options.runs {
            netagg.push(netagg_run(options, case)?);
            ring.push(mpi_run(options, case)?);
        }
        let netagg_s = median_of(netagg.iter().map(|run| run.median_s));
        let model_s = median_of(netagg.iter().map(|run| run.model_s));
        let ring_model_s = median_of(netagg.iter().map(|run| run.ring_model_s));
        let ring_s = median_of(ring.iter().map(|run| run.0));
        let paces = |paces: Vec<&str>| {
            let mut paces = paces;
            paces.sort();
            paces.dedup();
            paces.join(", ")
        };
        let netagg_pace = paces(netagg.iter().map(|run| run.pace.as_str()).collect());
        let ring_pace = paces(ring.iter().map(|run| run.1.as_str()).collect());
        let link =
            if case.note.is_empty() { case.link.clone() } else { format!("{} ({})", case.link, case.note) };
        println!(
            "| {} | {link} | {netagg_s:.3} | {model_s:.3} | {:.2} | {ring_s:.3} | {ring_model_s:.3} | {:.2} | **{:.2}** | {netagg_pace} / {ring_pace} |",
            case.workers,
            netagg_s / model_s,
            ring_s / ring_model_s,
            netagg_s / ring_s,
        );
        if case.netagg_options.is_empty() {
            rows.push(Row {
                case: case.clone(),
                netagg_s,
                model_s,
                ring_s,
                ring_model_s,
                pace: (netagg_pace, ring_pace),
            });
        }
    }
    if let Some(file) = &options.csv {
        append_runs(file, options, &rows)?;
    }
    if let Some(directory) = &options.plots {
        plot_rows(directory, options, &rows)?;
    }
    Ok(())
}

/// One dense row's medians and verdicts.
struct Row {
    case: Case,
    netagg_s: f64,
    model_s: f64,
    ring_s: f64,
    ring_model_s: f64,
    /// netagg-run's verdicts of netagg's and MPI's runs.
    pace: (String, String),
}

impl Row {
    fn emulated_run(&self, options: &Options) -> Result<EmulatedRun, String> {
        // The table's verdicts, as a file of runs words them: "**CPU**, links" is "CPU; links".
        let plain = |pace: &str| pace.replace("**", "").replace(", ", "; ");
        let pace = format!("{} / {}", plain(&self.pace.0), plain(&self.pace.1));
        let error = |e: netagg_emulate::link::LinkError| e.to_string();
        Ok(EmulatedRun {
            workers: self.case.workers as u16,
            bits_per_second: parse_rate(&self.case.rate).map_err(error)? as u64,
            delay: parse_duration(&self.case.delay).map_err(error)?,
            loss: self.case.loss,
            late: None,
            tensor_numel: options.tensor_numel as u64,
            netagg_s: self.netagg_s,
            ring_s: Some(self.ring_s),
            pace,
            source: format!("emulated_compare (medians of {} runs)", options.runs),
        })
    }
}

fn append_runs(file: &Path, options: &Options, rows: &[Row]) -> Result<(), String> {
    let exists = file.exists();
    let mut text = if exists { String::new() } else { format!("{EMULATED_RUN_COLUMNS}\n") };
    for row in rows {
        text += &row.emulated_run(options)?.line();
        text.push('\n');
    }
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .map_err(|e| format!("{}: {e}", file.display()))?;
    std::io::Write::write_all(&mut out, text.as_bytes()).map_err(|e| format!("{}: {e}", file.display()))
}

/// Time against N for each rate and delay (lossless rows), and where the links set the
/// pace.
fn plot_rows(directory: &Path, options: &Options, rows: &[Row]) -> Result<(), String> {
    std::fs::create_dir_all(directory).map_err(|e| format!("{}: {e}", directory.display()))?;
    let lossless: Vec<&Row> = rows.iter().filter(|row| row.case.loss == 0.0).collect();
    for rate in &options.rates {
        for delay in &options.delays {
            let rows: Vec<&&Row> =
                lossless.iter().filter(|row| (&row.case.rate, &row.case.delay) == (rate, delay)).collect();
            let line = |value: fn(&Row) -> f64| -> Vec<(f64, f64)> {
                rows.iter().map(|row| (row.case.workers as f64, value(row))).collect()
            };
            let series = [
                Series {
                    name: "netagg, emulated".into(),
                    points: line(|row| row.netagg_s),
                    colour: 0,
                    model: false,
                },
                Series {
                    name: "netagg, model".into(),
                    points: line(|row| row.model_s),
                    colour: 0,
                    model: true,
                },
                Series {
                    name: "MPI ring, emulated".into(),
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
            let file = directory.join(format!("emulated-{rate}-{delay}.svg"));
            let title = format!(
                "{} MiB float32 on emulated links, {rate}, {delay}",
                (options.tensor_numel * 4) >> 20
            );
            plot::time_against_workers(&file, &title, "time (s)", &series)?;
            println!("wrote {}", file.display());
        }
    }
    let runs = rows.iter().map(|row| row.emulated_run(options)).collect::<Result<Vec<_>, _>>()?;
    let file = directory.join("emulated-faithful-region.svg");
    let title = "emulated networks with delays: where the links set the pace";
    plot::faithful_region(&file, title, &faithful_region(&runs))?;
    println!("wrote {}", file.display());
    Ok(())
}

fn launcher(options: &Options, case: &Case) -> Command {
    let mut command = Command::new(options.bin_dir.join("netagg-run"));
    command.args(["-n", &case.workers.to_string(), "--link", &case.link]);
    command
}

fn netagg_run(options: &Options, case: &Case) -> Result<NetaggRun, String> {
    let mut command = launcher(options, case);
    command.arg("--").arg(options.bin_dir.join("allreduce_benchmark"));
    command.args(["--tensor-type", "float32", "--tensor-numel", &options.tensor_numel.to_string()]);
    command.args(["--num-jobs", &options.num_jobs.to_string(), "--num-warmup-jobs", "1", "--json"]);
    command.args(&case.netagg_options);
    let stdout = netagg_benches::stdout_of(&mut command)?;
    let reports = netagg_benches::json_objects(&stdout);
    if reports.len() != case.workers {
        return Err(format!("{} of {} ranks reported:\n{stdout}", reports.len(), case.workers));
    }
    let field = |report: &serde_json::Value, path: &[&str]| {
        path.iter().try_fold(report, |value, key| value.get(key)).and_then(serde_json::Value::as_f64)
    };
    // Every rank waits for the slowest: the session's time is the largest median.
    let mut run = NetaggRun { median_s: 0.0, model_s: 0.0, ring_model_s: 0.0, pace: String::new() };
    for report in &reports {
        let median_ns = field(report, &["summary", "median_ns"]).ok_or("a rank's report has no median")?;
        let model_ns = field(report, &["model", "netagg_ns"]).ok_or("no model in a rank's report")?;
        let ring_ns = field(report, &["model", "ring_ns"]).ok_or("no ring model in a rank's report")?;
        run.median_s = run.median_s.max(median_ns / 1e9);
        run.model_s = model_ns / 1e9;
        run.ring_model_s = ring_ns / 1e9;
    }
    run.pace = pace(&stdout);
    Ok(run)
}

/// netagg-run's verdict, in a word.
fn pace(stdout: &str) -> String {
    let verdict = stdout.lines().find_map(|line| line.strip_prefix("netagg-run: pace: ")).unwrap_or("");
    let delay_held = !stdout.contains("DELAY NOT HELD");
    let word = if verdict.starts_with("the links") {
        "links"
    } else if verdict.starts_with("CPU-BOUND") {
        "**CPU**"
    } else if verdict.starts_with("neither") {
        "round trips"
    } else {
        "?"
    };
    if delay_held {
        word.to_string()
    } else {
        format!("{word}, **delay not held**")
    }
}

/// One run of MPI: rank 0's median, and the launcher's verdict on the pace.
fn mpi_run(options: &Options, case: &Case) -> Result<(f64, String), String> {
    let mut command = launcher(options, case);
    // The ring, which the model describes and large allreduces use: OpenMPI's tuned
    // component would otherwise pick by size and rank count (algorithm 4 is its ring).
    command
        .env("OMPI_MCA_coll_tuned_use_dynamic_rules", "1")
        .env("OMPI_MCA_coll_tuned_allreduce_algorithm", "4");
    // Each step's chunk sent eagerly, as one message, as the model's step (the chunk and one
    // path delay) has it. Above the TCP transport's 64 KiB eager limit OpenMPI asks the
    // receiver first (a rendezvous), which costs each step a round trip more; and with two
    // ranks, whose one TCP connection carries both directions' data and requests, a rank
    // whose 2 MiB was queued before its reply to the other's request held that reply (and
    // the other's data) until its own had gone: about half of all jobs then ran at twice
    // the model, the two transfers one after the other.
    if let Some(limit) = mpi_eager_limit(options.tensor_numel * 4, case.workers) {
        command.env("OMPI_MCA_btl_tcp_eager_limit", limit.to_string());
    }
    command.args(["--mpi", "--"]).arg(absolute(&options.mpi_program)?);
    command.args([options.tensor_numel.to_string(), options.num_jobs.to_string(), "1".into()]);
    let stdout = netagg_benches::stdout_of(&mut command)?;
    let report = netagg_benches::json_objects(&stdout).into_iter().next().ok_or("MPI printed no JSON")?;
    let median_s = report["median_ns"].as_f64().map(|ns| ns / 1e9).ok_or("MPI's report has no median_ns")?;
    Ok((median_s, pace(&stdout)))
}

/// Room above a chunk for OpenMPI's own headers in an eager message (a few tens of bytes).
const MPI_HEADER_ALLOWANCE: usize = 4096;

/// The largest chunk sent eagerly. OpenMPI's TCP transport gives every rank 8 buffers of
/// the eager limit when it starts (`btl_tcp_free_list_num`) and 32 more whenever they run
/// out, and a connection receiving takes one whole (the limit being above its 128 KiB
/// `btl_tcp_max_send_size`): at this cap, 32 MiB a rank up front.
const MPI_EAGER_CHUNK_CAP: usize = 4 << 20;

/// The eager limit that sends each ring step's chunk of a `tensor_bytes` tensor over
/// `workers` ranks as one message, or `None` (OpenMPI's own limit, and the rendezvous) for a
/// chunk above `MPI_EAGER_CHUNK_CAP`: a larger limit would cost memory and gain nothing.
fn mpi_eager_limit(tensor_bytes: usize, workers: usize) -> Option<usize> {
    let chunk_bytes = tensor_bytes.div_ceil(workers);
    (chunk_bytes <= MPI_EAGER_CHUNK_CAP).then_some(chunk_bytes + MPI_HEADER_ALLOWANCE)
}

/// mpirun starts the program in other namespaces, from their working directory: it
/// needs an absolute path.
fn absolute(path: &Path) -> Result<PathBuf, String> {
    std::fs::canonicalize(path).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_up_to_the_cap_go_eagerly_with_room_for_headers() {
        // The default 4 MiB tensor.
        assert_eq!(mpi_eager_limit(4 << 20, 2), Some((2 << 20) + MPI_HEADER_ALLOWANCE));
        assert_eq!(mpi_eager_limit(4 << 20, 8), Some((512 << 10) + MPI_HEADER_ALLOWANCE));
        // A chunk that does not divide evenly is rounded up, not cut.
        assert_eq!(mpi_eager_limit(10, 3), Some(4 + MPI_HEADER_ALLOWANCE));
        assert_eq!(mpi_eager_limit(8 << 20, 2), Some(MPI_EAGER_CHUNK_CAP + MPI_HEADER_ALLOWANCE));
    }

    #[test]
    fn chunks_above_the_cap_leave_openmpi_its_own_limit() {
        assert_eq!(mpi_eager_limit((8 << 20) + 2, 2), None);
        assert_eq!(mpi_eager_limit(64 << 20, 8), None);
        assert_eq!(mpi_eager_limit(64 << 20, 16), Some(MPI_EAGER_CHUNK_CAP + MPI_HEADER_ALLOWANCE));
    }
}
