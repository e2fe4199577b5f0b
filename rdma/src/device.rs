//! Verbs devices: which there are, and one opened.

use std::ffi::CStr;
use std::io;
use std::net::Ipv6Addr;
use std::ptr::NonNull;

use rdma_sys::{ibv_context, ibv_device, ibv_port_attr, ibv_port_state};

use crate::RdmaError;

/// The names of this machine's verbs devices (`mlx5_0`, `rxe0`), in the order libibverbs
/// lists them; an error that says how to get one when there are none.
pub fn devices() -> Result<Vec<String>, RdmaError> {
    let list = DeviceList::get()?;
    // SAFETY: devices of the list, alive while it is.
    Ok(list.devices().map(|device| unsafe { device_name(device) }).collect())
}

/// libibverbs' device list, freed on drop.
struct DeviceList {
    list: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList {
    /// The list; an error when it is empty or the kernel has no RDMA support at all.
    fn get() -> Result<DeviceList, RdmaError> {
        let mut len = 0;
        // SAFETY: `len` is alive for the call; a null result is handled.
        let list = unsafe { rdma_sys::ibv_get_device_list(&mut len) };
        let Some(list) = NonNull::new(list) else {
            return Err(no_device(io::Error::last_os_error().raw_os_error()));
        };
        let list = DeviceList { list, len: usize::try_from(len).unwrap_or(0) };
        if list.len == 0 {
            return Err(no_device(None));
        }
        Ok(list)
    }

    /// The devices, valid while the list lives.
    fn devices(&self) -> impl Iterator<Item = *mut ibv_device> + '_ {
        // SAFETY: libibverbs returned an array of `len` device pointers, alive until
        // the list is freed.
        (0..self.len).map(|index| unsafe { *self.list.as_ptr().add(index) })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: owned; devices opened from it keep what they need (libibverbs counts
        // references), so only the array goes.
        unsafe { rdma_sys::ibv_free_device_list(self.list.as_ptr()) }
    }
}

/// A device's name (`rxe0`), empty if it has none.
///
/// # Safety
/// `device` is a live device: of a device list not yet freed, or of an open context.
pub(crate) unsafe fn device_name(device: *mut ibv_device) -> String {
    // SAFETY: the caller vouches for the device.
    let name = unsafe { rdma_sys::ibv_get_device_name(device) };
    if name.is_null() {
        return String::new();
    }
    // SAFETY: a device's name is a NUL-terminated string that lives as long as it.
    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
}

/// Why there is no device, from the errno of a device list that could not be had (None
/// for a list that was empty). A kernel without RDMA support answers ENOSYS, not an
/// empty list.
fn no_device(errno: Option<i32>) -> RdmaError {
    let why = match errno {
        None | Some(0) => "none is configured".to_string(),
        Some(libc::ENOSYS) => {
            "this kernel has no RDMA support (listing devices: function not implemented)".to_string()
        }
        Some(code) => format!("listing devices failed: {}", io::Error::from_raw_os_error(code)),
    };
    RdmaError::NoDevice { why }
}

/// A port's state, as the subnet manager (or the Ethernet link, for RoCE) sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    Down,
    Init,
    Armed,
    Active,
    Other(u32),
}

/// What a port is: its state, the path MTU in use, and how many GIDs it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    pub state: PortState,
    /// Bytes of the active MTU (256 to 4096).
    pub active_mtu: u32,
    pub gid_table_len: u32,
}

/// An opened verbs device, closed on drop.
pub struct Device {
    context: NonNull<ibv_context>,
    name: String,
}

