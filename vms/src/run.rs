//! One run: the packages, the kernel and base initramfs (built once per kernel under the
//! work folder's lock), the run's own folder, both VMs, and the report.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use rustix::fs::FlockOperation;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::cli::Args;
use crate::initramfs;
use crate::kernel::Kernel;
use crate::vm::{self, Boot, Ended, Ending, Machines};
use crate::{at, host, say, seconds, step, Error};

/// Whether both commands succeeded.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
}

/// Runs both commands in their VMs and reports each console and result.
pub fn run(args: &Args) -> Result<Outcome, Error> {
    let started = Instant::now();
    step("packages", host::install_packages)?;
    let work = args.work();
    let kernel = Kernel::new(&work, &host::kernel_version()?);
    prepare_kernel(&work, &kernel)?;
    let runs = work.join("runs");
    fs::create_dir_all(&runs).map_err(at(&runs))?;
    let run = tempfile::Builder::new()
        .prefix(&format!("{}-", folder_stamp(SystemTime::now())))
        .rand_bytes(4)
        .tempdir_in(&runs)
        .map_err(at(&runs))?
        .keep();
    // The initramfs is the only large file of a run, and can be rebuilt.
    let initrd = RemovedOnDrop(run.join("initrd.gz"));
    step(&format!("run folder {}", run.display()), || prepare_run(&kernel, &run, args, &initrd.0))?;
    let boot = Boot { vmlinux: &kernel.vmlinux(), initrd: &initrd.0, run: &run };
    let (ended, started_at) = step("VMs", || run_vms(&boot, args))?;
    let succeeded = report(&run, &ended, started_at, args);
    drop(initrd);
    if succeeded {
        say(format_args!("both commands succeeded; whole run {} s", seconds(started.elapsed())));
        Ok(Outcome::Succeeded)
    } else {
        say(format_args!("failed; whole run {} s; results in {}", seconds(started.elapsed()), run.display()));
        Ok(Outcome::Failed)
    }
}

/// Makes sure the kernel folder and its base initramfs are built. Runs sharing a work
/// folder (parallel tests) build them once: the others wait on the lock, then find them
/// cached.
fn prepare_kernel(work: &Path, kernel: &Kernel) -> Result<(), Error> {
    fs::create_dir_all(work).map_err(at(work))?;
    let lock_path = work.join("lock");
    let lock = File::create(&lock_path).map_err(at(&lock_path))?;
    rustix::fs::flock(&lock, FlockOperation::LockExclusive).map_err(|errno| at(&lock_path)(errno.into()))?;
    let version = &kernel.version;
    if kernel.vmlinux().is_file() {
        say(format_args!("kernel {version}: cached in {}", kernel.folder.display()));
    } else {
        let deb = match kernel.deb() {
            Some(deb) => deb,
            None => step(&format!("download of linux-image-{version}"), || kernel.download())?,
        };
        step(&format!("kernel {version} (extract modules, depmod, vmlinux)"), || kernel.build(&deb))?;
    }
    let inputs = initramfs::base_inputs(kernel)?;
    if initramfs::base_is_current(kernel, &inputs) {
        say(format_args!("initramfs: cached in {}", initramfs::base_archive(kernel).display()));
    } else {
        step("initramfs (busybox, modules, verbs tools)", || initramfs::build_base(kernel, &inputs))?;
    }
    Ok(())
}

/// A run's own folder: the initramfs with this run's init and `--bin` programs, and the
/// share with the commands (their consoles and results come later).
fn prepare_run(kernel: &Kernel, run: &Path, args: &Args, initrd: &Path) -> Result<(), Error> {
    let share = run.join("share");
    fs::create_dir_all(&share).map_err(at(&share))?;
    initramfs::write_run_initrd(kernel, run, &args.bins, initrd)?;
    for (index, command) in args.commands().iter().enumerate() {
        let script = share.join(format!("vm{index}.sh"));
        fs::write(&script, format!("{command}\n")).map_err(at(&script))?;
    }
    Ok(())
}

/// Boots both VMs and waits for both; a Ctrl-C or TERM meanwhile kills them.
fn run_vms(boot: &Boot, args: &Args) -> Result<(Vec<Ended>, SystemTime), Error> {
    let ports = vm::free_udp_ports().map_err(Error::NoPorts)?;
    let mut signals = Signals::new([SIGINT, SIGTERM]).map_err(Error::Signals)?;
    let machines = Machines::start(
        (0..2).map(|index| (boot.qemu(index, ports), boot.run.join(format!("vm{index}.qemu.log")))),
        args.timeout,
    )?;
    let started_at = machines.started_at;
    Ok((machines.wait(|| signals.pending().next())?, started_at))
}

