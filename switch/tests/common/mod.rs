//! What the switch's in-memory tests share: a switch whose data port is a
//! [`MemorySocket`], and registrations of one thread with 4-element packets.
#![allow(dead_code)]

use netagg_switch::port::{MemoryNetwork, MemorySocket};
use netagg_switch::Switch;
use netagg_wire::{ControlMessage, Endpoint, ValueEncoding};

/// Where the switch's memory port is bound.
pub const SWITCH_DATA: &str = "127.0.0.1:48864";

/// A switch on loopback TCP whose data port is a socket of `network` at [`SWITCH_DATA`],
/// its settings changed by `adjust`.
pub fn memory_switch(network: &MemoryNetwork, adjust: impl FnOnce(&mut netagg_config::Switch)) -> Switch {
    let mut settings = netagg_config::Config::default().switch;
    settings.control = "127.0.0.1:0".parse().unwrap();
    adjust(&mut settings);
    let port: MemorySocket = network.bind(SWITCH_DATA.parse().unwrap()).unwrap();
    Switch::start_with_port(&settings, port).expect("a switch starts over a memory port")
}

/// A registration of `rank` of `world_size` in session `name`, one thread at `endpoint`.
pub fn register_message(rank: u16, world_size: u16, name: &str, endpoint: Endpoint) -> ControlMessage {
    ControlMessage::Register {
        rank,
        world_size,
        packet_elements: 4,
        slots: 1,
        depth: 2,
        encoding: ValueEncoding::Native,
        sparse_blocks: false,
        name: name.into(),
        endpoints: vec![endpoint],
    }
}