// SAFETY: a verbs context may be used from any thread (libibverbs is thread-safe).
unsafe impl Send for Device {}
// SAFETY: as for Send; `&Device` only queries the context.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the device named `name`, or the first there is.
    pub fn open(name: Option<&str>) -> Result<Device, RdmaError> {
        let list = DeviceList::get()?;
        // SAFETY: devices of the list, alive while it is.
        let names = || list.devices().map(|device| (device, unsafe { device_name(device) }));
        let chosen = match name {
            None => names().next(),
            Some(name) => names().find(|(_, found)| found == name),
        };
        let Some((device, name)) = chosen else {
            let available = names().map(|(_, name)| name).collect::<Vec<_>>().join(", ");
            return Err(RdmaError::UnknownDevice { name: name.unwrap_or_default().into(), available });
        };
        // SAFETY: a device of the list, alive while it is; the context keeps what it needs.
        let context = unsafe { rdma_sys::ibv_open_device(device) };
        let Some(context) = NonNull::new(context) else {
            let reason = io::Error::last_os_error().to_string();
            return Err(RdmaError::Device { device: name, what: "cannot open it", reason });
        };
        Ok(Device { context, name })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What port `port` (numbered from 1) is.
    pub fn port(&self, port: u8) -> Result<PortInfo, RdmaError> {
        // SAFETY: a C struct of integers, for which all zeros is valid.
        let mut attributes: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open (owned); `attributes` is alive for the call.
        let result = unsafe { rdma_sys::___ibv_query_port(self.context.as_ptr(), port, &mut attributes) };
        if result != 0 {
            return Err(self.failed("cannot query its port", result));
        }
        let state = match attributes.state {
            ibv_port_state::IBV_PORT_DOWN => PortState::Down,
            ibv_port_state::IBV_PORT_INIT => PortState::Init,
            ibv_port_state::IBV_PORT_ARMED => PortState::Armed,
            ibv_port_state::IBV_PORT_ACTIVE => PortState::Active,
            other => PortState::Other(other),
        };
        Ok(PortInfo {
            state,
            active_mtu: 128 << attributes.active_mtu,
            gid_table_len: u32::try_from(attributes.gid_tbl_len).unwrap_or(0),
        })
    }

    /// GID `index` of port `port`: for RoCE, an IPv6 address or an IPv4-mapped one
    /// (`::ffff:10.0.0.1`); all zero where the entry is unused.
    pub fn gid(&self, port: u8, index: u32) -> Result<Ipv6Addr, RdmaError> {
        // SAFETY: a union of byte arrays and integers, for which all zeros is valid.
        let mut gid: rdma_sys::ibv_gid = unsafe { std::mem::zeroed() };
        let index = i32::try_from(index).unwrap_or(i32::MAX);
        // SAFETY: the context is open (owned); `gid` is alive for the call.
        let result = unsafe { rdma_sys::ibv_query_gid(self.context.as_ptr(), port, index, &mut gid) };
        if result != 0 {
            return Err(self.failed("cannot read its GID table", result));
        }
        // SAFETY: every variant of the union is plain bytes; `raw` reads all 16.
        Ok(Ipv6Addr::from(unsafe { gid.raw }))
    }

    fn failed(&self, what: &'static str, result: i32) -> RdmaError {
        // Verbs calls return an errno, or -1 with errno set.
        let error =
            if result > 0 { io::Error::from_raw_os_error(result) } else { io::Error::last_os_error() };
        RdmaError::Device { device: self.name.clone(), what, reason: error.to_string() }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: owned, and nothing made from it outlives the device (it makes nothing).
        unsafe { rdma_sys::ibv_close_device(self.context.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_says_why_and_how_to_get_one() {
        let message = no_device(Some(38)).to_string();
        assert!(message.starts_with("no RDMA device: this kernel has no RDMA support"), "{message}");
        assert!(message.contains("rdma link add rxe0 type rxe netdev eth0"), "{message}");
        assert!(message.contains("backend = udp needs none"), "{message}");
        assert!(no_device(None).to_string().starts_with("no RDMA device: none is configured."));
        assert!(no_device(Some(13)).to_string().contains("listing devices failed: Permission denied"));
    }

    /// On this machine: either devices, each openable with an active or inactive first
    /// port, or the error that says there are none, never a crash.
    #[test]
    fn this_machines_devices_open_or_their_absence_is_explained() {
        match devices() {
            Ok(names) => {
                assert!(!names.is_empty());
                let device = Device::open(Some(&names[0])).expect("a listed device opens");
                assert!(device.port(1).is_ok());
            }
            Err(error) => {
                assert!(matches!(error, RdmaError::NoDevice { .. }), "{error}");
                let error = Device::open(None).err().expect("nothing to open");
                assert!(error.to_string().contains("rdma link add"), "{error}");
            }
        }
    }
}
