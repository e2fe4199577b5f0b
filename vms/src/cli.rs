//! The command line: the same options, defaults and checks as the script it replaced.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;

/// vm0's default command: the server of a pingpong over an RC queue pair.
const DEFAULT_VM0: &str = "ibv_rc_pingpong -d rxe0 -g 1";
/// vm1's default command: the pingpong's client, retrying because the server's VM may
/// still be booting when the client's is ready. `$PEER_IP` is the VM's, not the host's.
const DEFAULT_VM1: &str =
    "for i in $(seq 60); do ibv_rc_pingpong -d rxe0 -g 1 \"$PEER_IP\" && exit 0; sleep 1; done; exit 1";

/// Runs one command in each of two small QEMU VMs joined by a Soft-RoCE (rdma_rxe) link,
/// so that real RDMA verbs traffic can be tested on machines whose kernel has no RDMA
/// support and no usable KVM. Debian 12 on x86-64 only. Installs what is missing, builds
/// Debian's stock kernel (which has rdma_rxe as a module) and an initramfs once per kernel
/// version under the work folder, boots both VMs under TCG, prints their consoles, and
/// fails if either command failed or a VM did not finish in time. Safe to run again, and
/// in parallel; each run's consoles and share stay in <work>/runs/.
///
/// Each command runs with `sh` as the last step of the VM's init, in /mnt, the run folder
/// shared with the host (its files stay there after the run), with VM_INDEX (0 or 1),
/// VM_IP and PEER_IP (10.77.0.1 and 10.77.0.2) set and the RDMA device rxe0 up; its GID
/// for VM_IP (::ffff:10.77.0.x) is at index 1. The VMs do not boot in lockstep: the side
/// that connects must retry for tens of seconds, as the default vm1 command does.
#[derive(Debug, Parser)]
#[command(name = "softroce-vms", bin_name = "softroce-vms", args_override_self = true)]
pub struct Args {
    /// Run in the VM at 10.77.0.1 (default: an ibv_rc_pingpong server)
    #[arg(long, value_name = "COMMAND", default_value = DEFAULT_VM0, hide_default_value = true, allow_hyphen_values = true)]
    pub vm0: String,
    /// Run in the VM at 10.77.0.2 (default: an ibv_rc_pingpong client, retrying for 60 s
    /// until the server answers)
    #[arg(long, value_name = "COMMAND", default_value = DEFAULT_VM1, hide_default_value = true, allow_hyphen_values = true)]
    pub vm1: String,
    /// Also put this program and the libraries it links in the VMs' /usr/bin
    /// (repeatable), e.g. a test binary built with cargo
    #[arg(long = "bin", value_name = "PATH", value_parser = executable_file)]
    pub bins: Vec<PathBuf>,
    /// Kill a VM that has not finished after this long
    #[arg(long, value_name = "SECONDS", default_value = "300", value_parser = whole_seconds, allow_hyphen_values = true)]
    pub timeout: Duration,
    /// Where the kernel, initramfs and runs are kept [default: ${CARGO_TARGET_DIR:-target}/softroce]
    #[arg(long, value_name = "DIR", value_parser = absolute)]
    pub work: Option<PathBuf>,
}

impl Args {
    /// Both VMs' commands, by VM index.
    pub fn commands(&self) -> [&str; 2] {
        [&self.vm0, &self.vm1]
    }

    /// The work folder: `--work`, or `softroce` in the workspace's target folder
    /// (`CARGO_TARGET_DIR`, relative to the workspace's root, or its `target`).
    pub fn work(&self) -> PathBuf {
        let workspace =
            Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the crate is in the workspace");
        let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| "target".into(), PathBuf::from);
        self.work.clone().unwrap_or_else(|| workspace.join(target).join("softroce"))
    }
}

/// `--timeout`: a whole number of seconds, at least one, digits only.
fn whole_seconds(text: &str) -> Result<Duration, String> {
    let digits_only = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) && !text.starts_with('0');
    match text.parse() {
        Ok(seconds) if digits_only => Ok(Duration::from_secs(seconds)),
        _ => Err("expected a whole number of seconds".into()),
    }
}

