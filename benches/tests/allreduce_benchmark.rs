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
        // A fifth of the blocks, and each retransmission, which a loaded machine causes, at
        // most one more block.
        let fraction = report["upstream"]["seed"].as_f64().unwrap();
        assert!((0.1..0.3).contains(&fraction), "{}", report["upstream"]);
        let blocks = 3 * (fraction * (64 * 1024 * 4) as f64).round() as u64;
        let group = &report["traffic"][0];
        let field = |key: &str| group[key].as_u64().unwrap();
        let resent = field("payload_sent").checked_sub(blocks);
        assert!(
            resent.is_some_and(|r| r <= field("retransmissions") * 1024),
            "{group}: {blocks} bytes of blocks"
        );
    }
}

#[test]
fn sparse_in_place_jobs_each_run_at_the_stated_density() {
    // In place, a job's sums hold data in the union of both ranks' blocks; were the
    // input not restored, every job after the first would send the union's blocks.
    let numel = 1 << 20;
    let (output, ranks) = run_two_ranks(&[
        "--tensor-numel",
        "1Mi",
        "--density",
        "0.1",
        "--num-jobs",
        "4",
        "--num-warmup-jobs",
        "1",
        "--verify",
        "--random",
        "--seed",
        "11",
        "--json",
    ]);
    assert!(output.status.success(), "{output:?}");
    for lines in &ranks {
        let report: serde_json::Value =
            serde_json::from_str(lines.last().unwrap()).expect("the last line is JSON");
        assert_eq!(report["verified"], true, "{lines:?}");
        let groups = report["traffic"].as_array().unwrap();
        assert_eq!(groups.len(), 4, "one sync group per job: {groups:?}");
        let packets: Vec<u64> = groups.iter().map(|g| g["data_packets"].as_u64().unwrap()).collect();
        assert!(packets.iter().all(|&p| p == packets[0]), "data packets per job: {packets:?}");
        // One packet per block with data, and an empty one for each slot (256 in all by
        // default) whose first block has none.
        let (upstream, downstream) = (&report["upstream"], &report["downstream"]);
        let number = |fractions: &serde_json::Value, key: &str| fractions[key].as_f64().unwrap();
        let blocks_with_data = number(upstream, "seed") * numel as f64 / 256.0;
        let extra = packets[0] as f64 - blocks_with_data;
        assert!((0.0..=256.0).contains(&extra), "{} packets for {blocks_with_data} blocks", packets[0]);
        // Each job sends the payload of this rank's blocks with data, and retransmissions
        // at most a full packet each; it receives the sums of the union's blocks.
        let bytes = |fractions| (number(fractions, "seed") * (numel * 4) as f64).round() as u64;
        for group in groups {
            let field = |key: &str| group[key].as_u64().unwrap();
            let resent = field("payload_sent")
                .checked_sub(bytes(upstream))
                .unwrap_or_else(|| panic!("{group}: less than this rank's blocks of {upstream}"));
            assert!(resent <= field("retransmissions") * 1024, "{group} against {upstream}");
            assert_eq!(field("payload_received"), bytes(downstream), "{group} against {downstream}");
        }
        // 4096 blocks drawn at random for each rank: near the model, 0.1 each way up and
        // 1 - 0.9^2 down.
        for (fractions, model) in [(upstream, 0.1), (downstream, 0.19)] {
            assert!((number(fractions, "model") - model).abs() < 1e-9, "{fractions}");
            let ratio = number(fractions, "seed") / model;
            assert!((0.85..1.15).contains(&ratio), "{fractions}");
        }
    }
}

