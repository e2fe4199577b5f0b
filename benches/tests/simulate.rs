//! The `simulate` binary's table: a tiny tensor on links without a bucket lands on the
//! model, and `--burst` gives the links the bucket that lets it through at once.

use std::process::Command;

/// The netagg row's simulated time and sim/model ratio for 2 workers with a 4 KiB tensor
/// at 1 Mbit/s, with `extra` options.
fn tiny_tensor_row(extra: &[&str]) -> (String, f64) {
    let output = Command::new(env!("CARGO_BIN_EXE_simulate"))
        .args(["--workers", "2", "--rates", "1mbit", "--delays", "5us", "--tensor-bytes", "4Ki"])
        .args(extra)
        .output()
        .expect("simulate starts");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    let row = stdout.lines().find(|line| line.starts_with("| 2 |")).expect("a row for N = 2");
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    // | N | link | netagg s | model s | sim/model | ...
    (cells[3].to_string(), cells[5].parse().expect("a ratio"))
}

#[test]
fn a_tiny_tensor_takes_the_models_time_on_links_without_a_bucket() {
    let (time, ratio) = tiny_tensor_row(&[]);
    assert!((0.95..1.05).contains(&ratio), "{time}, {ratio} of the model");
}

#[test]
fn a_bucket_of_64_kib_lets_a_tiny_tensor_through_in_a_round_trip() {
    let (time, ratio) = tiny_tensor_row(&["--burst", "64Ki"]);
    assert_eq!(time, "0.010 ms");
    assert!(ratio < 0.01, "{ratio}");
}

#[test]
fn a_rate_under_1_bit_per_second_is_refused_with_the_value_named() {
    for (option, value, message) in [
        ("--rates", "0.4bit", "'0.4bit' is under 1 bit/s"),
        ("--uplink", "rate=0.4bit", "rate = '0.4bit': expected a rate such as 200mbit"),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_simulate"))
            .args(["--workers", "2", "--tensor-bytes", "4Ki", "--racks", "2", option, value])
            .output()
            .expect("simulate starts");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{option} {value}: {stderr}");
        assert!(stderr.contains(&format!("invalid value '{value}' for '{option}")), "{stderr}");
        assert!(stderr.contains(message), "{stderr}");
    }
}
