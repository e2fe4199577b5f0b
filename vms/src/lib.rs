//! Runs one command in each of two small QEMU VMs joined by a Soft-RoCE (rdma_rxe) link,
//! so that real RDMA verbs traffic can be tested on machines whose kernel has no RDMA
//! support and no usable KVM (`scripts/softroce-vms` runs the binary).
//!
//! By concern: [`cli`] the command line; [`host`] the Debian packages and kernel version
//! the host provides; [`kernel`] Debian's kernel unpacked to what the VMs boot;
//! [`initramfs`] the VMs' root file system; [`vm`] QEMU's lifecycle (ports, deadlines,
//! reaping); [`run`] one run from the work folder's cache to the report. External
//! programs are started through [`process`], whose errors name them.

pub mod cli;
pub mod host;
pub mod initramfs;
pub mod kernel;
pub mod process;
pub mod run;
pub mod vm;

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What stops a run before its VMs have finished: each message names what is at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("could not start {command}: {source}")]
    Spawn { command: String, source: std::io::Error },
    #[error("{command} failed ({status})")]
    Failed { command: String, status: std::process::ExitStatus },
    #[error("{path}: {source}")]
    File { path: PathBuf, source: std::io::Error },
    #[error(
        "apt-cache depends linux-image-amd64 names no kernel package: is this Debian 12 with its main \
         archive in the apt sources?"
    )]
    NoKernelPackage,
    #[error("apt-get download linux-image-{version} left no package in {folder}")]
    KernelNotDownloaded { version: String, folder: PathBuf },
    #[error("a module of ({modules}) is not in linux-image-{version}'s folders ({folders})")]
    ModulesNotFound { modules: String, version: String, folders: String },
    #[error("{module} needs {dependency}, which is not in linux-image-{version}'s folders ({folders}): add its folder")]
    ModuleOutsideFolders { module: String, dependency: String, version: String, folders: String },
    #[error("found no XZ-compressed ELF vmlinux in linux-image-{version}'s vmlinuz")]
    NoVmlinux { version: String },
    #[error("{tool} is missing on this machine (from {packages})")]
    ToolMissing { tool: String, packages: String },
    #[error("waiting for QEMU failed: {0}")]
    Wait(std::io::Error),
    #[error("found no two free UDP ports on 127.0.0.1 for the VMs' link: {0}")]
    NoPorts(std::io::Error),
    #[error("could not catch Ctrl-C and TERM, which must stop the VMs: {0}")]
    Signals(std::io::Error),
    /// A signal stopped the run: the VMs were killed and reaped.
    #[error("stopped by signal {0}; the VMs were killed")]
    Interrupted(i32),
    #[error("{} links libraries this machine lacks: {}", program.display(), missing.join(" "))]
    LibrariesMissing { program: PathBuf, missing: Vec<String> },
}

/// An I/O error on a path, as an [`Error`] naming the path.
pub(crate) fn at(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::File { path: path.to_path_buf(), source }
}

/// Prints one line of the runner's own, prefixed as every line it prints is.
pub fn say(message: impl Display) {
    println!("softroce-vms: {message}");
}

/// A duration as seconds with one decimal, truncated as the step timings always were.
pub fn seconds(duration: Duration) -> String {
    format!("{}.{}", duration.as_secs(), duration.subsec_millis() / 100)
}

/// Runs one step and says how long it took.
pub fn step<T>(name: &str, work: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    let started = std::time::Instant::now();
    let result = work()?;
    say(format_args!("{name} took {} s", seconds(started.elapsed())));
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_keep_one_decimal_truncated() {
        assert_eq!(seconds(Duration::from_micros(12_987_654)), "12.9");
        assert_eq!(seconds(Duration::from_millis(40)), "0.0");
        assert_eq!(seconds(Duration::from_secs(300)), "300.0");
    }

    #[test]
    fn a_failed_step_is_not_timed_and_passes_its_error_on() {
        let result: Result<(), Error> = step("nothing", || Err(Error::NoKernelPackage));
        assert!(matches!(result, Err(Error::NoKernelPackage)));
    }
}
