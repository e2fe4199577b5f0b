//! `netagg-rdma-devices`: this machine's RDMA devices as netagg sees them, each port's
//! state and active MTU, and its GID table, to choose `[backend.rdma]`'s device and GID
//! index (RoCE v2 wants the GID of the interface's IPv4 or IPv6 address). Exits 1, with
//! the reason and how to get a device, where there is none.

use std::process::ExitCode;

use netagg_rdma::{devices, Device};

fn main() -> ExitCode {
    match list() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("netagg-rdma-devices: {error}");
            ExitCode::FAILURE
        }
    }
}

fn list() -> Result<(), netagg_rdma::RdmaError> {
    for name in devices()? {
        let device = Device::open(Some(&name))?;
        let port = device.port(1)?;
        println!("{name} port 1: {:?}, active MTU {}", port.state, port.active_mtu);
        for index in 0..port.gid_table_len {
            let gid = device.gid(1, index)?;
            if !gid.is_unspecified() {
                println!("{name} port 1 gid {index}: {gid}");
            }
        }
    }
    Ok(())
}
