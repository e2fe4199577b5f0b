//! allreduce_benchmark end to end: 2 ranks under `netagg-run` with a real switch, and a
//! dummy backend that returns packets unsummed, which verification must catch.
//!
//! `netagg-run` and `netagg-switch` are found beside the benchmark, in the same target
//! directory: `cargo test --workspace` builds them.

use std::path::PathBuf;
use std::process::{Command, Output};

fn benchmark() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_allreduce_benchmark"))
}

fn launcher() -> PathBuf {
    let path = benchmark().with_file_name("netagg-run");
    assert!(
        path.is_file(),
        "{} is missing: build the workspace's binaries (cargo build --workspace)",
        path.display()
    );
    path
}

/// Runs the benchmark on 2 ranks; returns the output and each rank's lines.
fn run_two_ranks(args: &[&str]) -> (Output, [Vec<String>; 2]) {
    let output = Command::new(launcher())
        .args(["-n", "2", "--"])
        .arg(benchmark())
        .args(args)
        .env("NETAGG_GENERAL__JOB_TIMEOUT", "20")
        .output()
        .expect("netagg-run starts");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines = [0, 1].map(|rank| {
        let prefix = format!("[{rank}] ");
        stdout.lines().filter_map(|l| l.strip_prefix(&prefix)).map(str::to_string).collect::<Vec<_>>()
    });
    (output, lines)
}

/// Asserts that `lines` hold lines starting with each of `expected`, in that order.
fn assert_in_order(lines: &[String], expected: &[&str]) {
    let mut rest = lines.iter();
    for want in expected {
        assert!(
            rest.any(|line| line.starts_with(want)),
            "no line '{want}…' in order in:\n{}",
            lines.join("\n")
        );
    }
}

fn is_job_line(line: &str) -> bool {
    // Job(s) #0# finished. Duration: #123# ns Goodput: #1.5# Gbps.
    let parts: Vec<&str> = line.split('#').collect();
    parts.len() == 7
        && parts[0] == "Job(s) "
        && parts[2] == " finished. Duration: "
        && parts[3].parse::<u64>().is_ok()
        && parts[4] == " ns Goodput: "
        && parts[5].parse::<f64>().is_ok_and(|g| g > 0.0)
        && parts[6] == " Gbps."
}

#[test]
fn two_ranks_print_switchmls_lines_and_verify_exact_int32_sums() {
    let (output, ranks) = run_two_ranks(&[
        "--tensor-numel",
        "10Ki",
        "--num-jobs",
        "3",
        "--num-warmup-jobs",
        "2",
        "--verify",
        "--err",
        "0",
        "--random",
    ]);
    assert!(output.status.success(), "{output:?}");
    for lines in &ranks {
        assert_in_order(
            lines,
            &[
                "Signal handler thread started. Waiting for any signals.",
                "Submitting 2 warmup jobs.",
                "Warmup finished.",
                "Submitting 3 jobs.",
                "Job(s) #0# finished.",
                "Job(s) #1# finished.",
                "Job(s) #2# finished.",
                "All jobs finished.",
                "Verifying final results",
                "Data verified successfully.",
                "Min ",
                "Max ",
                "Median ",
                "Mean ",
                "Std dev ",
                "Median ATE/s ",
                "Wire bytes per job",
                "Cleaning up.",
                "Signal handler thread is exiting",
            ],
        );
        assert_eq!(lines.iter().filter(|l| is_job_line(l)).count(), 3, "{lines:?}");
    }
}

#[test]
fn sparse_float_out_of_place_jobs_verify_and_send_only_their_blocks() {
    let (output, ranks) = run_two_ranks(&[
        "--tensor-numel",
        "64Ki",
        "--tensor-type",
        "float",
        "--inplace",
        "false",
        "--density",
        "0.2",
        "--num-jobs",
        "3",
        "--num-warmup-jobs",
        "1",
        "--sync-every",
        "0",
        "--verify",
        "--seed",
        "42",
        "--json",
    ]);
    assert!(output.status.success(), "{output:?}");
    for lines in &ranks {
        assert!(lines.iter().any(|l| l.starts_with("Job(s) #0-2# finished.")), "{lines:?}");
        let report: serde_json::Value =
            serde_json::from_str(lines.last().unwrap()).expect("the last line is JSON");
        assert_eq!(report["verified"], true);
        assert_eq!(report["sparse"], true);
        assert_eq!(report["seed"], 42);
        let sent = report["wire_bytes_sent_per_job"].as_f64().unwrap();
        let tensor_bytes = (64 * 1024 * 4) as f64;
        // A fifth of the blocks, headers, and one opening packet per slot.
        assert!(sent < 0.4 * tensor_bytes, "{sent} bytes sent per job of {tensor_bytes}");
    }
}

#[test]
fn results_that_are_not_sums_fail_verification() {
    // The dummy backend with process_packets = false returns each packet unsummed: every
    // result is this rank's input instead of the sum of 2.
    let output = Command::new(benchmark())
        .args([
            "--tensor-numel",
            "5000",
            "--num-jobs",
            "2",
            "--num-warmup-jobs",
            "0",
            "--verify",
            "--seed",
            "7",
        ])
        .env("NETAGG_GENERAL__BACKEND", "dummy")
        .env("NETAGG_GENERAL__NUM_WORKERS", "2")
        .env("NETAGG_GENERAL__RANK", "0")
        .env("NETAGG_BACKEND_DUMMY__BANDWIDTH", "0")
        .env("NETAGG_BACKEND_DUMMY__PROCESS_PACKETS", "false")
        .output()
        .expect("allreduce_benchmark starts");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let errors: Vec<&str> =
        stdout.lines().filter(|l| l.starts_with("Verification error at output buffer index [")).collect();
    assert_eq!(errors.len(), 10, "{stdout}");
    // x[1] = -1 on both ranks, reduced twice in place: expected -1 · 2 · 2 = -4.
    assert_eq!(
        errors[0],
        "Verification error at output buffer index [1]. Expected -4 but found -1 (75% error)."
    );
    assert!(
        stdout.contains("Verification failed. There could be more errors but we do not print more than 10.")
    );
    assert!(stdout.contains("4999 of 5000 elements are wrong."), "{stdout}");
}
