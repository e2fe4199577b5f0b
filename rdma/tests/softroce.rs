//! The RDMA crate on real verbs devices: two QEMU VMs with Debian's kernel and a
//! Soft-RoCE link (`scripts/softroce-vms`), each listing its device with
//! `netagg-rdma-devices`, and an RC connection between them (`netagg-rdma-echo`). Needs root and QEMU, as CI has (the script installs QEMU);
//! ignored in a plain `cargo test`, run by `scripts/test` in its own stage.

use std::path::Path;
use std::process::{Command, Output};

fn softroce_vms(vm0: &str, vm1: &str) -> (Output, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/softroce-vms");
    let output = Command::new(script)
        .args(["--timeout", "120", "--bin", env!("CARGO_BIN_EXE_netagg-rdma-devices")])
        .args(["--bin", env!("CARGO_BIN_EXE_netagg-rdma-echo")])
        .args(["--vm0", vm0, "--vm1", vm1])
        .output()
        .expect("scripts/softroce-vms runs");
    let all =
        format!("{}\n{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output, all)
}

#[test]
#[ignore = "needs root and boots QEMU VMs: scripts/test runs it in its own stage"]
fn each_vm_sees_its_soft_roce_device_active_with_its_address_as_a_gid() {
    let (output, all) = softroce_vms("netagg-rdma-devices", "netagg-rdma-devices");
    assert!(output.status.success(), "{all}");
    for (vm, ip) in [("vm0", "10.77.0.1"), ("vm1", "10.77.0.2")] {
        assert!(all.contains(&format!("[{vm}] rxe0 port 1: Active, active MTU 1024")), "{all}");
        // RoCE v2's GID for the interface's IPv4 address, which [backend.rdma] will use.
        assert!(all.contains(&format!("[{vm}] rxe0 port 1 gid 1: ::ffff:{ip}")), "{all}");
    }
}

#[test]
#[ignore = "needs root and boots QEMU VMs: scripts/test runs it in its own stage"]
fn a_command_that_fails_in_a_vm_fails_the_run() {
    let (output, all) = softroce_vms("netagg-rdma-devices", "exit 3");
    assert!(!output.status.success(), "{all}");
    assert!(all.contains("vm1: command failed, exit 3"), "{all}");
    assert!(all.contains("[vm0] rxe0 port 1: Active"), "{all}");
}

/// vm1 connects (retrying while vm0 boots), sends 2000 netagg-sized datagrams (48-byte
/// header and 256 elements), 16 in flight, and checks every echo byte for byte. Then it
/// connects again, has one message echoed, and sends one a byte longer than the server's
/// receive buffers: the server's receive fails, and both queue pairs go to the error
/// state with every request each had posted (32 receives, the depth) still to come back.
/// One boot of the VMs for both, to keep CI short.
#[test]
#[ignore = "needs root and boots QEMU VMs: scripts/test runs it in its own stage"]
fn an_rc_connection_carries_messages_tells_when_the_peer_leaves_and_returns_every_request_when_it_fails() {
    let (output, all) = softroce_vms(
        "netagg-rdma-echo serve 10.77.0.1:7471 && netagg-rdma-echo serve 10.77.0.1:7471",
        "netagg-rdma-echo send 10.77.0.1:7471 2000 1072 && netagg-rdma-echo overflow 10.77.0.1:7471",
    );
    assert!(output.status.success(), "{all}");
    assert!(all.contains("[vm1] 2000 messages of 1072 bytes echoed and checked"), "{all}");
    assert!(all.contains("[vm0] accepted a connection, private data \"netagg-rdma-echo"), "{all}");
    // The sender's exit disconnected its queue pair, which the server saw at once.
    assert!(all.contains("[vm0] connection ended: the peer disconnected"), "{all}");
    assert!(all.contains("[vm0] echoed 2000 messages"), "{all}");

    let last = |prefix: &str| {
        all.lines()
            .rev()
            .find_map(|line| line.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no '{prefix}':\n{all}"))
            .to_string()
    };
    let server = last("[vm0] connection ended: ");
    let sender = last("[vm1] the overlong message ended the connection: ");
    for error in [&server, &sender] {
        assert!(error.contains("32 receives came back ("), "{error}\n{all}");
        assert!(error.ends_with(", every request posted"), "{error}\n{all}");
    }
    // Only the overlong message's receive failed for a cause; none came back whole.
    assert!(!server.contains("success"), "{server}");
    assert!(sender.contains(" sends came back ("), "{sender}");
    assert!(all.contains("[vm0] echoed 1 messages"), "{all}");
}