/// `--bin`: resolved now, so that the run may work from any folder, and executable.
fn executable_file(text: &str) -> Result<PathBuf, String> {
    let path = std::fs::canonicalize(text).map_err(|_| "no such file".to_string())?;
    match path.metadata() {
        Ok(metadata) if metadata.is_file() && metadata.permissions().mode() & 0o111 != 0 => Ok(path),
        _ => Err(format!("{}: not an executable file", path.display())),
    }
}

/// `--work`: absolute, whether or not it exists yet.
fn absolute(text: &str) -> Result<PathBuf, String> {
    std::path::absolute(text).map_err(|error| error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("softroce-vms").chain(args.iter().copied()))
    }

    #[test]
    fn the_defaults_are_a_pingpong_with_a_retrying_client_and_five_minutes() {
        let args = parse(&[]).unwrap();
        assert_eq!(args.commands(), [DEFAULT_VM0, DEFAULT_VM1]);
        assert!(args.bins.is_empty());
        assert_eq!(args.timeout, Duration::from_secs(300));
        assert!(args.work().ends_with("target/softroce") || std::env::var_os("CARGO_TARGET_DIR").is_some());
        assert!(args.work().is_absolute());
    }

    #[test]
    fn options_take_their_values_and_the_last_of_a_repeated_one_wins() {
        let args =
            parse(&["--vm0", "exit 1", "--vm0", "exit 2", "--vm1", "-x", "--timeout", "120", "--work", "w"])
                .unwrap();
        assert_eq!(args.commands(), ["exit 2", "-x"]);
        assert_eq!(args.timeout, Duration::from_secs(120));
        assert_eq!(args.work(), std::env::current_dir().unwrap().join("w"));
    }

    #[test]
    fn bins_are_resolved_repeatable_and_must_be_executable_files() {
        let folder = tempfile::tempdir().unwrap();
        let program = folder.path().join("program");
        std::fs::write(&program, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(folder.path().join("sub")).unwrap();
        let plain = folder.path().join("plain");
        std::fs::write(&plain, "").unwrap();
        let relative = folder.path().join("sub/../program");
        let args = parse(&["--bin", relative.to_str().unwrap(), "--bin", "/bin/sh"]).unwrap();
        assert_eq!(
            args.bins,
            [program.canonicalize().unwrap(), PathBuf::from("/bin/sh").canonicalize().unwrap()]
        );
        let error = parse(&["--bin", plain.to_str().unwrap()]).unwrap_err().to_string();
        assert!(error.contains("not an executable file"), "{error}");
        let error = parse(&["--bin", folder.path().to_str().unwrap()]).unwrap_err().to_string();
        assert!(error.contains("not an executable file"), "{error}");
        let error = parse(&["--bin", "/nonexistent"]).unwrap_err().to_string();
        assert!(error.contains("no such file"), "{error}");
    }

    #[test]
    fn a_timeout_is_a_positive_whole_number_of_seconds() {
        for bad in ["0", "012", "-5", "+5", "1.5", "5s", "", "99999999999999999999999"] {
            let error = parse(&["--timeout", bad]).unwrap_err().to_string();
            assert!(error.contains("expected a whole number of seconds"), "{bad}: {error}");
        }
    }

    #[test]
    fn missing_values_and_unknown_arguments_are_refused() {
        assert!(parse(&["--vm0"]).is_err());
        assert!(parse(&["--frobnicate"]).is_err());
        assert!(parse(&["stray"]).is_err());
        let help = parse(&["--help"]).unwrap_err();
        assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp);
        let text = help.to_string();
        for option in ["--vm0", "--vm1", "--bin", "--timeout", "--work", "Soft-RoCE", "PEER_IP"] {
            assert!(text.contains(option), "{option}: {text}");
        }
    }
}
