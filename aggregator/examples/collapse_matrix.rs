//! Prints the collapse matrix of `tests/collapse.rs`: each job's time as a multiple of
//! the time the busiest link allows, with what lies behind it: the queues' drops (and of
//! those, the ones on the way down), the workers' retransmissions, timeouts and requests,
//! and the results the switch sent again.
//!
//! `cargo run -p netagg-aggregator --example collapse_matrix [jobs] [seeds] [case]`, a case
//! named as `dense-0.01-10-1000` (mode, loss, Mbit/s, queue bytes; `-b8000` after it for
//! a bucket); a summary per mode and job closes the output.

#[path = "../tests/support/collapse.rs"]
mod collapse;

use collapse::Case;

fn main() {
    let jobs: usize = std::env::args().nth(1).map_or(3, |arg| arg.parse().expect("jobs"));
    let seeds: u64 = std::env::args().nth(2).map_or(1, |arg| arg.parse().expect("seeds"));
    let only: Option<String> = std::env::args().nth(3);
    // Per mode and job: the sum of log ratios, their count, and the largest.
    let mut summary = std::collections::BTreeMap::<(bool, usize), (f64, u32, f64)>::new();
    let mut worst = 0.0f64;
    for seed in 0..seeds {
        for case in [false, true].into_iter().flat_map(Case::all) {
            let name = case.name();
            if only.as_ref().is_some_and(|only| *only != name) {
                continue;
            }
            let mut line = format!("{name:24} |");
            for (job, (report, ratio)) in case.run(seed, jobs).into_iter().enumerate() {
                worst = worst.max(ratio);
                let entry = summary.entry((case.sparse, job)).or_default();
                entry.0 += ratio.ln();
                entry.1 += 1;
                entry.2 = entry.2.max(ratio);
                let resent: u64 = report.workers.iter().map(|w| w.retransmissions).sum();
                let timeouts: u64 = report.workers.iter().map(|w| w.timeouts).sum();
                let asked: u64 = report.workers.iter().map(|w| w.acks_sent).sum();
                line += &format!(
                    " {ratio:6.2} ({} drop, {} down, {resent} re, {timeouts} to, {asked} ack, {} res)",
                    report.queue_drops, report.queue_drops_down, report.switch.results_resent
                );
            }
            println!("{line}");
        }
    }
    for ((sparse, job), (logs, count, max)) in summary {
        let mode = if sparse { "sparse" } else { "dense" };
        println!(
            "{mode} job {job}: geometric mean {:.2}, max {max:.2} over {count}",
            (logs / count as f64).exp()
        );
    }
    println!("worst {worst:.2}");
}
