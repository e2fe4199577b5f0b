//! What the tests of `netagg-run` on emulated networks share: the programs, and reading
//! what a run printed.

use std::path::PathBuf;
use std::process::Output;

pub const RUN: &str = env!("CARGO_BIN_EXE_netagg-run");

/// `allreduce_benchmark` from the benches package, built into the same folder.
pub fn benchmark() -> PathBuf {
    let path = PathBuf::from(RUN).with_file_name("allreduce_benchmark");
    assert!(path.is_file(), "{} is missing: build the workspace's binaries first", path.display());
    path
}

pub fn text(output: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// The emulated network's namespace prefix a run printed.
pub fn prefix(output: &str) -> String {
    let line = output.lines().find_map(|line| line.strip_prefix("netagg-run: emulated network: namespaces "));
    line.and_then(|rest| rest.split("-*").next()).expect("the run names its namespaces").to_string()
}

pub fn namespaces_of(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|entries| {
            entries
                .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
                .filter(|name| name.starts_with(&format!("{prefix}-")))
                .collect()
        })
        .unwrap_or_default()
}

/// The report's row of `rank`: its columns after the rank.
pub fn report_row(output: &str, rank: usize) -> Vec<String> {
    output
        .lines()
        .filter_map(|line| line.strip_prefix("netagg-run: "))
        .map(|line| line.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .find(|fields| fields.first().map(String::as_str) == Some(&rank.to_string()) && fields.len() == 7)
        .unwrap_or_else(|| panic!("no report row for rank {rank} in:\n{output}"))
}

/// "a/b" as two numbers.
pub fn pair(text: &str) -> (f64, f64) {
    let (a, b) = text.split_once('/').unwrap_or_else(|| panic!("'{text}' is not a/b"));
    (a.parse().unwrap(), b.parse().unwrap())
}