#[test]
fn sparse_groups_in_place_are_refused() {
    let output = Command::new(benchmark())
        .args(["--tensor-numel", "1000", "--density", "0.5", "--num-jobs", "4", "--sync-every", "2"])
        .output()
        .expect("allreduce_benchmark starts");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--density 0.5 in place needs --sync-every 1"), "{stderr}");
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

/// One rank of a dummy session of `workers`, run alone: the backend needs no switch.
fn run_dummy(workers: &str, args: &[&str]) -> Output {
    Command::new(benchmark())
        .args(["--tensor-numel", "65536", "--num-jobs", "2", "--num-warmup-jobs", "0"])
        .args(args)
        .env("NETAGG_GENERAL__BACKEND", "dummy")
        .env("NETAGG_GENERAL__NUM_WORKERS", workers)
        .env("NETAGG_GENERAL__RANK", "0")
        .env("NETAGG_BACKEND_DUMMY__BANDWIDTH", "0")
        .output()
        .expect("allreduce_benchmark starts")
}

#[test]
fn on_given_links_the_model_s_times_are_printed_beside_the_measured_one() {
    let output = run_dummy("4", &["--link-rate", "100mbit", "--link-delay", "1ms", "--json"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    // 256 KiB in 256 packets of 1 KiB: (262144 + 256 · 94) · 8 bits at 100 Mbit/s, plus a
    // round trip of 2 ms and the last packet's serialisation down.
    let expected_ns = ((262144.0 + 256.0 * 94.0) * 8.0 / 100e6 + 0.002 + 1118.0 * 8.0 / 100e6) * 1e9;
    let line =
        stdout.lines().find(|line| line.starts_with("Model on these links: netagg ")).expect("a model line");
    assert!(line.contains("(bound by the link rate), a ring "), "{line}");
    let report: serde_json::Value =
        serde_json::from_str(stdout.lines().last().expect("a JSON line")).expect("the last line is JSON");
    let model = &report["model"];
    assert!((model["netagg_ns"].as_f64().unwrap() - expected_ns).abs() < 2.0, "{model}");
    assert_eq!(model["netagg_bound"], "link rate");
    let measured = report["summary"]["median_ns"].as_f64().unwrap();
    let ratio = model["measured_over_model"].as_f64().unwrap();
    assert!((ratio - measured / model["netagg_ns"].as_f64().unwrap()).abs() < 1e-9, "{model}");

    let output = run_dummy("4", &["--link-rate", "100mbit,200mbit"]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--link-rate has 2 rates for 4 workers"), "{stderr}");
    let output = run_dummy("4", &["--link-delay", "1ms"]);
    assert!(String::from_utf8_lossy(&output.stderr).contains("--link-delay needs --link-rate"));
}

/// On a host whose kernel has no RDMA (this one, and CI's), `backend = rdma` ends the
/// benchmark with the error that says so and how to get a device, not a crash or a hang.
#[test]
fn without_an_rdma_device_the_benchmark_says_so_and_how_to_get_one() {
    if std::path::Path::new("/sys/class/infiniband").exists() {
        return; // A host with RDMA devices: the VM tests cover it.
    }
    let output = Command::new(benchmark())
        .args(["--tensor-numel", "1024", "--num-jobs", "1"])
        .env("NETAGG_GENERAL__BACKEND", "rdma")
        .env_remove("NETAGG_CONFIG")
        .output()
        .expect("allreduce_benchmark starts");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("backend.rdma: no RDMA device: this kernel has no RDMA support"), "{stderr}");
    assert!(stderr.contains("rdma link add rxe0 type rxe netdev eth0"), "{stderr}");
    assert!(stderr.contains("backend = udp needs none"), "{stderr}");
}

#[test]
fn sixteen_bit_jobs_verify_within_the_stated_bound_and_send_two_bytes_an_element() {
    // Random inputs differ by rank, so the sums are real sums, checked against the
    // float64 sum of the inputs; in place, 3 jobs after a warm-up reduce 4 times.
    let sixteen_bit: [&[&str]; 2] =
        [&["--tensor-type", "float16"], &["--tensor-type", "float", "--wire-precision", "bfloat16"]];
    for args in sixteen_bit {
        let (output, ranks) = run_two_ranks(
            &[
                args,
                &[
                    "--tensor-numel",
                    "10Ki",
                    "--num-jobs",
                    "3",
                    "--num-warmup-jobs",
                    "1",
                    "--verify",
                    "--random",
                ],
                &["--seed", "5", "--json"],
            ]
            .concat(),
        );
        assert!(output.status.success(), "{args:?}: {output:?}");
        for lines in &ranks {
            assert_in_order(
                lines,
                &["Verifying final results", "Error bound (", "Data verified successfully."],
            );
            let report: serde_json::Value =
                serde_json::from_str(lines.last().unwrap()).expect("the last line is JSON");
            assert_eq!(report["verified"], true, "{args:?}: {lines:?}");
            // The whole tensor once per job, at 2 bytes an element (4 would make it 2), and
            // what a loaded machine retransmits.
            let measured = report["upstream"]["measured"].as_f64().unwrap();
            assert!((1.0..1.5).contains(&measured), "{args:?}: {}", report["upstream"]);
            // Packets of float32's 1024 payload bytes: 512 16-bit elements each, so 10Ki
            // elements take 20 packets a job, where float32 takes 40.
            for group in report["traffic"].as_array().unwrap() {
                assert_eq!(group["data_packets"], 20, "{args:?}: {group}");
                assert_eq!(group["payload_sent"], 20 * 1024, "{args:?}: {group}");
            }
        }
    }
}
