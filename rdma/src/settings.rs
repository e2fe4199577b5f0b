//! What an RDMA endpoint is configured with, made into what connections need, the same
//! way on both sides: the caller maps its own configuration onto [`Settings`].

use std::net::IpAddr;

use crate::{devices, Device, Options, PortState, RdmaError, Wait};

/// An RDMA endpoint's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The verbs device (`rxe0`, `mlx5_0`); empty: the one rdma_cm routes the peer through.
    pub device: String,
    /// The device's port, from 1.
    pub device_port: u8,
    /// With a named device, the GID whose address the endpoint takes.
    pub gid_index: u32,
    /// Messages each queue pair keeps posted for receiving, and sends in flight at most.
    pub queue_depth: u32,
    /// How a queue pair's completions are waited for.
    pub wait: Wait,
}

/// Where this side's connections live: `None` where rdma_cm may choose (no device
/// named), else the address in GID `gid_index` of the named device's port. An error if
/// this host has no RDMA device at all, or not the one named, or its port is not up, or
/// the GID holds no address; `section` names where the settings came from
/// (`backend.rdma`), so that the error names the key to change.
pub fn local_ip(settings: &Settings, section: &str) -> Result<Option<IpAddr>, RdmaError> {
    // First, so that a host without RDMA says so whatever else is configured.
    devices()?;
    if settings.device.is_empty() {
        return Ok(None);
    }
    let device = Device::open(Some(&settings.device))?;
    let port = device.port(settings.device_port)?;
    if port.state != PortState::Active {
        return Err(RdmaError::Device {
            device: settings.device.clone(),
            what: "its port is not up",
            reason: format!("port {} is {:?} ({section}.device_port)", settings.device_port, port.state),
        });
    }
    let gid = device.gid(settings.device_port, settings.gid_index)?;
    if gid.is_unspecified() {
        return Err(RdmaError::Device {
            device: settings.device.clone(),
            what: "the GID chosen holds no address",
            reason: format!(
                "GID {} of port {} is empty ({section}.gid_index; netagg-rdma-devices lists them)",
                settings.gid_index, settings.device_port
            ),
        });
    }
    // RoCE keeps an IPv4 address as an IPv4-mapped GID.
    Ok(Some(IpAddr::V6(gid).to_canonical()))
}

/// A connection's options from the settings, its buffers `message_size` bytes each.
pub fn options(settings: &Settings, message_size: usize) -> Options {
    Options { depth: settings.queue_depth as usize, message_size, wait: settings.wait }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(device: &str) -> Settings {
        Settings { device: device.into(), device_port: 1, gid_index: 1, queue_depth: 64, wait: Wait::Busy }
    }

    #[test]
    fn options_take_the_depth_the_wait_and_the_size_given() {
        let mut settings = settings("");
        assert_eq!(options(&settings, 1072), Options { depth: 64, message_size: 1072, wait: Wait::Busy });
        settings.wait = Wait::Event;
        assert_eq!(options(&settings, 4096).wait, Wait::Event);
    }

    /// On a host whose kernel has no RDMA (this one, and CI's), a named device and an
    /// unnamed one alike get the error that says so, first.
    #[test]
    fn without_rdma_the_local_address_is_the_no_device_error() {
        if std::path::Path::new("/sys/class/infiniband").exists() {
            return; // A host with RDMA devices: the VM tests cover it.
        }
        for device in ["", "rxe0"] {
            let error = local_ip(&settings(device), "backend.rdma").unwrap_err();
            assert!(matches!(error, RdmaError::NoDevice { .. }), "{error}");
        }
    }
}
