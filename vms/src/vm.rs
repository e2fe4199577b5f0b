//! QEMU's lifecycle: two VMs joined by a dgram link over loopback (each sends its
//! Ethernet frames to the other's UDP port), each killed at the run's deadline, and both
//! killed and reaped on every way out of the runner.

use std::fs::File;
use std::net::UdpSocket;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime};

use crate::process::describe;
use crate::{at, Error};

/// Each VM's address on the link; its peer's is the other.
pub const IPS: [&str; 2] = ["10.77.0.1", "10.77.0.2"];
const MACS: [&str; 2] = ["52:54:00:77:00:01", "52:54:00:77:00:02"];
/// How often the runner looks for a VM that ended, a deadline or a signal.
const POLL: Duration = Duration::from_millis(20);

/// What both VMs boot, and the run folder that holds their consoles and share.
pub struct Boot<'a> {
    pub vmlinux: &'a Path,
    pub initrd: &'a Path,
    pub run: &'a Path,
}

impl Boot<'_> {
    /// QEMU's command line for VM `index`, whose link sends to `ports[1 - index]`.
    pub fn qemu(&self, index: usize, ports: [u16; 2]) -> Command {
        let peer = 1 - index;
        let share = self.run.join("share");
        let mut command = Command::new("qemu-system-x86_64");
        command
            .args(["-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", "1024"])
            .args(["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
            .arg("-kernel")
            .arg(self.vmlinux)
            .arg("-initrd")
            .arg(self.initrd)
            .arg("-append")
            // no_timer_check: on a busy host, TCG's timer can miss the kernel's early check
            // of the IO-APIC timer, which then panics before init ("IO-APIC + timer doesn't
            // work!"); the check guards against broken hardware, not a VM's slow clock.
            .arg(format!(
                "console=ttyS0 quiet panic=-1 no_timer_check VM_INDEX={index} VM_IP={} PEER_IP={}",
                IPS[index], IPS[peer]
            ))
            .arg("-serial")
            .arg(format!("file:{}", self.run.join(format!("vm{index}.console")).display()))
            .arg("-netdev")
            .arg(format!(
                "dgram,id=n0,local.type=inet,local.host=127.0.0.1,local.port={},\
                 remote.type=inet,remote.host=127.0.0.1,remote.port={}",
                ports[index], ports[peer]
            ))
            .arg("-device")
            .arg(format!("virtio-net-pci,netdev=n0,mac={},romfile=", MACS[index]))
            .arg("-virtfs")
            // QEMU's option syntax doubles a comma that is part of a value.
            .arg(format!(
                "local,path={},mount_tag=share,security_model=none",
                share.display().to_string().replace(',', ",,")
            ));
        command
    }
}

/// Two UDP ports on 127.0.0.1 that nothing uses now, different from each other: the
/// kernel's choice for two sockets bound at once, released for QEMU to bind.
pub fn free_udp_ports() -> std::io::Result<[u16; 2]> {
    let sockets = [UdpSocket::bind("127.0.0.1:0")?, UdpSocket::bind("127.0.0.1:0")?];
    Ok([sockets[0].local_addr()?.port(), sockets[1].local_addr()?.port()])
}

/// How a VM's QEMU ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// On its own, with this status as a shell gives it (128 + a signal's number).
    Exited(i32),
    /// Killed at the deadline.
    TimedOut,
}

/// A VM's end, and how long after the start it came.
#[derive(Clone, Copy, Debug)]
pub struct Ended {
    pub ending: Ending,
    pub after: Duration,
}

/// Processes started together, each killed at a common deadline, all killed and reaped
/// when dropped: no VM outlives the runner, whichever way it leaves.
pub struct Machines {
    children: Vec<Option<Child>>,
    ended: Vec<Option<Ended>>,
    started: Instant,
    /// The start on the wall clock, which the share's files are stamped with.
    pub started_at: SystemTime,
    timeout: Duration,
}

impl Machines {
    /// Starts each command, its standard input empty, its output in its log file.
    pub fn start(
        commands: impl IntoIterator<Item = (Command, PathBuf)>,
        timeout: Duration,
    ) -> Result<Self, Error> {
        let mut machines = Machines {
            children: Vec::new(),
            ended: Vec::new(),
            started: Instant::now(),
            started_at: SystemTime::now(),
            timeout,
        };
        for (mut command, log) in commands {
            let output = File::create(&log).map_err(at(&log))?;
            let errors = output.try_clone().map_err(at(&log))?;
            command.stdin(Stdio::null()).stdout(output).stderr(errors);
            let child =
                command.spawn().map_err(|source| Error::Spawn { command: describe(&command), source })?;
            machines.children.push(Some(child));
            machines.ended.push(None);
        }
        Ok(machines)
    }

