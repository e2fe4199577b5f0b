//! netagg's benchmarks, kept in a crate of their own so that the library crates need no
//! benchmarking dependency.
//!
//! - `allreduce_benchmark` (binary): SwitchML's benchmark of the same name, option for
//!   option and line for line, plus sparse tensors, JSON and bytes on the wire;
//! - `udp_echo_relay` (binary): the baseline for allreduce through the switch, a relay
//!   that echoes every datagram, at the same datagram size and window;
//! - `soak` (binary, `scripts/soak`): ranks through a switch for as long as asked, with
//!   every fault at once and ranks killed now and then, every sum checked and the memory
//!   of the switch and the ranks sampled;
//! - criterion benches (`cargo bench -p netagg-benches --bench NAME`): `sum` (kernels
//!   against a plain add and memcpy), `codec` (quantisation against memcpy), `wire`
//!   (packet parse and build), `engine` (packets/s in memory), `client_dummy` (the whole
//!   client path with no network against a 2-thread memcpy), `udp_switch` (allreduce
//!   through a switch started in process against the UDP echo relay).
//!
//! The library holds what the binaries share and what is worth unit-testing: tensor
//! contents every rank can recompute, verification, summaries and sizes, and the traffic
//! of sparse jobs against its model, the cost model of allreduce on given links, and
//! comparisons measured in rounds, which the comparison programs print.

pub mod data;
// The cost model is the library's (`netagg.model` in Python too); its old path stays.
pub use netagg::model;
pub mod plot;
pub mod predict;
pub mod relay;
pub mod rounds;
pub mod soak;
pub mod summary;
pub mod traffic;
pub mod verify;

/// Parses an element count with an optional decimal or binary suffix: `1000`, `1M`
/// (10^6), `64Mi` (64 · 2^20), `2.5Ki`.
pub fn parse_count(text: &str) -> Result<usize, String> {
    let count = parse_size::parse_size(text)
        .map_err(|e| format!("'{text}': {e}; expected a count such as 1000, 1M or 64Mi"))?;
    usize::try_from(count).map_err(|_| format!("'{text}' is too large for this machine"))
}

/// Every line of a program's output that is a JSON object, with a launcher's prefix
/// (`[rank] `) removed.
pub fn json_objects(output: &str) -> Vec<serde_json::Value> {
    output
        .lines()
        .filter_map(|line| line.find('{').map(|start| &line[start..]))
        .filter_map(|json| serde_json::from_str(json).ok())
        .collect()
}

/// Runs a command and returns its standard output, or an error with the end of both
/// outputs.
pub fn stdout_of(command: &mut std::process::Command) -> Result<String, String> {
    let output = command.output().map_err(|e| format!("{command:?}: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    if !output.status.success() {
        let tail = |text: &str| {
            text.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
        };
        return Err(format!(
            "{command:?} failed ({}):\n{}\n{}",
            output.status,
            tail(&stdout),
            tail(&String::from_utf8_lossy(&output.stderr))
        ));
    }
    Ok(stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_take_decimal_and_binary_suffixes() {
        assert_eq!(parse_count("1000"), Ok(1000));
        assert_eq!(parse_count("1M"), Ok(1_000_000));
        assert_eq!(parse_count("64Mi"), Ok(64 << 20));
        assert_eq!(parse_count("4ki"), Ok(4096));
        assert!(parse_count("lots").unwrap_err().contains("expected a count"));
        assert!(parse_count("-5").is_err());
    }
}
