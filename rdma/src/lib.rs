//! netagg's RDMA endpoint, over libibverbs and librdmacm (the `rdma-sys` bindings).
//!
//! - [`devices`] lists the verbs devices of this machine, and says clearly when there are
//!   none, and how to get one;
//! - [`Device`]: an opened device, its ports and their GID tables, closed on drop;
//! - [`Listener`] and [`Connection`]: reliable connections (RC queue pairs) set up
//!   through rdma_cm, carrying messages with SEND and RECV from registered buffers;
//! - [`tagged`]: connections bound to the peers that announced their tags, and
//!   [`Port`], the listening side of many of them;
//! - [`reaper`]: a thread that destroys connections, so that no data path or shutdown
//!   waits for a kernel slow to destroy a queue pair whose peer vanished;
//! - [`settings`]: an endpoint's [`Settings`] made into addresses and options.
//!
//! All unsafe code of netagg's RDMA path is in this crate: in thin owning wrappers over
//! the verbs and rdma_cm objects (`verbs`) and in [`Device`]. The connection logic above
//! them calls unsafe code only to lend its registered buffers and post them, where it
//! alone knows which ones the device is using.

mod connection;
mod device;
mod listener;
mod port;
pub mod reaper;
mod returns;
pub mod settings;
pub mod tagged;
mod verbs;

pub use connection::{recv_any, sleep_until_readable, Connection, Options, RecvFailure, Wait};
pub use device::{devices, Device, PortInfo, PortState};
pub use listener::{Listener, Request};
pub use port::{Closed, Port};
pub use reaper::Reaper;
pub use settings::Settings;

/// Why RDMA could not do what was asked: whole sentences for the user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RdmaError {
    #[error(
        "no RDMA device: {why}. Soft-RoCE makes one over any Ethernet interface where the kernel has \
         the rdma_rxe module (rdma link add rxe0 type rxe netdev eth0); backend = udp needs none"
    )]
    NoDevice { why: String },
    #[error("no RDMA device named '{name}'; this machine has {available}")]
    UnknownDevice { name: String, available: String },
    #[error("RDMA device {device}: {what}: {reason}")]
    Device { device: String, what: &'static str, reason: String },
}