    /// Waits until every process has ended or been killed at the deadline, in start order;
    /// or until `interrupted` returns a signal's number, which it returns after killing
    /// them all.
    pub fn wait(mut self, mut interrupted: impl FnMut() -> Option<i32>) -> Result<Vec<Ended>, Error> {
        while self.children.iter().any(Option::is_some) {
            if let Some(signal) = interrupted() {
                return Err(Error::Interrupted(signal));
            }
            let timed_out = self.started.elapsed() >= self.timeout;
            for (slot, ended) in self.children.iter_mut().zip(&mut self.ended) {
                let Some(child) = slot else { continue };
                let ending = match child.try_wait() {
                    Ok(Some(status)) => Ending::Exited(shell_status(status)),
                    Ok(None) if timed_out => {
                        reap(child);
                        Ending::TimedOut
                    }
                    Ok(None) => continue,
                    Err(source) => return Err(Error::Wait(source)),
                };
                *ended = Some(Ended { ending, after: self.started.elapsed() });
                *slot = None;
            }
            std::thread::sleep(POLL);
        }
        Ok(self.ended.iter().map(|ended| ended.expect("every process ended")).collect())
    }
}

impl Drop for Machines {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            reap(child);
        }
    }
}

/// Kills a process and waits for it, so that it leaves no zombie.
fn reap(child: &mut Child) {
    // It may have ended already, and then the kill fails: the wait still reaps it.
    let _ = child.kill();
    let _ = child.wait();
}

/// A status as a shell reports it: the exit code, or 128 plus the signal that ended it.
fn shell_status(status: ExitStatus) -> i32 {
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(script: &str) -> Command {
        let mut command = Command::new("sh");
        command.args(["-c", script]);
        command
    }

    #[test]
    fn each_process_ends_on_its_own_or_at_the_deadline_and_its_output_is_logged() {
        let folder = tempfile::tempdir().unwrap();
        let logs = [folder.path().join("0.log"), folder.path().join("1.log"), folder.path().join("2.log")];
        let machines = Machines::start(
            vec![
                (shell("echo out; echo err >&2; exit 3"), logs[0].clone()),
                (shell("exec sleep 30"), logs[1].clone()),
                (shell("kill -TERM $$"), logs[2].clone()),
            ],
            Duration::from_millis(500),
        )
        .unwrap();
        let started = Instant::now();
        let ended = machines.wait(|| None).unwrap();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(ended[0].ending, Ending::Exited(3));
        assert_eq!(ended[1].ending, Ending::TimedOut);
        assert!(ended[1].after >= Duration::from_millis(500));
        assert_eq!(ended[2].ending, Ending::Exited(128 + 15));
        assert_eq!(std::fs::read_to_string(&logs[0]).unwrap(), "out\nerr\n");
    }

    #[test]
    fn an_interruption_and_a_drop_kill_and_reap_every_process() {
        let folder = tempfile::tempdir().unwrap();
        let log = folder.path().join("log");
        let machines = Machines::start([(shell("exec sleep 30"), log)], Duration::from_secs(60)).unwrap();
        let pid = machines.children[0].as_ref().unwrap().id();
        let mut polls = 0;
        let interrupted = machines.wait(|| {
            polls += 1;
            (polls == 3).then_some(2)
        });
        assert!(matches!(interrupted, Err(Error::Interrupted(2))));
        // Reaped: not even a zombie is left.
        assert!(!Path::new(&format!("/proc/{pid}")).exists());
    }

    #[test]
    fn the_two_ports_are_distinct_and_free() {
        let ports = free_udp_ports().unwrap();
        assert_ne!(ports[0], ports[1]);
        for port in ports {
            assert_ne!(port, 0);
            UdpSocket::bind(("127.0.0.1", port)).unwrap();
        }
    }

    #[test]
    fn each_vm_sends_to_the_others_port_and_has_its_own_address_console_and_mac() {
        let boot = Boot {
            vmlinux: Path::new("/k/vmlinux"),
            initrd: Path::new("/r,1/initrd.gz"),
            run: Path::new("/r,1"),
        };
        let line = describe(&boot.qemu(1, [40000, 40001]));
        assert!(
            line.contains("local.port=40001,remote.type=inet,remote.host=127.0.0.1,remote.port=40000"),
            "{line}"
        );
        assert!(line.contains("no_timer_check VM_INDEX=1 VM_IP=10.77.0.2 PEER_IP=10.77.0.1"), "{line}");
        assert!(line.contains("-serial file:/r,1/vm1.console"), "{line}");
        assert!(line.contains("mac=52:54:00:77:00:02"), "{line}");
        assert!(line.contains("local,path=/r,,1/share,mount_tag=share"), "{line}");
        assert!(line.contains("-kernel /k/vmlinux -initrd /r,1/initrd.gz"), "{line}");
    }
}