/// Prints each console, then what became of each VM; false if either failed.
fn report(run: &Path, ended: &[Ended], started_at: SystemTime, args: &Args) -> bool {
    for index in 0..ended.len() {
        print_prefixed(&run.join(format!("vm{index}.console")), &format!("[vm{index}]"));
    }
    let mut succeeded = true;
    for (index, ended) in ended.iter().enumerate() {
        let share = run.join("share");
        // The share's files have the host's clock: the marker's time of change is when the
        // command started.
        let marker =
            fs::metadata(share.join(format!("vm{index}.started"))).and_then(|metadata| metadata.modified());
        if let Ok(command_started) = marker {
            let boot = command_started.duration_since(started_at).unwrap_or_default();
            say(format_args!(
                "vm{index}: command started {} s after QEMU did, QEMU exited after {} s",
                seconds(boot),
                seconds(ended.after)
            ));
        }
        let status = fs::read_to_string(share.join(format!("vm{index}.status"))).unwrap_or_default();
        let verdict = Verdict::of(ended.ending, status.trim());
        match verdict {
            Verdict::TimedOut => say(format_args!(
                "vm{index}: killed after {} s (--timeout): it did not finish",
                args.timeout.as_secs()
            )),
            Verdict::Unfinished { qemu_status } => {
                let log = run.join(format!("vm{index}.qemu.log"));
                say(format_args!(
                    "vm{index}: did not run its command to the end (QEMU exit {qemu_status}; its console is above, \
                     QEMU's messages in {}):",
                    log.display()
                ));
                print_prefixed(&log, &format!("[vm{index} qemu]"));
            }
            Verdict::CommandFailed { exit } => say(format_args!("vm{index}: command failed, exit {exit}")),
            Verdict::Succeeded => say(format_args!("vm{index}: command succeeded")),
        }
        succeeded &= verdict == Verdict::Succeeded;
    }
    succeeded
}

/// What became of one VM.
#[derive(Debug, PartialEq, Eq)]
enum Verdict<'a> {
    TimedOut,
    /// Its command never wrote an exit code: the VM failed before or while running it.
    Unfinished {
        qemu_status: i32,
    },
    CommandFailed {
        exit: &'a str,
    },
    Succeeded,
}

impl<'a> Verdict<'a> {
    /// From how QEMU ended and the exit code the command left in the share (empty if none).
    fn of(ending: Ending, exit: &'a str) -> Self {
        match ending {
            Ending::TimedOut => Verdict::TimedOut,
            Ending::Exited(qemu_status) if exit.is_empty() => Verdict::Unfinished { qemu_status },
            Ending::Exited(_) if exit != "0" => Verdict::CommandFailed { exit },
            Ending::Exited(_) => Verdict::Succeeded,
        }
    }
}

/// Prints a file's lines, each after `prefix` and a space, without a console's carriage
/// returns; nothing if the file is missing.
fn print_prefixed(file: &Path, prefix: &str) {
    let Ok(bytes) = fs::read(file) else { return };
    for line in prefixed_lines(&String::from_utf8_lossy(&bytes), prefix) {
        println!("{line}");
    }
}

fn prefixed_lines<'a>(text: &'a str, prefix: &'a str) -> impl Iterator<Item = String> + 'a {
    text.lines().map(move |line| format!("{prefix} {}", line.strip_suffix('\r').unwrap_or(line)))
}

/// A run folder's name starts with its start, to the second: 20261126-200543.
fn folder_stamp(time: SystemTime) -> String {
    let digits: String =
        humantime::format_rfc3339_seconds(time).to_string().chars().filter(char::is_ascii_digit).collect();
    format!("{}-{}", &digits[..8], &digits[8..])
}

/// A file removed when dropped, whichever way the run ends.
struct RemovedOnDrop(PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_vm_succeeds_only_when_it_finished_in_time_and_its_command_exited_0() {
        assert_eq!(Verdict::of(Ending::Exited(0), "0"), Verdict::Succeeded);
        assert_eq!(Verdict::of(Ending::Exited(0), "3"), Verdict::CommandFailed { exit: "3" });
        assert_eq!(Verdict::of(Ending::Exited(1), ""), Verdict::Unfinished { qemu_status: 1 });
        // A kill at the deadline wins over an exit code written just before it.
        assert_eq!(Verdict::of(Ending::TimedOut, "0"), Verdict::TimedOut);
    }

    #[test]
    fn console_lines_are_prefixed_without_carriage_returns() {
        let lines: Vec<String> = prefixed_lines("booting\r\nrxe0 up\r\nlast", "[vm1]").collect();
        assert_eq!(lines, ["[vm1] booting", "[vm1] rxe0 up", "[vm1] last"]);
    }

    #[test]
    fn run_folders_are_named_by_their_start_to_the_second() {
        let time = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_723_543);
        assert_eq!(folder_stamp(time), "20261126-200543");
    }

    #[test]
    fn the_run_files_guard_removes_it() {
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("initrd.gz");
        fs::write(&path, "archive").unwrap();
        drop(RemovedOnDrop(path.clone()));
        assert!(!path.exists());
    }
}
