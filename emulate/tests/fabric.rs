//! An emulated network's namespaces as the kernel sees them: needs root, skipped otherwise.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use netagg_emulate::fabric::{Fabric, ImpairerChoice};
use netagg_emulate::link::Link;

const IPTABLES_SWITCH: &str = "/proc/sys/net/bridge/bridge-nf-call-iptables";

/// Whether the namespace `namespace` shows the file `path` of /proc/sys.
fn exists_in(namespace: &str, path: &str) -> bool {
    let status = Command::new("ip")
        .args(["netns", "exec", namespace, "test", "-e", path])
        .status()
        .expect("running ip");
    status.success()
}

/// A file of /proc/sys as the namespace `namespace` shows it.
fn sysctl_in(namespace: &str, path: &str) -> String {
    let output =
        Command::new("ip").args(["netns", "exec", namespace, "cat", path]).output().expect("running ip");
    assert!(
        output.status.success(),
        "reading {path} in {namespace}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

#[test]
fn the_fabric_s_bridges_skip_netfilter_and_the_host_s_are_left_alone() {
    // SAFETY: geteuid takes nothing and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: an emulated network needs root");
        return;
    }
    if !Path::new(IPTABLES_SWITCH).exists() {
        eprintln!("skipped: br_netfilter is not loaded, so no bridge calls netfilter");
        return;
    }
    let host_before = std::fs::read_to_string(IPTABLES_SWITCH).expect("the host's switch");
    let link = Link { rate: Some(100_000_000), delay: Duration::from_millis(1), ..Link::default() };
    let prefix = format!("nf-{}", std::process::id());
    let fabric = Fabric::create(&prefix, vec![link; 2], Vec::new(), None, ImpairerChoice::Auto)
        .expect("building the network");
    if !exists_in(&fabric.fabric_namespace(), IPTABLES_SWITCH) {
        eprintln!(
            "skipped: this kernel (before 5.3) shows the bridge-nf switches in no namespace but the host's"
        );
        return;
    }
    for switch in ["bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-call-arptables"] {
        let path = format!("/proc/sys/net/bridge/{switch}");
        assert_eq!(sysctl_in(&fabric.fabric_namespace(), &path), "0", "{path} in the fabric");
    }
    // The host's own switch is the host's.
    assert_eq!(std::fs::read_to_string(IPTABLES_SWITCH).expect("the host's switch"), host_before);
    let namespace = fabric.fabric_namespace();
    drop(fabric);
    assert!(!Path::new(&format!("/run/netns/{namespace}")).exists(), "the fabric's namespace was removed");
}
