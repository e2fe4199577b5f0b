//! What the tests of `netagg-run` share: the programs they run, and reading what a run
//! printed.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const RUN: &str = env!("CARGO_BIN_EXE_netagg-run");

/// A program of another package of the workspace (`netagg-switch`, `allreduce_benchmark`,
/// `netagg-allreduce`), from the folder `netagg-run` was built into: cargo names only this
/// package's programs to its tests, and builds no other package's.
pub fn program(name: &str) -> PathBuf {
    let folder = Path::new(RUN).parent().expect("netagg-run lies in a folder");
    let path = folder.join(name);
    let profile = if folder.ends_with("release") { " --release" } else { "" };
    assert!(
        path.is_file(),
        "{} is missing: build the workspace's binaries (cargo build --workspace --bins{profile})",
        path.display()
    );
    path
}

/// `netagg-run`, once the `netagg-switch` it starts is at hand beside it: without one
/// there it would start whichever is first on the PATH.
pub fn launcher_path() -> &'static str {
    program("netagg-switch");
    RUN
}

/// A command of [`launcher_path`].
pub fn launcher() -> Command {
    Command::new(launcher_path())
}

/// `allreduce_benchmark` from the benches package.
pub fn benchmark() -> PathBuf {
    program("allreduce_benchmark")
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
    labelled_row(output, &rank.to_string())
}

/// The report's row labelled `label` (a rank, or a switch host's `s0`, `s1`, ...).
pub fn labelled_row(output: &str, label: &str) -> Vec<String> {
    output
        .lines()
        .filter_map(|line| line.strip_prefix("netagg-run: "))
        .map(|line| line.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .find(|fields| fields.first().map(String::as_str) == Some(label) && fields.len() == 7)
        .unwrap_or_else(|| panic!("no report row for {label} in:\n{output}"))
}

/// "a/b" as two numbers.
pub fn pair(text: &str) -> (f64, f64) {
    let (a, b) = text.split_once('/').unwrap_or_else(|| panic!("'{text}' is not a/b"));
    (a.parse().unwrap(), b.parse().unwrap())
}

/// The counters a rack's switch printed of what went up and came down: `field`'s value
/// on the `[rack r] stats: uplink` line.
pub fn uplink(all: &str, rack: usize, field: &str) -> u64 {
    let prefix = format!("[rack {rack}] stats: uplink ");
    let line = all
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix}in:\n{all}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|&word| word == field).unwrap_or_else(|| panic!("no {field} in {line}"));
    words[at + 1].parse().unwrap()
}
