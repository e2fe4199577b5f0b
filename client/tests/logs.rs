//! The log output of real processes: a `netagg-switch` and two `netagg-allreduce` ranks
//! writing their logs into a file and a pipe.

mod common;

use std::time::Duration;

use common::{Switch, Worker};

#[test]
fn logs_to_a_file_or_a_pipe_are_plain_one_line_per_event_with_rank_and_session() {
    let scratch = common::scratch_dir("logs");
    let work = scratch.path();
    let switch_log = work.join("switch.log");
    let switch = Switch::start_logging("info", &switch_log);
    // A session name with a line break: each event that names it stays one line, and
    // the text after the break forges none.
    let session = format!("{}\nERROR forged", common::unique_session("logs"));
    // An empty NO_COLOR counts as unset: only the pipe keeps the colours off.
    let env = [("RUST_LOG", "info"), ("NO_COLOR", "")];
    let workers: Vec<Worker> =
        (0..2).map(|rank| Worker::start(&switch, rank, 2, &session, &env, &["--numel", "1000"])).collect();
    let logs: Vec<String> = workers
        .into_iter()
        .enumerate()
        .map(|(rank, worker)| {
            let (success, stdout, stderr) = worker.finish(Duration::from_secs(60));
            assert!(success, "rank {rank}:\n{stdout}\n{stderr}");
            stderr
        })
        .collect();
    let counters = switch.stop();
    assert!(counters.lines().any(|l| l.starts_with("stats: datagrams")), "final counters:\n{counters}");
    let switch_log = std::fs::read_to_string(&switch_log).unwrap();

    let escaped = session.replace('\n', "\\n");
    for (rank, log) in logs.iter().enumerate() {
        assert!(!log.contains("\x1b["), "rank {rank} coloured its log into a pipe:\n{log}");
        let started: Vec<&str> = log.lines().filter(|l| l.contains("context started")).collect();
        assert_eq!(started.len(), 1, "rank {rank}:\n{log}");
        let context = format!("worker{{rank={rank} name={escaped} session=0x");
        assert!(started[0].contains(&context), "rank {rank}: no '{context}' in:\n{log}");
    }
    assert!(!switch_log.contains("\x1b["), "the switch coloured its log into a file:\n{switch_log}");
    let registered: Vec<&str> = switch_log.lines().filter(|l| l.contains("worker registered")).collect();
    assert_eq!(registered.len(), 2, "{switch_log}");
    assert!(registered.iter().all(|l| l.contains(&format!("name={escaped} "))), "{switch_log}");
    for log in logs.iter().chain([&switch_log]) {
        assert!(!log.lines().any(|l| l.starts_with("ERROR forged")), "a forged line in:\n{log}");
        // Every line is an event: its timestamp, then its level.
        let is_event = |line: &str| {
            line.split_whitespace().nth(1).is_some_and(|level| ["ERROR", "WARN", "INFO"].contains(&level))
        };
        assert!(log.lines().all(is_event), "a line that is not an event in:\n{log}");
    }
}
